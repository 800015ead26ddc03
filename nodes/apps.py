from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "nodes"

    def ready(self) -> None:
        # Imported here, not at the top: an AppConfig module is loaded before the models are.
        from core.events import event_kinds_register
        from pki import hooks as pki_hooks

        from .choices import NodeEventKind
        from .events import cert_revoked_record

        event_kinds_register(owner=self.label, kinds=NodeEventKind)
        if cert_revoked_record not in pki_hooks.cert_revoked_handlers:
            pki_hooks.cert_revoked_handlers.append(cert_revoked_record)
