"""One validation of a ``ForwardBatch`` against the pools it will run on. A
caller-built batch is not trusted: a bad row or slot index reads or writes
another request's cache, or ends the CUDA context with a device assert. Host
checks run always (shapes, dtypes, devices, lengths, and rows and slots from
the host copies); device checks (the device tensors against their host
copies, positions, the table mapping each new token to its slot) run under
``debug_checks``, and always on the CPU, where they cost no wait.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

import torch

from sgl_piecewise.checks import same_device
from sgl_piecewise.errors import InvalidInputError
from sgl_piecewise.forward import ForwardBatch, ForwardMode, token_positions

if TYPE_CHECKING:  # pragma: no cover
    from sgl_piecewise.memory import KVPool, ReqToTokenPool

_INT_DTYPES = (torch.int32, torch.int64)


def check_batch(
    batch: ForwardBatch,
    req_pool: "ReqToTokenPool",
    kv_pool: "KVPool",
    *,
    debug_checks: bool = False,
) -> None:
    """Raise ``InvalidInputError`` if ``batch`` cannot run on these pools."""
    prefix, extend, rows = _check_lengths_tensors_rows(batch, req_pool, kv_pool)
    slots = _first(_host_copy(batch.out_cache_loc_cpu, batch.out_cache_loc), sum(extend))
    _check_slots(slots, kv_pool)
    device_checks = debug_checks or batch.device.type == "cpu"
    _check_accept_lengths(batch, extend, kv_pool.device, values=device_checks)
    if device_checks:
        _check_device_values(batch, req_pool, prefix, extend, rows, slots)


def _host_copy(host: Optional[torch.Tensor], device_tensor: torch.Tensor) -> torch.Tensor:
    return host if host is not None else device_tensor.cpu()


def _first(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t[:n]``; ``t`` itself where it holds ``n`` already (no slice on the hot path)."""
    return t if t.shape[0] == n else t[:n]


# ---- host: lengths and the mode ---------------------------------------------
def _check_host_lengths(batch: ForwardBatch, max_context_len: int) -> tuple[List[int], List[int]]:
    bs, mode = batch.batch_size, batch.forward_mode
    prefix, extend = list(batch.extend_prefix_lens_cpu), list(batch.extend_seq_lens_cpu)
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 0:
        raise InvalidInputError(f"batch_size: expected an int >= 0, got {bs!r}")
    if len(prefix) != bs or len(extend) != bs:
        raise InvalidInputError(
            f"extend_prefix_lens_cpu, extend_seq_lens_cpu: expected {bs} entries (batch_size), "
            f"got {len(prefix)} and {len(extend)}"
        )
    _check_lengths_in_range(prefix, extend, max_context_len)
    _check_mode_widths(batch, extend)
    seq_cpu = batch.seq_lens_cpu
    if not isinstance(seq_cpu, torch.Tensor) or seq_cpu.device.type != "cpu" or seq_cpu.shape != (bs,):
        got = f"{seq_cpu.device} {list(seq_cpu.shape)}" if isinstance(seq_cpu, torch.Tensor) else type(seq_cpu).__name__
        raise InvalidInputError(f"seq_lens_cpu: expected a host tensor of shape [{bs}], got {got}")
    want = prefix if mode.seq_lens_exclude_new_tokens() else [p + e for p, e in zip(prefix, extend)]
    if seq_cpu.tolist() != want:
        meaning = "the prefix" if mode.seq_lens_exclude_new_tokens() else "prefix + new tokens"
        raise InvalidInputError(
            f"seq_lens_cpu: expected {meaning} per request in {mode.name} ({want[:8]}), got {seq_cpu.tolist()[:8]}"
        )
    return prefix, extend


def _check_lengths_in_range(prefix: List[int], extend: List[int], max_context_len: int) -> None:
    for name, lens in (("extend_prefix_lens_cpu", prefix), ("extend_seq_lens_cpu", extend)):
        bad = [x for x in lens if isinstance(x, bool) or not isinstance(x, int) or x < 0]
        if bad:
            raise InvalidInputError(f"{name}: expected ints >= 0, got {bad[:4]}")
    too_long = [r for r, (p, e) in enumerate(zip(prefix, extend)) if p + e > max_context_len]
    if too_long:
        r = too_long[0]
        raise InvalidInputError(
            f"request {r}: expected prefix + new tokens <= max_context_len ({max_context_len}), "
            f"got {prefix[r]} + {extend[r]}"
        )


