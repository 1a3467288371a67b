"""The engine on top of the library: ``ModelRunner`` (pools, backend, graph
policy, steps, ``generate``), greedy speculative decoding and its drafts,
``verify`` (every graph path against eager), the ``bench`` job and the CLI."""

from sgl_piecewise.engine.runner import ModelRunner

__all__ = ["ModelRunner"]
