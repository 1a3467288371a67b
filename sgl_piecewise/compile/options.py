"""Options of the ``sgl_piecewise`` Dynamo backend, from ``torch.compile``'s
``mode`` (``"reduce-overhead"``: CUDA graphs) or its ``options`` dict."""

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
    """SGLang's schedule up to ``max_size``: dense where small batches are common."""
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 513, 16), *range(576, 8193, 64)]
    return tuple(s for s in sizes if s <= max_size)


@dataclass(frozen=True)
class CompileOptions:
    """Validated backend options.

    debug_checks: check graph input addresses at every replay and poison
        padded rows with NaN, so a leak into real rows shows.
    split_graph: False compiles the graph whole, attention inside, for a
        graph runner to record (no graphs of the backend's own).
    cache_dir: where compiles are saved for, and loaded by, later processes.
    dynamo_guards: every ``CompiledModel`` call goes through Dynamo's guards
        (a change to the model's Python state recompiles); False: calls after
        the compile skip Dynamo (``direct_call.py``).
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
