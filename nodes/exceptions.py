"""nodes' own errors; the shared ones (InvalidTransition, NotFound) are in core.exceptions."""


class InventoryRejected(ValueError):
    """An agent's inventory that contradicts itself; nothing was stored."""
