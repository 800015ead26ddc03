from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "gateway"
    verbose_name = "Gateway"

    def ready(self) -> None:
        # Imported here, not at the top: an AppConfig module is loaded before
        # the models are. A failure to import is a failure to start.
        from replicas import hooks

        from . import load_report, selectors

        hooks.inflight_providers.append(selectors.replica_inflight)
        hooks.load_providers.append(load_report.deployment_load)
