"""Options of the ``sgl_piecewise`` Dynamo backend.

``torch.compile`` hands a named backend its ``mode`` and ``options`` (and
refuses both at once), so both spellings are accepted:

* ``mode="reduce-overhead"``: CUDA graphs with the default capture sizes;
* ``options={"cudagraphs": True, "capture_sizes": [...], ...}`` for the rest.
"""

from __future__ import annotations

import bisect
import numbers
import os
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional, Sequence, Tuple

from sgl_piecewise.errors import InvalidInputError

PIECE_COMPILERS = ("inductor", "eager", "tensorrt")
MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
DEFAULT_MAX_CAPTURE_SIZE = 512


def default_capture_sizes(max_size: int = DEFAULT_MAX_CAPTURE_SIZE) -> Tuple[int, ...]:
    """SGLang's schedule: 1, 2, 4, 8, 12, 16, then every 8 to 256, every 16 to
    512, every 64 beyond — dense where small batches are common, coarse where
    padding costs little relative to the work."""
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 513, 16), *range(576, 8193, 64)]
    return tuple(s for s in sizes if s <= max_size)


@dataclass(frozen=True)
class CompileOptions:
    """Validated backend options.

    cudagraphs: capture each piece as a CUDA graph per token count.
    capture_sizes: token counts to capture (sorted ascending, unique).
    max_capture_size: largest default size when ``capture_sizes`` is not given.
    piece_compiler: "inductor" (default), "eager" or "tensorrt".
    debug_checks: assert graph input addresses at every replay; poison padded
        tails with NaN so a leak into real rows shows.
    share_identical_pieces: compile structurally identical pieces once.
    split_graph: split around attention (default). False compiles the graph
        whole, attention an opaque op inside it, for a graph runner to
        record (no graphs of the backend's own).
    cache_dir: where compile artifacts are saved for, and loaded by, later
        processes (``artifacts.py``); None: Inductor's own cache only.
    dynamo_guards: every call of a ``CompiledModel`` goes through Dynamo and
        its guards, so a change to the model's Python state after the first
        call (an attribute ``forward`` reads, a hook) recompiles. False
        (default): once a call has compiled piecewise graphs, later calls run
        them directly, as a start from a saved compile does
        (``compile/direct_call.py``): the call's tensors, the grad mode and
        every new set of weights are checked, the rest of the model is read
        when it compiles. Dynamo's guards cost 0.1-0.3 ms of host time per
        step (``docs/BENCHMARKS.md``).
    """

    cudagraphs: bool = False
    capture_sizes: Optional[Tuple[int, ...]] = None  # None: default_capture_sizes(max_capture_size)
    max_capture_size: int = DEFAULT_MAX_CAPTURE_SIZE
    piece_compiler: str = "inductor"
    debug_checks: bool = False
    share_identical_pieces: bool = True
    split_graph: bool = True
    cache_dir: Optional[str] = None
    dynamo_guards: bool = False

    def __post_init__(self) -> None:
        for name in ("cudagraphs", "debug_checks", "share_identical_pieces", "split_graph", "dynamo_guards"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise InvalidInputError(f"{name}: expected True or False, got {value!r}")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise InvalidInputError(f"cache_dir: expected a directory path, got {self.cache_dir!r}")
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        if self.cudagraphs and not self.split_graph:
            raise InvalidInputError(
                "split_graph=False: expected cudagraphs=False, got True; the backend's graphs are per piece "
                "around attention; record a whole compiled step with CudaGraphRunner instead"
            )
        if self.piece_compiler not in PIECE_COMPILERS:
            raise InvalidInputError(f"piece_compiler: expected one of {PIECE_COMPILERS}, got {self.piece_compiler!r}")
        if (
            isinstance(self.max_capture_size, bool)
            or not isinstance(self.max_capture_size, int)
            or self.max_capture_size < 1
        ):
            raise InvalidInputError(f"max_capture_size: expected an int >= 1, got {self.max_capture_size!r}")
        sizes = default_capture_sizes(self.max_capture_size) if self.capture_sizes is None else self.capture_sizes
        object.__setattr__(self, "capture_sizes", _check_capture_sizes(sizes))

    def padded_size(self, num_tokens: int) -> Optional[int]:
        """Smallest capture size >= ``num_tokens``; None above the largest."""
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    @classmethod
    def from_compile_args(cls, mode: Optional[str], options: Optional[Mapping[str, Any]]) -> "CompileOptions":
        if mode is not None and mode not in MODES:
            raise InvalidInputError(f"mode: expected one of {MODES}, got {mode!r}")
        options = dict(options or {})
        valid = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - valid)
        if unknown:
            raise InvalidInputError(
                f"sgl_piecewise options: expected keys among {sorted(valid)}, got unknown {unknown}"
            )
        if mode == "reduce-overhead":
            options.setdefault("cudagraphs", True)
        return cls(**options)


def _check_capture_sizes(sizes: Any) -> Tuple[int, ...]:
    """Sorted unique token counts; a non-empty sequence of ints >= 1."""
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise InvalidInputError(f"capture_sizes: expected a list of token counts such as [1, 2, 4, 8], got {sizes!r}")
    if not sizes:
        raise InvalidInputError(
            "capture_sizes: expected at least one token count, got an empty list; leave it out "
            "for the default sizes, or set cudagraphs=False for no graphs"
        )
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, numbers.Integral) or s < 1]
    if bad:
        raise InvalidInputError(f"capture_sizes: expected positive ints, got {bad} in {list(sizes)}")
    return tuple(sorted({int(s) for s in sizes}))
