from django.contrib import admin, messages

from core.admin import SystemOwnedAdmin
from core.exceptions import InvalidTransition, NotFound

from .models import ControlPlaneClock, Fabric, Gpu, Hca, Node
from .services import node_cordon, node_uncordon


class GpuInline(admin.TabularInline):
    model = Gpu
    extra = 0
    can_delete = False
    readonly_fields = ["index", "uuid", "name", "memory_mib", "pci_bus_id"]


class HcaInline(admin.TabularInline):
    model = Hca
    extra = 0
    can_delete = False
    readonly_fields = ["name", "fabric", "port", "state", "phys_state", "link_layer", "rate", "guid", "gid"]


@admin.register(Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = ("name", "status", "mgmt_addr", "agent_version", "last_heartbeat_at")
    list_filter = ("status", "fabrics")
    search_fields = ("name", "mgmt_addr")
    # Status changes go through the services (cordon/uncordon actions, the sweep).
    # Everything about a node is what its certificate and its agent say (its
    # name, fabrics, addresses, inventory) or what the services decide (its
    # status): the admin shows it, and changes it only through the actions.
    readonly_fields = [f.name for f in Node._meta.get_fields() if f.concrete and not f.auto_created]
    inlines = [GpuInline, HcaInline]
    actions = ["cordon", "uncordon"]

    def has_add_permission(self, request):
        return False  # a node registers itself with its first heartbeat

    @admin.action(description="Cordon the selected nodes", permissions=["change"])
    def cordon(self, request, queryset):
        self._each(request, queryset, node_cordon, "cordoned")

    @admin.action(description="Uncordon the selected nodes", permissions=["change"])
    def uncordon(self, request, queryset):
        self._each(request, queryset, node_uncordon, "uncordoned")

    def _each(self, request, queryset, service, done: str) -> None:
        """Apply a transition per node; a node that cannot make it is reported, not a 500."""
        changed = []
        for node in queryset:
            try:
                service(node_name=node.name)
            except (InvalidTransition, NotFound) as exc:
                self.message_user(request, str(exc), messages.WARNING)
            else:
                changed.append(node.name)
        if changed:
            self.message_user(request, f"{done}: {', '.join(changed)}", messages.SUCCESS)


@admin.register(Fabric)
class FabricAdmin(SystemOwnedAdmin):
    list_display = ("name", "created_at")


@admin.register(Gpu)
class GpuAdmin(SystemOwnedAdmin):
    list_display = ("node", "index", "name", "memory_mib", "uuid")
    list_filter = ("name",)


@admin.register(Hca)
class HcaAdmin(SystemOwnedAdmin):
    list_display = ("node", "name", "fabric", "state", "link_layer", "rate")
    list_filter = ("fabric",)


@admin.register(ControlPlaneClock)
class ControlPlaneClockAdmin(SystemOwnedAdmin):
    list_display = ("heard_since", "last_sweep_at", "deaf_since", "listener_alive_at")
