"""What the decode and extend kernels share: tile helpers and argument checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_piecewise.errors import InvalidInputError


@triton.jit
def mm(a, b, F32X3: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in float32. F32X3: three TF32 products, about fp32
    accurate. UPCAST (Triton's interpreter): its bf16 dot multiplies bit
    patterns as integers, so operands go to fp32 first."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif F32X3:
        return tl.dot(a, b, input_precision="tf32x3")
    else:
        return tl.dot(a, b)


@triton.jit
def load_rows(base, slots, row_stride, offs, mask_rows, mask_cols):
    """``[len(slots), len(offs)]`` tile of pool rows ``slots`` (int64); 0 where masked."""
    return tl.load(
        base + slots[:, None] * row_stride + offs[None, :],
        mask=mask_rows[:, None] & mask_cols[None, :],
        other=0.0,
    )


@triton.jit
def softmax_step(s, m_i, l_i):
    """One online-softmax step over logits ``s [M, N]`` (exp2 domain, -inf =
    hidden); returns ``(p, alpha, m_new, l_new)``. A row with no visible key
    yet is shifted by 0, so its weights are 0, not NaN. The sum stays exactly
    0 until a key carries weight, and a NaN logit reaches it through its weight.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


def check_attention_args(kernel: str, rows: str, q, k_cache, v_cache, out) -> tuple:
    """Checks both kernels share, without a sync; returns ``(rows, Hq, Dv)``."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise InvalidInputError(
            f"{kernel}: expected q [{rows}, Hq, D] and caches [slots, Hkv, D], "
            f"got {list(q.shape)}, {list(k_cache.shape)}, {list(v_cache.shape)}"
        )
    num_rows, num_q_heads, _ = q.shape
    num_kv_heads, dv = k_cache.shape[1], v_cache.shape[2]
    if num_q_heads % num_kv_heads or v_cache.shape[:2] != k_cache.shape[:2]:
        raise InvalidInputError(
            f"{kernel}: expected Hq a multiple of Hkv and matching K/V caches, "
            f"got q {list(q.shape)}, k {list(k_cache.shape)}, v {list(v_cache.shape)}"
        )
    if out.shape != (num_rows, num_q_heads, dv) or not q.dtype == k_cache.dtype == v_cache.dtype == out.dtype:
        raise InvalidInputError(
            f"{kernel}: expected out [{num_rows}, {num_q_heads}, {dv}] and one dtype for "
            f"q/k/v/out, got out {list(out.shape)}, dtypes {q.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}, {out.dtype}"
        )
    return num_rows, num_q_heads, dv


def check_last_dim_contiguous(kernel: str, **tensors) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise InvalidInputError(
                f"{kernel}: expected {name} contiguous in its last dim, "
                f"got strides {t.stride()}; pass a .contiguous() tensor"
            )


def check_num_rows(kernel: str, rows: int, num_rows) -> int:
    """The rows of a launch that are tokens, in ``[0, rows]``; None: all."""
    n = rows if num_rows is None else num_rows
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= rows:
        raise InvalidInputError(f"{kernel}: expected num_rows an int in [0, {rows}], got {num_rows!r}")
    return n


def check_new_kv(kernel: str, rows: int, num_rows: int, k_cache, v_cache, new_k, new_v, out_cache_loc) -> None:
    """The new tokens' K/V and their slots: all three or none."""
    if (new_k is None) != (new_v is None) or (new_k is None) != (out_cache_loc is None):
        raise InvalidInputError(f"{kernel}: expected new_k, new_v and out_cache_loc together, got some of them")
    if new_k is None:
        return
    want_k, want_v = (rows, k_cache.shape[1], k_cache.shape[2]), (rows, v_cache.shape[1], v_cache.shape[2])
    if tuple(new_k.shape) != want_k or tuple(new_v.shape) != want_v or not new_k.dtype == new_v.dtype == k_cache.dtype:
        raise InvalidInputError(
            f"{kernel}: expected new_k {list(want_k)} and new_v {list(want_v)} of {k_cache.dtype}, "
            f"got {list(new_k.shape)} {new_k.dtype} and {list(new_v.shape)} {new_v.dtype}"
        )
    check_slots(kernel, out_cache_loc, num_rows, k_cache.device)


def check_slots(kernel: str, out_cache_loc, num_rows: int, device: torch.device) -> None:
    """The new tokens' slots: contiguous int64 ``[>= num_rows]`` on ``device``."""
    if out_cache_loc.dim() != 1 or out_cache_loc.shape[0] < num_rows or out_cache_loc.dtype != torch.int64:
        raise InvalidInputError(
            f"{kernel}: expected out_cache_loc int64 [>={num_rows}], "
            f"got {out_cache_loc.dtype} {list(out_cache_loc.shape)}"
        )
    if out_cache_loc.device != device or not out_cache_loc.is_contiguous():
        raise InvalidInputError(
            f"{kernel}: expected out_cache_loc contiguous on {device}, "
            f"got {out_cache_loc.device} with stride {out_cache_loc.stride(0)}"
        )


def rebind_slots(kernel: str, slots, new_slots, num_rows: int, launches) -> bool:
    """Can a plan over ``slots`` take ``new_slots``: the same tensor, or one
    every ``(StepLaunch, argument position)`` took? After False, drop the plan."""
    if new_slots is slots:
        return True
    if new_slots is None:
        return False
    check_slots(kernel, new_slots, num_rows, slots.device)
    return all(launch.rebind(position, new_slots) for launch, position in launches)


def layer_layout(q, k_cache, v_cache, out, new_k, new_v) -> tuple:
    """Each of one layer's tensors' shape, strides and dtype (spelled out: it runs per layer per step)."""
    layout = (
        q.shape, q.stride(), q.dtype, k_cache.shape, k_cache.stride(), k_cache.dtype,
        v_cache.shape, v_cache.stride(), v_cache.dtype, out.shape, out.stride(), out.dtype,
    )  # fmt: skip
    if new_k is None or new_v is None:
        return layout + (new_k is None, new_v is None)
    return layout + (new_k.shape, new_k.stride(), new_k.dtype, new_v.shape, new_v.stride(), new_v.dtype)
