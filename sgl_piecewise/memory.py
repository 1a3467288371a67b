"""Paged KV memory, one token a page (as SGLang's default): ``req_to_token[req,
pos]`` is the KV slot of a request's token; per layer, K and V are
``[num_slots, num_kv_heads, head_dim]``. Padded tokens write the never
handed-out ``DUMMY_SLOT``. Allocation is all or nothing:
:class:`KVPoolExhaustedError` is raised before anything changes.
"""

from __future__ import annotations

import numbers
from typing import List, Sequence, Union

import torch

from sgl_piecewise.checks import check_positive_int, check_tensor
from sgl_piecewise.errors import InvalidInputError, KVPoolExhaustedError
from sgl_piecewise.transfer import to_device

DUMMY_SLOT = 0


class ReqToTokenPool:
    """Rows of KV slot indices, one row per live request."""

    def __init__(self, max_reqs: int, max_context_len: int, device: torch.device | str = "cpu"):
        self.max_reqs = check_positive_int("max_reqs", max_reqs)
        self.max_context_len = check_positive_int("max_context_len", max_context_len)
        self.device = torch.device(device)
        # Unused entries point at the dummy slot, so a stray read is harmless.
        self.req_to_token = torch.full((max_reqs, max_context_len), DUMMY_SLOT, dtype=torch.int32, device=self.device)
        self._free: List[int] = list(range(max_reqs))
        self._allocated = [False] * max_reqs

    @property
    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> List[int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInputError(f"alloc: expected a count >= 0, got {n!r}")
        if n > len(self._free):
            raise KVPoolExhaustedError(
                f"request table full: expected room for {n} more requests, "
                f"got {len(self._free)} free of {self.max_reqs}; finish or free requests first"
            )
        taken, self._free = self._free[:n], self._free[n:]
        for row in taken:
            self._allocated[row] = True
        return taken

    def is_allocated(self, row: int) -> bool:
        return 0 <= row < self.max_reqs and self._allocated[row]

    def free(self, rows: Sequence[int]) -> None:
        """Release ``rows`` (all or none: a bad row leaves every row as it was)."""
        rows = [int(r) for r in rows]
        bad = [r for r in rows if not self.is_allocated(r)]
        if bad:
            raise InvalidInputError(f"free: expected allocated request rows, got {bad}")
        if len(set(rows)) != len(rows):
            raise InvalidInputError(f"free: expected distinct request rows, got {rows}")
        (index,) = to_device((torch.tensor(rows, dtype=torch.int64),), self.device)
        self.req_to_token[index] = DUMMY_SLOT
        for row in rows:
            self._allocated[row] = False
        self._free.extend(rows)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Record ``slots`` as the KV slots of positions ``start ..`` of ``row``."""
        end = start + slots.shape[0]
        if end > self.max_context_len:
            raise InvalidInputError(
                f"request too long: expected at most {self.max_context_len} tokens of context, got {end}"
            )
        self.req_to_token[row, start:end] = slots.to(self.req_to_token)

    def write_next(self, rows: torch.Tensor, positions: Sequence[int], slots: torch.Tensor) -> None:
        """Record one slot per row at its ``positions[i]`` (a decode step), in one write."""
        if positions and max(positions) >= self.max_context_len:
            raise InvalidInputError(
                f"request too long: expected at most {self.max_context_len} tokens of context, got {max(positions) + 1}"
            )
        cols = torch.tensor(list(positions), dtype=torch.int64)
        rows, cols, slots = to_device((rows, cols, slots.to(torch.int32)), self.device)
        self.req_to_token[rows, cols] = slots

    def write_block(self, rows: torch.Tensor, starts: Sequence[int], slots: torch.Tensor) -> None:
        """Record ``slots [b, w]`` at positions ``starts[i] ..`` of ``rows[i]``, in one write."""
        width = slots.shape[1]
        if starts and max(starts) + width > self.max_context_len:
            raise InvalidInputError(
                f"request too long: expected at most {self.max_context_len} tokens of context, "
                f"got {max(starts) + width}"
            )
        cols = torch.tensor(list(starts), dtype=torch.int64).view(-1, 1) + torch.arange(width)
        self.req_to_token[rows.to(self.device).view(-1, 1), cols.to(self.device)] = slots.to(self.req_to_token)

    def unmap(self, rows: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """The slots recorded at ``(rows[i], positions[i])`` (int64, host), pointed at
        the dummy slot again; the caller frees them. A pair mapping no slot is refused."""
        r = torch.tensor(list(rows), dtype=torch.int64, device=self.device)
        c = torch.tensor(list(positions), dtype=torch.int64, device=self.device)
        slots = self.req_to_token[r, c].to("cpu", torch.int64)
        empty = (slots == DUMMY_SLOT).nonzero().flatten()[:4].tolist()
        if empty:
            pairs = [(int(rows[i]), int(positions[i])) for i in empty]
            raise InvalidInputError(f"unmap: expected (row, position) pairs that map a slot, got {pairs} unmapped")
        self.req_to_token[r, c] = DUMMY_SLOT
        return slots

    def mapped_slots(self, rows: Sequence[int]) -> torch.Tensor:
        """Every slot ``rows`` map, int64 on the host."""
        table = self.req_to_token[torch.tensor(list(rows), dtype=torch.int64, device=self.device)]
        return table[table != DUMMY_SLOT].to("cpu", torch.int64)


def allocate_requests(
    req_pool: ReqToTokenPool,
    kv_pool: "KVPool",
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and KV slots for new requests, all or nothing: ``(req_pool_indices
    [bs], out_cache_loc [sum(extend_lens)])`` int64 on the host. Everything is
    checked before anything is taken; a failure part-way gives it back."""
    prefix_lens, extend_lens = check_request_lens(prefix_lens, extend_lens)
    for r, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        if p + e > req_pool.max_context_len:
            raise InvalidInputError(
                f"request {r} too long: expected prefix + new <= {req_pool.max_context_len} "
                f"tokens of context, got {p} + {e}"
            )
    need = sum(p + e for p, e in zip(prefix_lens, extend_lens))
    if need > kv_pool.available:
        raise KVPoolExhaustedError(
            f"KV pool exhausted: expected {need} free slots, got {kv_pool.available} "
            f"of {kv_pool.num_slots}; free finished requests or build a larger pool"
        )
    rows = req_pool.alloc(len(prefix_lens))
    held: List[torch.Tensor] = []
    try:
        new_slots: List[torch.Tensor] = []
        for row, p, e in zip(rows, prefix_lens, extend_lens):
            slots = kv_pool.alloc(p + e)
            held.append(slots)
            req_pool.write(row, 0, slots)
            new_slots.append(slots[p:])
    except BaseException:
        if held:
            kv_pool.free(torch.cat(held))
        req_pool.free(rows)
        raise
    loc = torch.cat(new_slots) if new_slots else torch.empty(0, dtype=torch.int64)
    return torch.tensor(rows, dtype=torch.int64), loc


def check_request_lens(prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> tuple[List[int], List[int]]:
    """``(prefix_lens, extend_lens)`` as lists of ints >= 0 of one length, or raise."""
    lists = []
    for name, lens in (("prefix_lens", prefix_lens), ("extend_lens", extend_lens)):
        values = list(lens)
        bad = [x for x in values if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0]
        if bad:
            raise InvalidInputError(f"{name}: expected ints >= 0, got {bad[:4]}")
        lists.append([int(x) for x in values])
    if len(lists[0]) != len(lists[1]):
        raise InvalidInputError(
            f"prefix_lens and extend_lens: expected one entry per request in both, "
            f"got {len(lists[0])} and {len(lists[1])}"
        )
    return lists[0], lists[1]


class KVPool:
    """Per-layer K and V over ``num_slots`` usable slots (plus the dummy); which
    slots are free is kept on the host, so nothing waits for the device."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        self.num_slots = check_positive_int("num_slots", num_slots)
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.num_kv_heads = check_positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = check_positive_int("head_dim", head_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots + 1, num_kv_heads, head_dim)  # +1: the dummy slot 0
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64)
        # allocated[s]: slot s is held by a request. The dummy slot never is.
        self._allocated = torch.zeros(num_slots + 1, dtype=torch.bool)
        # The same memory as a numpy array: a decode step's few slot ids are
        # looked up in Python, cheaper than indexing the tensor with them.
        self._allocated_view = self._allocated.numpy()

    @property
    def available(self) -> int:
        return int(self._free.numel())

    def alloc(self, n: int) -> torch.Tensor:
        """``n`` fresh slots, int64 on the host."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidInputError(f"alloc: expected a count >= 0, got {n!r}")
        if n > self.available:
            raise KVPoolExhaustedError(
                f"KV pool exhausted: expected {n} free slots, got {self.available} "
                f"of {self.num_slots}; free finished requests or build a larger pool"
            )
        taken, self._free = self._free[:n], self._free[n:]
        self._allocated[taken] = True
        return taken

    def is_allocated(self, slots: torch.Tensor) -> torch.Tensor:
        """``[n]`` bool: each host slot id lies in the pool and is held (out-of-range ids: False)."""
        in_range = (slots >= 0) & (slots <= self.num_slots)
        return in_range & self._allocated[slots.clamp(0, self.num_slots)]

    def all_allocated(self, slots: Union[torch.Tensor, Sequence[int]]) -> bool:
        if isinstance(slots, torch.Tensor):
            return bool(self._allocated[slots].all())
        held = self._allocated_view
        return all(held[s] for s in slots)

    def free(self, slots: torch.Tensor) -> None:
        """Release ``slots``, all or none; refuses the dummy slot, ids outside the
        pool, unallocated slots (a double free) and a slot named twice."""
        slots = slots.detach().to("cpu", torch.int64).flatten()
        if not slots.numel():
            return
        if slots.min() < 1 or slots.max() > self.num_slots:
            raise InvalidInputError(
                f"free: expected slots in [1, {self.num_slots}], got min {int(slots.min())}, max {int(slots.max())}"
            )
        held = self.is_allocated(slots)
        if not bool(held.all()):
            raise InvalidInputError(
                f"free: expected allocated slots, got {slots[~held][:8].tolist()} not allocated "
                f"(freed twice, or never handed out)"
            )
        if torch.unique(slots).numel() != slots.numel():
            raise InvalidInputError("free: expected distinct slots, got a slot named twice")
        self._allocated[slots] = False
        self._free = torch.cat([self._free, slots])

    def check_layer(self, layer_id: int) -> None:
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or not 0 <= layer_id < self.num_layers:
            raise InvalidInputError(f"layer_id: expected an int in [0, {self.num_layers}), got {layer_id!r}")

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v [n, num_kv_heads, head_dim]`` at slots ``loc [n]`` (``index_copy_``)."""
        self.k_buffers[layer_id].index_copy_(0, loc, k)
        self.v_buffers[layer_id].index_copy_(0, loc, v)

    def check_kv_rows(self, name: str, t: torch.Tensor) -> None:
        """``t`` is ``[*, num_kv_heads, head_dim]`` rows of this pool's dtype and device."""
        check_tensor(name, t, shape=(None, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device)
