"""One exception base for the library, and the errors users can act on.

Bad *input* raises ``ValueError``/``TypeError`` subclasses (so generic callers
can catch them as usual) that also derive from :class:`SglPiecewiseError`, so
callers of this library can catch everything it raises in one clause.
"""


class SglPiecewiseError(Exception):
    """Base of every error raised on purpose by sgl_piecewise."""


class InvalidInputError(SglPiecewiseError, ValueError):
    """A tensor or argument has the wrong shape, dtype, device or value."""


class InvalidTypeError(SglPiecewiseError, TypeError):
    """An argument has the wrong Python type."""


class KVPoolExhaustedError(SglPiecewiseError, RuntimeError):
    """The paged KV pool (or the request table) has no room for a request.

    Raised before anything is allocated: every slot held before the call is
    still held, and the pool is unchanged.
    """


class NoForwardContextError(SglPiecewiseError, RuntimeError):
    """An attention op ran outside ``forward_context(...)``."""


class UnsupportedModeError(SglPiecewiseError, NotImplementedError):
    """A backend was asked for a forward mode or feature it declared it lacks."""


class StaleGraphError(SglPiecewiseError):
    """The model's tensors no longer match what a graph was traced or captured for."""
