"""Exception types raised by tierckpt."""


class ConfigError(ValueError):
    """An option has a value tierckpt cannot use.

    The message always names the option (e.g. ``replication_factor``) and the allowed values,
    so a user can fix the launch line or config file without reading source.
    """

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(f"{option}: {message}")


class VerificationError(RuntimeError):
    """A checkpoint's bytes do not match its manifest (size or xxhash), or it has no manifest."""


class NoCheckpointError(RuntimeError):
    """Committed checkpoints exist, but none of them could be restored from any source."""
