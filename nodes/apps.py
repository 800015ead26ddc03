from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "nodes"

    def ready(self) -> None:
        from pki import hooks as pki_hooks

        from .events import cert_revoked_record

        if cert_revoked_record not in pki_hooks.cert_revoked_handlers:
            pki_hooks.cert_revoked_handlers.append(cert_revoked_record)
