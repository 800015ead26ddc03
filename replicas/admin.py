from django import forms
from django.contrib import admin, messages

from core.admin import SystemOwnedAdmin
from core.exceptions import InvalidTransition, NotFound
from nodes.choices import NodeStatus

from .catalog import CatalogInvalid, catalog_upsert, model_remove
from .drain import drain_start
from .envmask import env_masked
from .models import CatalogEntry, Drain, GpuAllocation, Member, PortAllocation, Replica
from .validation import ENTRY_FIELDS


class CatalogEntryAdminForm(forms.ModelForm):
    class Meta:
        model = CatalogEntry
        fields = ENTRY_FIELDS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Secret values are write-only here too; left masked, the stored one is kept.
        if self.instance.pk:
            self.initial["env"] = env_masked(self.instance.env)


@admin.register(CatalogEntry)
class CatalogEntryAdmin(admin.ModelAdmin):
    """Writes go through the catalog service, like 'llmgw ctl apply'."""

    form = CatalogEntryAdminForm
    list_display = ("name", "engine", "nodes", "gpus_per_node", "replicas", "never_fits_reason")
    search_fields = ("name",)

    def save_model(self, request, obj, form, change):
        try:
            catalog_upsert(entry={f: getattr(obj, f) for f in ENTRY_FIELDS},
                           admin=request.user.has_perm("replicas.trust_engine_code"))
        except CatalogInvalid as exc:
            messages.error(request, f"not saved: {exc}")

    def delete_model(self, request, obj):
        model_remove(name=obj.name)


class MemberInline(admin.TabularInline):
    model = Member
    extra = 0
    can_delete = False
    readonly_fields = ["node", "rank", "gpus", "ports", "state", "healthy", "pid", "exit_code", "argv", "environment"]
    fields = readonly_fields

    @admin.display(description="env")
    def environment(self, member) -> dict:
        return env_masked(member.env)


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ("id", "model", "status", "fabric", "draining", "status_changed_at", "pending_reason")
    list_filter = ("status", "model", "fabric")
    readonly_fields = ["model", "status", "status_changed_at", "status_reason", "pending_reason", "fabric",
                       "draining", "ready_at"]
    inlines = [MemberInline]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # a replica stops by scaling its model (the catalog), never by deleting its row


class DrainAddForm(forms.ModelForm):
    class Meta:
        model = Drain
        fields = ["node"]

    def clean_node(self):
        node = self.cleaned_data["node"]
        if node.status not in (NodeStatus.READY, NodeStatus.CORDONED, NodeStatus.DRAINING):
            raise forms.ValidationError(f"node {node.name} is {node.status}; only a ready or cordoned node can be drained")
        return node


@admin.register(Drain)
class DrainAdmin(admin.ModelAdmin):
    """A drain is started through the service, as 'llmgw ctl drain' does; it is then the system's."""

    list_display = ("node", "status", "moved", "remaining", "started_at", "finished_at")
    readonly_fields = ["node", "status", "current", "moved", "remaining", "log", "started_at", "finished_at"]

    def get_form(self, request, obj=None, change=False, **kwargs):
        if obj is None:
            kwargs["form"] = DrainAddForm
            kwargs["fields"] = ["node"]
        return super().get_form(request, obj, change=change, **kwargs)

    def get_fields(self, request, obj=None):
        return ["node"] if obj is None else self.readonly_fields

    def get_readonly_fields(self, request, obj=None):
        return [] if obj is None else self.readonly_fields

    def has_add_permission(self, request):
        return request.user.has_perm("nodes.change_node")

    def has_delete_permission(self, request, obj=None):
        return False

    def save_model(self, request, obj, form, change):
        if change:
            return
        try:
            drain = drain_start(node_name=obj.node.name)
        except (InvalidTransition, NotFound) as exc:
            messages.error(request, f"not started: {exc}")
            return
        obj.pk = drain.pk


@admin.register(GpuAllocation)
class GpuAllocationAdmin(SystemOwnedAdmin):
    list_display = ("gpu", "node", "member")


@admin.register(PortAllocation)
class PortAllocationAdmin(SystemOwnedAdmin):
    list_display = ("node", "port", "purpose", "member")
