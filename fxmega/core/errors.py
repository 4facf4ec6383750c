"""fxmega's own error types: every input we reject ends in one of these, with a message
that names the offending value and says how to fix it."""


class FxmegaError(Exception):
    """Base class of the errors fxmega raises on purpose."""


class ConfigError(FxmegaError, ValueError):
    """A config key, value or combination of values that cannot work."""


class DataError(FxmegaError):
    """A data file or corpus that is missing, truncated or malformed."""


class CheckpointError(FxmegaError):
    """A checkpoint that is missing, partial, corrupted or does not fit the model."""


class NonFiniteError(FxmegaError):
    """A training step produced a non-finite loss or gradient (policy train.nonfinite=stop)."""


class LauncherLostError(FxmegaError):
    """This rank's launcher (and the rendezvous store it hosts) has gone: the job is over."""
