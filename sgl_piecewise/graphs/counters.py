"""Process-wide counters of the compile backend and the graph runners
(``torch.compile`` gives no handle on the backend it ran); ``reset()``
between measurements."""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field, fields
from typing import Counter, Dict, Tuple

logger = logging.getLogger("sgl_piecewise.compile")


def _plain(value: object) -> object:
    if isinstance(value, collections.Counter):
        return {": ".join(key) if isinstance(key, tuple) else key: n for key, n in value.items()}
    return value


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
    compiles_loaded: int = 0  # saved compiles a CompiledModel started from, without Dynamo (precompiled.py)
    compiles_saved: int = 0  # compiles saved whole for later processes
    steps_rerun: int = 0  # piecewise steps run again: a weight had moved or been replaced since the last step
    # ModelRunner steps by (path, why the path or padding)
    step_paths: Counter[Tuple[str, str]] = field(default_factory=collections.Counter)

    def fallback(self, reason: str) -> None:
        """Count a fallback; log the first of each reason at INFO, later ones at DEBUG."""
        first = reason not in self.eager_fallbacks
        self.eager_fallbacks[reason] += 1
        logger.log(logging.INFO if first else logging.DEBUG, "eager fallback: %s", reason)

    def reset(self) -> None:
        self.__init__()

    def as_dict(self) -> Dict[str, object]:
        """Every field, counters as plain dicts (a step path's key: ``"path: why"``)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def format_step_paths(self) -> str:
        """How many ``ModelRunner`` steps took each path, and why, most first."""
        total = sum(self.step_paths.values())
        if not total:
            return "no steps counted"
        by_path: Dict[str, int] = collections.Counter()
        for (path, _), n in self.step_paths.items():
            by_path[path] += n
        lines = [f"{total} steps"]
        for path, n in sorted(by_path.items(), key=lambda item: -item[1]):
            lines.append(f"  {path:<13} {n:>7}  {n / total:6.1%}")
            reasons = [(why, m) for (p, why), m in self.step_paths.items() if p == path]
            lines += [f"      {m:>7}  {why}" for why, m in sorted(reasons, key=lambda item: -item[1])]
        return "\n".join(lines)


counters = CompileCounters()
