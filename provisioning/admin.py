from django.contrib import admin

from .models import Hypervisor, Job, Step


@admin.register(Hypervisor)
class HypervisorAdmin(admin.ModelAdmin):
    """Read-only: hypervisors are added, changed and removed with 'llmgw ctl',
    the API or the provisioning page, which validate every field, ask for the
    token's secret again when its destination changes, and record who did it.
    The stored secret is never shown, not even encrypted."""

    list_display = ["name", "url", "token_id", "node", "storage", "image", "bridge"]
    search_fields = ["name", "url"]
    exclude = ["token_secret_encrypted"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class StepInline(admin.TabularInline):
    model = Step
    extra = 0
    can_delete = False
    fields = ["index", "title", "status", "started_at", "finished_at", "log"]
    readonly_fields = fields

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    """Read-only: jobs are started, retried and cancelled with 'llmgw ctl' or the API."""

    list_display = ["id", "kind", "node_name", "hypervisor", "status", "created_at", "finished_at"]
    list_filter = ["kind", "status"]
    search_fields = ["node_name"]
    inlines = [StepInline]
    exclude = ["lease_owner", "lease_until", "wake", "marker"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
