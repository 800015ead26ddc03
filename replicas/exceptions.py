from core.exceptions import InvalidTransition


class InvalidReplicaTransition(InvalidTransition):
    """A replica status change REPLICA_TRANSITIONS does not allow."""


class InvalidDrainTransition(InvalidTransition):
    """A drain status change DRAIN_TRANSITIONS does not allow."""


class InvalidRolloutTransition(InvalidTransition):
    """A rollout status change ROLLOUT_TRANSITIONS does not allow, or an
    operator's pause, resume or undo that does not apply now (a 409)."""
