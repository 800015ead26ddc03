from django.contrib import admin

from .models import Event


class SystemOwnedAdmin(admin.ModelAdmin):
    """Rows the control plane owns (what agents report, what the scheduler
    allocates, what happened): to look at, never to add, edit or delete by
    hand. Every field shows read-only."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Event)
class EventAdmin(SystemOwnedAdmin):
    list_display = ("created_at", "severity", "kind", "subject", "message")
    list_filter = ("severity", "kind")
    search_fields = ("subject", "message")
