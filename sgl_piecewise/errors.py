"""One exception base for the library: bad input raises ``ValueError`` or
``TypeError`` subclasses that also derive from :class:`SglPiecewiseError`.
"""


class SglPiecewiseError(Exception):
    """Base of every error raised on purpose by sgl_piecewise."""


class InvalidInputError(SglPiecewiseError, ValueError):
    """A tensor or argument has the wrong shape, dtype, device or value."""


class InvalidTypeError(SglPiecewiseError, TypeError):
    """An argument has the wrong Python type."""


class KVPoolExhaustedError(SglPiecewiseError, RuntimeError):
    """The KV pool or request table has no room; raised before anything is allocated."""


class NoForwardContextError(SglPiecewiseError, RuntimeError):
    """An attention op ran outside ``forward_context(...)``."""


class UnsupportedModeError(SglPiecewiseError, NotImplementedError):
    """A backend was asked for a forward mode or feature it declared it lacks."""


class StaleGraphError(SglPiecewiseError):
    """The model's tensors no longer match what a graph was traced or captured for."""
