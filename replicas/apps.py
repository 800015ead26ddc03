from django.apps import AppConfig


class ReplicasConfig(AppConfig):
    name = "replicas"

    def ready(self) -> None:
        from core.events import event_kinds_register
        from nodes import hooks

        from . import drain, selectors, services, weights_cache
        from .choices import ReplicaEventKind

        event_kinds_register(owner=self.label, kinds=ReplicaEventKind)

        hooks.engine_report_handlers.append(services.members_report)
        hooks.node_lost_handlers.append(services.replicas_node_lost)
        hooks.node_undrained_handlers.append(drain.drain_end_for_node)
        hooks.gpus_vanished_handlers.append(services.replicas_gpus_vanished)
        hooks.gpus_quarantined_handlers.append(services.replicas_gpus_quarantined)
        hooks.gpus_cleared_handlers.append(services.replicas_gpus_cleared)
        hooks.desired_member_providers.append(selectors.node_desired_members)
        hooks.replica_counters.append(selectors.node_replica_counts)
        hooks.desired_weights_providers.append(weights_cache.node_desired_weights)
        hooks.weights_report_handlers.append(weights_cache.node_weights_report)