def _check_mode_widths(batch: ForwardBatch, extend: List[int]) -> None:
    """New tokens per request as the mode defines them."""
    mode = batch.forward_mode
    if mode.is_idle():
        if batch.batch_size:
            raise InvalidInputError(f"IDLE: expected 0 requests, got {batch.batch_size}")
        return
    if any(e == 0 for e in extend):
        raise InvalidInputError(
            f"extend_seq_lens_cpu: expected >= 1 new token per request in {mode.name}, got {extend[:8]}"
        )
    if mode.is_decode():
        width = 1
    elif mode.has_uniform_query_width():
        spec = batch.spec_info
        width = spec.num_tokens_per_req if spec is not None else None
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise InvalidInputError(f"{mode.name}: expected spec_info.num_tokens_per_req, an int >= 1, got {width!r}")
    else:
        return
    at_most = mode.is_draft_extend_v2()
    if any(e > width if at_most else e != width for e in extend):
        want = f"at most {width}" if at_most else str(width)
        raise InvalidInputError(
            f"extend_seq_lens_cpu: expected {want} new token(s) per request in {mode.name}, got {extend[:8]}"
        )


def _check_accept_lengths(batch: ForwardBatch, extend: List[int], device: torch.device, values: bool) -> None:
    """DRAFT_EXTEND_V2's optional ``accept_lengths``: a value of 0 or above the
    block would pick another request's row (values checked on the device)."""
    spec = batch.spec_info
    if not batch.forward_mode.is_draft_extend_v2() or spec is None or spec.accept_lengths is None:
        return
    accept = spec.accept_lengths
    bs = batch.batch_size
    if not isinstance(accept, torch.Tensor) or accept.shape != (bs,) or accept.dtype not in _INT_DTYPES:
        got = f"{accept.dtype} {list(accept.shape)}" if isinstance(accept, torch.Tensor) else type(accept).__name__
        raise InvalidInputError(f"spec_info.accept_lengths: expected an int32/int64 tensor of shape [{bs}], got {got}")
    if not same_device(accept.device, device):
        raise InvalidInputError(
            f"spec_info.accept_lengths: expected device {device} (the KV pool's), got {accept.device}"
        )
    if values:
        got = accept.tolist()
        if any(not 1 <= a <= e for a, e in zip(got, extend)):
            raise InvalidInputError(
                f"spec_info.accept_lengths: expected values in [1, new tokens of the request] "
                f"({extend[:8]}), got {got[:8]}"
            )


# ---- host: tensors ------------------------------------------------------------
def _check_tensors(batch: ForwardBatch, device: torch.device, num_tokens: int) -> None:
    bs = batch.batch_size
    token_rows = batch.input_ids.shape[0] if isinstance(batch.input_ids, torch.Tensor) else None
    specs = (
        ("input_ids", batch.input_ids, None, _INT_DTYPES),
        ("positions", batch.positions, token_rows, (torch.int64,)),
        ("out_cache_loc", batch.out_cache_loc, token_rows, (torch.int64,)),
        ("seq_lens", batch.seq_lens, bs, _INT_DTYPES),
        ("extend_seq_lens", batch.extend_seq_lens, bs, _INT_DTYPES),
        ("extend_prefix_lens", batch.extend_prefix_lens, bs, _INT_DTYPES),
        ("req_pool_indices", batch.req_pool_indices, bs, (torch.int64,)),
    )
    for name, t, rows, dtypes in specs:
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or (rows is not None and t.shape[0] != rows):
            want = f"[{rows if rows is not None else 'T'}]"
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidInputError(f"{name}: expected a 1-D tensor of shape {want}, got {got}")
        if t.dtype not in dtypes:
            raise InvalidInputError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
        if not same_device(t.device, device):
            raise InvalidInputError(f"{name}: expected device {device} (the KV pool's), got {t.device}")
    if token_rows < num_tokens:
        raise InvalidInputError(f"input_ids: expected at least the batch's {num_tokens} new tokens, got {token_rows}")


def _check_rows(rows: torch.Tensor, req_pool: "ReqToTokenPool") -> None:
    values = rows.tolist()
    bad = [r for r in values if not req_pool.is_allocated(r)]
    if bad:
        raise InvalidInputError(
            f"req_pool_indices: expected rows allocated in the request table [0, {req_pool.max_reqs}), got {bad[:8]}"
        )
    if len(set(values)) != len(values):
        raise InvalidInputError(f"req_pool_indices: expected distinct rows, got {values[:16]}")


