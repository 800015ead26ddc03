"""Who may do what through the REST API: Django model permissions, per action.

Every view says which model it is about (``permission_model = "nodes.node"``)
and, for what is not plain CRUD, which permissions each action needs
(``required_permissions = {"cordon": ("nodes.change_node",)}``). Reading
needs ``<app>.view_<model>``; create, update and destroy need ``add_``,
``change_`` and ``delete_``. An action the view does not map is refused to
everyone but superusers: a new endpoint is closed until someone says who may
use it. ``is_staff`` plays no part here (it opens the Django admin only).
"""

from __future__ import annotations

from rest_framework.permissions import SAFE_METHODS, BasePermission

CRUD = {"create": "add", "update": "change", "partial_update": "change", "destroy": "delete"}


def required_permissions(view, request) -> tuple[str, ...] | None:
    """The permissions this request needs, or None when the view maps none for it."""
    action = getattr(view, "action", None) or request.method.lower()
    explicit = getattr(view, "required_permissions", {})
    if action in explicit:
        return tuple(explicit[action])
    model = getattr(view, "permission_model", None)
    if model is None:
        return None
    app, name = model.split(".")
    if request.method in SAFE_METHODS:
        return (f"{app}.view_{name}",)
    verb = CRUD.get(action)
    return (f"{app}.{verb}_{name}",) if verb else None


class ActionPermissions(BasePermission):
    """The site-wide DRF permission class (``DEFAULT_PERMISSION_CLASSES``)."""

    message = "you do not have permission to do this"

    def has_permission(self, request, view) -> bool:
        user = request.user
        if not (user and user.is_authenticated and user.is_active):
            return False
        needed = required_permissions(view, request)
        if needed is None:
            if user.is_superuser:
                return True
            self.message = f"no permission is mapped for {request.method} on this endpoint; only superusers may"
            return False
        missing = [codename for codename in needed if not user.has_perm(codename)]
        if missing:
            self.message = f"this needs the permission {' and '.join(missing)}"
            return False
        return True
