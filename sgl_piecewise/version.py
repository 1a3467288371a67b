"""The library's version, below every other module: saved compiles are keyed by it."""

__version__ = "0.1.0"
