"""Counters of the compile backend and the graph runners: what was split,
compiled, captured, replayed, and every eager fallback with its reason.

Process-wide, like ``torch._dynamo.utils.counters``: ``torch.compile`` gives
the caller no handle on the backend it ran, so tests and tools read these.
``reset()`` between measurements.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Counter, Dict

logger = logging.getLogger("sgl_piecewise.compile")


@dataclass
class CompileCounters:
    graphs_split: int = 0  # Dynamo graphs the backend received and split
    pieces_seen: int = 0  # pieces, splitting (attention) pieces excluded
    pieces_compiled: int = 0  # distinct compiles (identical pieces share one)
    graphs_captured: int = 0  # CUDA graphs captured: piece x size, and whole-model decode graphs
    replays: int = 0  # graph replays: pieces and whole-model decode steps
    eager_fallbacks: Counter[str] = field(default_factory=collections.Counter)
    artifacts_loaded: int = 0  # compile artifact files a compile started from (CompileOptions.cache_dir)
    artifacts_saved: int = 0  # compile artifact files written for later processes

    def fallback(self, reason: str) -> None:
        """Count a fallback; log the first of each reason at INFO, later ones at DEBUG."""
        first = reason not in self.eager_fallbacks
        self.eager_fallbacks[reason] += 1
        logger.log(logging.INFO if first else logging.DEBUG, "eager fallback: %s", reason)

    def reset(self) -> None:
        self.__init__()

    def as_dict(self) -> Dict[str, object]:
        return {
            "graphs_split": self.graphs_split,
            "pieces_seen": self.pieces_seen,
            "pieces_compiled": self.pieces_compiled,
            "graphs_captured": self.graphs_captured,
            "replays": self.replays,
            "eager_fallbacks": dict(self.eager_fallbacks),
            "artifacts_loaded": self.artifacts_loaded,
            "artifacts_saved": self.artifacts_saved,
        }


counters = CompileCounters()
