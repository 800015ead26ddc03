from django.contrib import admin, messages

from .models import Certificate
from .services import PkiError, cert_revoke


@admin.register(Certificate)
class CertificateAdmin(admin.ModelAdmin):
    """Certificates are issued with 'llmgw ctl cert' on the host holding the
    authority's key, and revoked through the service (never deleted: the row
    is what makes a revocation stick)."""

    list_display = ("common_name", "kind", "serial", "not_after", "revoked_at")
    list_filter = ("kind",)
    search_fields = ("common_name", "serial", "fingerprint_sha256")
    readonly_fields = [f.name for f in Certificate._meta.fields]
    actions = ["revoke"]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.action(description="Revoke the selected certificates", permissions=["change"])
    def revoke(self, request, queryset):
        revoked = []
        for cert in queryset:
            try:
                revoked += cert_revoke(target=cert.serial,
                                       reason=f"revoked in the admin by {request.user.get_username()}")
            except PkiError as exc:
                self.message_user(request, f"{cert.common_name} ({cert.serial}): {exc}", messages.WARNING)
        if revoked:
            self.message_user(request, f"revoked: {', '.join(c.common_name for c in revoked)}", messages.SUCCESS)
