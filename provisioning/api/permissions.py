from rest_framework.permissions import SAFE_METHODS, BasePermission

RUN = "provisioning.run_provisioning"


class CanProvision(BasePermission):
    """Provisioning is a permission of its own, apart from operating nodes and
    issuing certificates: staff with provisioning.run_provisioning may do
    anything here; staff with only the view permission may read."""

    message = "provisioning needs the permission provisioning.run_provisioning"

    def has_permission(self, request, view) -> bool:
        user = request.user
        if not (user and user.is_authenticated and user.is_active and user.is_staff):
            return False
        if user.has_perm(RUN):
            return True
        if request.method in SAFE_METHODS:
            return any(user.has_perm(f"provisioning.view_{model}") for model in getattr(view, "view_models", ()))
        return False
