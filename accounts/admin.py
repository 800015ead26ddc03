from django.contrib import admin
from django.contrib.auth.admin import GroupAdmin
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin
from django.contrib.auth.models import Group, User

from .actors import actor
from .models import OperatorToken
from .services import token_revoke


@admin.register(OperatorToken)
class OperatorTokenAdmin(admin.ModelAdmin):
    """Tokens are made by 'llmgw up' (and the API); here they are listed by
    prefix and deleted. The token itself is not kept anywhere."""

    list_display = ("prefix", "user", "name", "created_at", "expires_at", "last_used_at")
    search_fields = ("prefix", "name", "user__username")
    readonly_fields = ("user", "name", "prefix", "created_at", "expires_at", "last_used_at")
    exclude = ("secret_hash",)

    # Deleting is revoking: through the service, which records who did it.
    def delete_model(self, request, obj) -> None:
        token_revoke(prefix=obj.prefix, user=request.user, actor=actor(request))

    def delete_queryset(self, request, queryset) -> None:
        for row in list(queryset):
            token_revoke(prefix=row.prefix, user=request.user, actor=actor(request))

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


# Roles and superuser grants change only through accounts.services (which
# records who did it): 'llmgw ctl users set-role', the REST API. Here they
# are shown, never edited; an admin-role user once made itself superuser on
# this page. Users are added with 'llmgw ctl users add' (the API), which
# gives them a role.
admin.site.unregister(User)
admin.site.unregister(Group)


@admin.register(User)
class UserAdmin(BaseUserAdmin):
    readonly_fields = ("is_staff", "is_superuser", "groups", "user_permissions", "last_login", "date_joined")

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        # A superuser may be removed only by a superuser.
        return super().has_delete_permission(request, obj) and (
            obj is None or not obj.is_superuser or request.user.is_superuser)


@admin.register(Group)
class RoleGroupAdmin(GroupAdmin):
    """The role groups are data (accounts/roles.py), set again at every migrate."""

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
