"""How the projection kernels are cut into programs: per-card tables
``tilings/<card>.json`` written by ``benchmarks/bench_projections.py
--sweep`` (per ``"<kind>:<n>:<k>"``, the fastest tiling at one row, ``"1"``,
and at many, ``"many"``; null where the unfused ops won), else a rule.
``SGL_PIECEWISE_TILINGS=<file>`` reads another table.
"""

from __future__ import annotations

import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from sgl_piecewise.errors import InvalidInputError

TABLE_DIR = Path(__file__).parent / "tilings"
ENV_TABLE = "SGL_PIECEWISE_TILINGS"
ROTARY = "rotary"  # kind prefix of a QKV projection with rotary: "rotary<head size>"


def rotary_kind(head_dim: int) -> str:
    """The table kind of a QKV projection that rotates heads of ``head_dim``."""
    return f"{ROTARY}{head_dim}"


def rotary_head_dim(kind: str) -> Optional[int]:
    """The head size a :func:`rotary_kind` names; None for another kind."""
    return int(kind[len(ROTARY) :]) if kind.startswith(ROTARY) else None


@dataclass(frozen=True)
class Tiling:
    """How a projection is cut into programs (speed only). ``fma``: one row on the CUDA cores."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    fma: bool = False

    def __post_init__(self) -> None:
        pow2 = lambda n: isinstance(n, int) and n > 0 and n & (n - 1) == 0  # noqa: E731
        least = 1 if self.fma else 16  # tl.dot's minimum
        if not (pow2(self.block_n) and self.block_n >= least and pow2(self.block_k) and self.block_k >= 16):
            raise InvalidInputError(
                f"Tiling: expected block_n and block_k powers of two, block_k >= 16 and block_n >= {least}, "
                f"got {self.block_n!r} and {self.block_k!r}"
            )
        if not (pow2(self.split_k) and pow2(self.num_warps)) or not isinstance(self.num_stages, int):
            raise InvalidInputError(
                f"Tiling: expected split_k and num_warps powers of two and an int num_stages, got "
                f"{self.split_k!r}, {self.num_warps!r}, {self.num_stages!r}"
            )

    def block_m(self, rows: int) -> int:
        """The program's tile of rows: 1 under ``fma``, else a power of two >= 16."""
        if rows == 1 and self.fma:
            return 1
        return max(16, 1 << max(rows - 1, 0).bit_length())


def default_tiling(rows: int, n: int, k: int, device: torch.device, paired: bool = False) -> Tiling:
    """The rule where no tiling was measured: 16-column tiles, K split until
    the card holds a program per SM."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    block_k = 256 if rows <= 16 else 128
    tiles, split = -(-n // 16), 1
    while tiles * split < sms and k >= 4 * block_k * split:
        split *= 2
    return Tiling(block_n=16, block_k=block_k, split_k=split)


def table_path(card: str) -> Path:
    """Where the shipped table of the card named ``card`` lies."""
    return TABLE_DIR / (re.sub(r"[^a-z0-9]+", "_", card.lower()).strip("_") + ".json")


@functools.lru_cache(maxsize=16)
def _table(card: str, override: str) -> dict:
    path = Path(override) if override else table_path(card)
    if not path.is_file():
        if override:
            raise InvalidInputError(f"{ENV_TABLE}: expected a tilings JSON file, got {override!r} (no such file)")
        return {}
    return json.loads(path.read_text())["tilings"]


def tiling_for(kind: str, rows: int, n: int, k: int, device: torch.device) -> Optional[Tiling]:
    """The measured tiling on ``device``'s card (None: unfused ops are faster), else the rule."""
    if device.type == "cuda":
        table = _table(torch.cuda.get_device_name(device), os.environ.get(ENV_TABLE, ""))
        entries = table.get(f"{kind}:{n}:{k}", {})
        band = "1" if rows == 1 else "many"
        if band in entries:
            return None if entries[band] is None else Tiling(**entries[band])
    return default_tiling(rows, n, k, device, paired=kind != "linear")
