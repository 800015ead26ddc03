"""The three roles, as data: Django groups and the permissions each holds.

viewer: every ``view_`` permission (secrets are never shown to anyone);
operator: the viewer's, plus operating nodes, the catalog and API keys;
admin: every permission (and ``is_staff``, for the Django admin).
The REST API (``accounts.permissions``), the CLI and the web pages check
these same codenames.
"""

from __future__ import annotations

VIEWER, OPERATOR, ADMIN = "viewer", "operator", "admin"
ROLES = (VIEWER, OPERATOR, ADMIN)

OPERATOR_PERMISSIONS = frozenset({
    "nodes.change_node",  # cordon, uncordon, drain
    "replicas.add_catalogentry",
    "replicas.change_catalogentry",  # scale, apply a catalog
    "replicas.delete_catalogentry",  # prune
    "gateway.add_apikey",
    "gateway.change_apikey",  # revoke
})


def role_grants(role: str, codename: str) -> bool:
    """Whether ``role`` holds ``app_label.codename``."""
    name = codename.split(".", 1)[1]
    if role == ADMIN:
        return True
    if name.startswith("view_"):
        return True
    return role == OPERATOR and codename in OPERATOR_PERMISSIONS


def roles_sync(*, group_model, permission_model) -> None:
    """Create the three groups and give each exactly its permissions.
    Takes the model classes so that a migration can pass its historical ones."""
    permissions = list(permission_model.objects.select_related("content_type"))
    for role in ROLES:
        group, _ = group_model.objects.get_or_create(name=role)
        group.permissions.set(
            [p for p in permissions if role_grants(role, f"{p.content_type.app_label}.{p.codename}")]
        )


def roles_sync_after_migrate(sender, **kwargs) -> None:
    # post_migrate is sent once per app (after migrate, and after a flush);
    # accounts comes last in INSTALLED_APPS, so by then every permission exists.
    if sender.label != "accounts":
        return
    from django.contrib.auth.models import Group, Permission

    roles_sync(group_model=Group, permission_model=Permission)
