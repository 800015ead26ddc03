class InvalidTransition(Exception):
    """A status change the state machine does not allow."""


class NotFound(Exception):
    """The named object does not exist."""


class InventoryRejected(ValueError):
    """An agent's inventory that contradicts itself; nothing was stored."""
