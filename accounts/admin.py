from django.contrib import admin

from .models import OperatorToken


@admin.register(OperatorToken)
class OperatorTokenAdmin(admin.ModelAdmin):
    """Tokens are made by 'llmgw up' (and the API); here they are listed by
    prefix and deleted. The token itself is not kept anywhere."""

    list_display = ("prefix", "user", "name", "created_at", "last_used_at")
    search_fields = ("prefix", "name", "user__username")
    readonly_fields = ("user", "name", "prefix", "created_at", "last_used_at")
    exclude = ("secret_hash",)

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
