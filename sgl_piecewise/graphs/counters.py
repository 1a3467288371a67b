"""Process-wide counters of the compile backend and the graph runners
(``torch.compile`` gives no handle on the backend it ran); ``reset()``
between measurements, ``expect(...)`` around a block a test checks."""

from __future__ import annotations

import collections
import contextlib
import logging
from dataclasses import dataclass, field, fields
from typing import Counter, Dict, Iterator, List, Mapping, Tuple

from sgl_piecewise.errors import InvalidInputError, InvalidTypeError

logger = logging.getLogger("sgl_piecewise.compile")


def _plain_key(key: object) -> object:
    return ": ".join(key) if isinstance(key, tuple) else key


def _plain(value: object) -> object:
    if isinstance(value, collections.Counter):
        return {_plain_key(key): n for key, n in value.items()}
    return value


EXPECT_OTHERS = ("unchanged", "any")


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

    def expect(self, *, others: str = "unchanged", **deltas: object) -> contextlib.AbstractContextManager[None]:
        """Check a block's change to the counters: ``with counters.expect(replays=5): ...``.

        Each keyword names a field and its expected change over the block: an
        int, or for a counter field (``eager_fallbacks``, ``step_paths``) a
        mapping of key to change, every key it leaves out unchanged (a step
        path's key as a ``(path, why)`` tuple or ``"path: why"``). Fields not
        named must be unchanged, unless ``others="any"``. On leaving the block
        without an exception, an ``AssertionError`` names every field (or
        key) whose change differs, as ``replays: expected +5, got +4``; an
        exception raised in the block propagates unchecked.
        """
        if others not in EXPECT_OTHERS:
            raise InvalidInputError(f"expect: others: expected one of {EXPECT_OTHERS}, got {others!r}")
        now = self.as_dict()
        expected: Dict[str, object] = {}
        for name, delta in deltas.items():
            if name not in now:
                raise InvalidInputError(f"expect: expected a counter field ({', '.join(now)}), got {name!r}")
            if isinstance(now[name], dict):
                if not isinstance(delta, Mapping) or not all(_is_int(n) for n in delta.values()):
                    raise InvalidTypeError(f"expect: {name}: expected a mapping of key to int change, got {delta!r}")
                expected[name] = {_plain_key(key): n for key, n in delta.items()}
            elif not _is_int(delta):
                raise InvalidTypeError(f"expect: {name}: expected an int change, got {delta!r}")
            else:
                expected[name] = delta
        return self._expecting(expected, others == "unchanged")

    @contextlib.contextmanager
    def _expecting(self, expected: Dict[str, object], others_unchanged: bool) -> Iterator[None]:
        before = self.as_dict()
        yield  # an exception in the block is raised here and propagates
        wrong = _unexpected_changes(before, self.as_dict(), expected, others_unchanged)
        if wrong:
            raise AssertionError("counters changed other than expected:\n  " + "\n  ".join(wrong))

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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _unexpected_changes(
    before: Dict[str, object], after: Dict[str, object], expected: Dict[str, object], others_unchanged: bool
) -> List[str]:
    """``"field: expected +a, got +b"`` (``"field['key']: ..."`` in a counter
    field) for every change other than ``expected``."""
    wrong = []
    for name, old in before.items():
        new = after[name]
        if name not in expected and not others_unchanged:
            continue
        note = "" if name in expected else " (not named)"
        if isinstance(old, dict):
            want = expected.get(name, {})
            changes = {key: new.get(key, 0) - old.get(key, 0) for key in {*old, *new}}
            for key in sorted({*changes, *want}, key=str):
                got, exp = changes.get(key, 0), want.get(key, 0)
                if got != exp:
                    wrong.append(f"{name}[{key!r}]: expected {exp:+d}{note}, got {got:+d}")
        elif new - old != expected.get(name, 0):
            wrong.append(f"{name}: expected {expected.get(name, 0):+d}{note}, got {new - old:+d}")
    return wrong


counters = CompileCounters()
