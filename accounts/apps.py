from django.apps import AppConfig
from django.db.models.signals import post_migrate


class AccountsConfig(AppConfig):
    name = "accounts"
    verbose_name = "Accounts"

    def ready(self) -> None:
        from core.events import event_kinds_register

        from . import roles
        from .choices import AccountEventKind

        event_kinds_register(owner=self.label, kinds=AccountEventKind)

        # The groups' permissions follow the map in roles.py after every
        # migrate: a permission added later (a new model) reaches its roles.
        post_migrate.connect(roles.roles_sync_after_migrate, dispatch_uid="accounts.roles_sync")
