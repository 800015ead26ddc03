from django.contrib import admin

from .models import Certificate


@admin.register(Certificate)
class CertificateAdmin(admin.ModelAdmin):
    list_display = ("common_name", "kind", "serial", "not_after", "revoked_at")
    list_filter = ("kind",)
    search_fields = ("common_name", "serial", "fingerprint_sha256")
    readonly_fields = [f.name for f in Certificate._meta.fields]

    def has_add_permission(self, request):
        # Certificates are issued with 'llmgw ctl cert', on the host holding the key.
        return False