# Up to this many new tokens the slot checks run on Python lists (cheaper than torch ops).
_SMALL_SLOT_COUNT = 1024


def _check_slots(slots: torch.Tensor, kv_pool: "KVPool") -> None:
    n = slots.numel()
    if not n:
        return
    small = n <= _SMALL_SLOT_COUNT
    values = slots.tolist() if small else None
    lo, hi = (min(values), max(values)) if small else (int(slots.min()), int(slots.max()))
    if lo < 1 or hi > kv_pool.num_slots or not kv_pool.all_allocated(values if small else slots):
        held = kv_pool.is_allocated(slots)
        raise InvalidInputError(
            f"out_cache_loc: expected allocated KV slots in [1, {kv_pool.num_slots}] for the real "
            f"tokens (not the dummy slot 0), got {slots[~held][:8].tolist()}"
        )
    distinct = len(set(values)) if small else torch.unique(slots).numel()
    if distinct != n:
        raise InvalidInputError("out_cache_loc: expected a distinct slot per new token, got a slot twice")


# ---- device: values the host copies stand for ---------------------------------
def _check_device_values(batch, req_pool, prefix, extend, rows, slots) -> None:
    n = len(slots)
    prefix_t = torch.tensor(prefix, dtype=torch.int64)
    extend_t = torch.tensor(extend, dtype=torch.int64)
    seq_t = batch.seq_lens_cpu.to(torch.int64)
    for name, t, want in (
        ("seq_lens", batch.seq_lens, seq_t),
        ("extend_seq_lens", batch.extend_seq_lens, extend_t),
        ("extend_prefix_lens", batch.extend_prefix_lens, prefix_t),
        ("req_pool_indices", batch.req_pool_indices, rows),
        ("out_cache_loc", batch.out_cache_loc[:n], slots),
    ):
        got = t.cpu().to(torch.int64)
        if not torch.equal(got, want.to(torch.int64)):
            raise InvalidInputError(
                f"{name}: expected the values of its host copy ({want.tolist()[:8]}), got {got.tolist()[:8]}"
            )
    positions = token_positions(prefix_t, extend_t)
    got_positions = batch.positions[:n].cpu()
    if not torch.equal(got_positions, positions):
        raise InvalidInputError(
            f"positions: expected prefix + offset of each new token ({positions.tolist()[:8]}), "
            f"got {got_positions.tolist()[:8]}"
        )
    mapped = req_pool.req_to_token[rows.repeat_interleave(extend_t).to(req_pool.device), positions.to(req_pool.device)]
    mapped = mapped.cpu().to(torch.int64)
    if not torch.equal(mapped, slots):
        bad = (mapped != slots).nonzero().flatten()[:4].tolist()
        raise InvalidInputError(
            f"out_cache_loc: expected the slots the request table maps at each new token's position "
            f"(tokens {bad}: {mapped[bad].tolist()}), got {slots[bad].tolist()}; a slot that belongs "
            f"to another request or position would overwrite its cache"
        )


def check_metadata_batch(batch: ForwardBatch, req_pool: "ReqToTokenPool", kv_pool: "KVPool") -> None:
    """Raise ``InvalidInputError`` if a backend's metadata cannot describe
    ``batch``: the host checks less the new tokens' slots and positions, which
    the metadata never reads (``forward_context`` checks them)."""
    _check_lengths_tensors_rows(batch, req_pool, kv_pool)
    rows, host = batch.req_pool_indices, batch.req_pool_indices_cpu
    if host is not None and rows is not host and rows.device.type == "cpu":  # the rows the fills gather with
        _check_rows(rows, req_pool)


def _check_lengths_tensors_rows(batch: ForwardBatch, req_pool: "ReqToTokenPool", kv_pool: "KVPool"):
    """What both checks share; ``(prefix, extend, rows)``."""
    if not isinstance(batch, ForwardBatch):
        raise InvalidInputError(f"batch: expected a ForwardBatch, got {type(batch).__name__}")
    if not isinstance(batch.forward_mode, ForwardMode):
        raise InvalidInputError(f"forward_mode: expected a ForwardMode, got {batch.forward_mode!r}")
    prefix, extend = _check_host_lengths(batch, req_pool.max_context_len)
    _check_tensors(batch, kv_pool.device, sum(extend))
    rows = _host_copy(batch.req_pool_indices_cpu, batch.req_pool_indices)
    _check_rows(rows, req_pool)
    return prefix, extend, rows
