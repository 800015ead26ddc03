from django import forms
from django.contrib import admin, messages

from .catalog import CatalogInvalid, catalog_upsert, model_remove
from .models import CatalogEntry, Drain, GpuAllocation, Member, PortAllocation, Replica
from .validation import ENTRY_FIELDS


class CatalogEntryAdminForm(forms.ModelForm):
    class Meta:
        model = CatalogEntry
        fields = ENTRY_FIELDS


@admin.register(CatalogEntry)
class CatalogEntryAdmin(admin.ModelAdmin):
    """Writes go through the catalog service, like 'llmgw ctl apply'."""

    form = CatalogEntryAdminForm
    list_display = ("name", "engine", "nodes", "gpus_per_node", "replicas", "never_fits_reason")
    search_fields = ("name",)

    def save_model(self, request, obj, form, change):
        try:
            catalog_upsert(entry={f: getattr(obj, f) for f in ENTRY_FIELDS})
        except CatalogInvalid as exc:
            messages.error(request, f"not saved: {exc}")

    def delete_model(self, request, obj):
        model_remove(name=obj.name)


class MemberInline(admin.TabularInline):
    model = Member
    extra = 0
    can_delete = False
    readonly_fields = ["node", "rank", "gpus", "ports", "state", "healthy", "pid", "exit_code", "argv", "env"]
    fields = readonly_fields


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ("id", "model", "status", "fabric", "draining", "status_changed_at", "pending_reason")
    list_filter = ("status", "model", "fabric")
    readonly_fields = ["model", "status", "status_changed_at", "status_reason", "pending_reason", "fabric",
                       "draining", "ready_at"]
    inlines = [MemberInline]

    def has_add_permission(self, request):
        return False


@admin.register(Drain)
class DrainAdmin(admin.ModelAdmin):
    list_display = ("node", "status", "moved", "remaining", "started_at", "finished_at")
    readonly_fields = ["node", "status", "current", "moved", "remaining", "log", "started_at", "finished_at"]


@admin.register(GpuAllocation)
class GpuAllocationAdmin(admin.ModelAdmin):
    list_display = ("gpu", "node", "member")


@admin.register(PortAllocation)
class PortAllocationAdmin(admin.ModelAdmin):
    list_display = ("node", "port", "purpose", "member")
