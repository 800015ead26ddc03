from core.exceptions import InvalidTransition, NotFound


class InvalidJobTransition(InvalidTransition):
    """A job or step status change its table does not allow (the API answers 409)."""


class JobNotFound(NotFound):
    pass


class StepFailed(Exception):
    """A step that cannot succeed as things are: the job fails with this message."""
