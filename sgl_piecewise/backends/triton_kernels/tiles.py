"""What the decode and extend kernels share: device helpers for one tile
(matmul in float32, a gather of pool rows, an online-softmax step) and the
host-side checks of their arguments."""

from __future__ import annotations

import triton
import triton.language as tl

from sgl_piecewise.errors import InvalidInputError


@triton.jit
def mm(a, b, F32X3: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b`` accumulated in float32.

    F32X3 (fp32 inputs): three TF32 tensor-core products, about fp32 accurate,
    where a plain fp32 dot would round inputs to TF32 (~1e-3 relative).
    UPCAST (Triton's CPU interpreter only): its dot multiplies bf16 bit
    patterns as integers, so operands go to fp32 first; values are unchanged.
    """
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif F32X3:
        return tl.dot(a, b, input_precision="tf32x3")
    else:
        return tl.dot(a, b)


@triton.jit
def load_rows(base, slots, row_stride, offs, mask_rows, mask_cols):
    """``[len(slots), len(offs)]`` tile of pool rows ``slots`` (int64); 0 where masked.

    Each row is one token's contiguous head vector, so a row is one
    coalesced read however the slots are scattered.
    """
    return tl.load(
        base + slots[:, None] * row_stride + offs[None, :],
        mask=mask_rows[:, None] & mask_cols[None, :],
        other=0.0,
    )


@triton.jit
def softmax_step(s, m_i, l_i):
    """One online-softmax step over logits ``s [M, N]`` (exp2 domain, -inf =
    hidden) with running max ``m_i [M]`` and sum ``l_i [M]``.

    Returns ``(p, alpha, m_new, l_new)``: the tile's weights, the factor that
    rescales earlier accumulators, and the updated max and sum. A row that
    has seen no visible key keeps m = -inf and is shifted by 0, so it gets
    weights 0 rather than exp2(-inf - -inf) = NaN.

    The sum is exactly 0 until a key carries weight, then >= 1 (the max key
    adds exp2(0)), and NaN once a logit is NaN: ``tl.maximum`` may drop a NaN
    (default ``propagate_nan``), but its weight is NaN and the sum keeps it.
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


def check_attention_args(kernel: str, rows: str, q, k_cache, v_cache, out) -> tuple:
    """Checks both kernels share, reading no tensor values (no sync): q
    ``[rows, Hq, D]``, caches ``[slots, Hkv, D|Dv]``, out ``[rows, Hq, Dv]``, one
    dtype. Returns ``(rows, Hq, Dv)``."""
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
