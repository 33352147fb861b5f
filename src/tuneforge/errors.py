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


class NonFiniteError(UserError):
    """Training produced a nan/inf loss or gradient (a learning rate, scale or data row at fault): the run stops."""
