"""User-facing errors: one clear line naming the problem and the fix; the CLI exits 2."""


class UserError(Exception):
    """A problem with the user's input (config, file, column, label, checkpoint)."""

    exit_code = 2


class ConfigError(UserError):
    pass


class DataError(UserError):
    pass


class CheckpointError(UserError):
    pass


class NoRoomError(UserError):
    """A write failed for want of room (a full disk, a quota, a file size limit): the file or folder it wrote is
    named, and what was there before it stays whole."""


class NonFiniteError(UserError):
    """Training produced a nan/inf loss or gradient (a learning rate, scale or data row at fault): the run stops."""
