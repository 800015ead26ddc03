"""The error types every app shares; an app's own errors live in that app."""


class InvalidTransition(Exception):
    """A status change the state machine does not allow (the API answers 409)."""


class NotFound(Exception):
    """The named object does not exist (the API answers 404)."""


class UnknownEventKind(ValueError):
    """An Event of a kind no app registered: a bug in the caller, refused
    before anything is written."""
