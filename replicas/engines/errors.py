"""The two ways an engine launch can be refused."""


class LaunchError(ValueError):
    """A member cannot be launched as asked; the message says what to change."""


class EngineArgsError(LaunchError):
    """A catalog entry's engine arguments or environment are refused; the
    message names the flag or variable."""
