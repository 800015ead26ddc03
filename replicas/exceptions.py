from core.exceptions import InvalidTransition


class InvalidReplicaTransition(InvalidTransition):
    """A replica status change REPLICA_TRANSITIONS does not allow."""


class InvalidDrainTransition(InvalidTransition):
    """A drain status change DRAIN_TRANSITIONS does not allow."""
