"""Building blocks of the Llama-family models, each holding its rank's shard
under tensor parallelism (``parallel.py``). Activations are token-major
(``[T, ...]``, every request's tokens concatenated); nothing branches on
``T`` or reads a tensor on the host, so a model traces into one graph.
Parameters start uninitialised: a checkpoint or a seed fills them.

Under sequence parallelism (``tp.splits_sequence``) the residual stream's
rows, zero-padded to ``Tp`` (a multiple of the group's size ``N``), are
split across ranks: row-parallel projections reduce-scatter into them and
column-parallel ones all-gather them back, so norms and residual adds do
``1/N`` of the work.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from sgl_piecewise.checks import check_tensor
from sgl_piecewise.errors import InvalidInputError, InvalidTypeError
from sgl_piecewise.models.config import Llama3RopeScaling, ModelConfig
from sgl_piecewise.models.norm import RMSNorm, add_rms_norm, all_reduce_add_rms_norm
from sgl_piecewise.models.parallel import TPLayout
from sgl_piecewise.ops import gate_up_silu, linear, qkv_rope, unified_attention
from sgl_piecewise.ops.kernels import elementwise
from sgl_piecewise.regions import repeated_region

if TYPE_CHECKING:
    from sgl_piecewise.distributed import TensorParallel


class Linear(nn.Module):
    """``y = x @ weight.T (+ bias)``, weight ``[out, in]`` as in ``nn.Linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def float32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden [N, H] @ weight[V, H].T`` as float32 logits: on CUDA one matmul
    writing float32 (``out_dtype``), else linear then a conversion."""
    check_tensor("hidden", hidden, shape=(None, weight.shape[1]), dtype=weight.dtype, device=weight.device)
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and weight.dtype == hidden.dtype:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return F.linear(hidden, weight).float()


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """``x`` with zero rows up to a multiple of ``multiple`` (``x`` itself where
    it is one already). A concatenation: ``F.pad`` takes no symbolic padding."""
    rows = x.shape[0]
    missing = (rows + multiple - 1) // multiple * multiple - rows
    if statically_known_true(missing == 0):
        return x
    return torch.cat([x, x.new_zeros((missing, *x.shape[1:]))])


def reduce_partial_sums(tp: TensorParallel, y: torch.Tensor) -> torch.Tensor:
    """The ranks' sum of each one's partial ``y``: all-reduced, or under sequence
    parallelism reduce-scattered into this rank's padded share of the rows."""
    if tp.splits_sequence:
        return tp.reduce_scatter(pad_rows(y, tp.size))
    return tp.all_reduce(y)


def gather_rows(tp: TensorParallel, x: torch.Tensor, rows: Optional[int] = None) -> torch.Tensor:
    """Every rank's share of the rows in rank order (its first ``rows``); ``x`` where not split."""
    if not tp.splits_sequence:
        return x
    gathered = tp.all_gather(x, dim=0)
    return gathered if rows is None else gathered[:rows]


class RowParallelLinear(Linear):
    """A linear layer over this rank's input columns (``o_proj``, ``down_proj``):
    partial sums reduced over the ranks, the bias added once after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype, device, tp: TensorParallel):
        super().__init__(in_features, out_features, bias, dtype, device)
        self.tp = tp
        # Whether the reduction, residual add and RMSNorm are one op (add_projected_and_norm).
        self.can_fuse_norm = not bias and tp.fuses_all_reduce_norm(out_features, dtype, device)
        self.fuses_norm = self.can_fuse_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.linear(x, self.weight, self.bias)
        if self.tp.splits_sequence:  # pad the narrower input, not the [Tp, H] product
            x = pad_rows(x, self.tp.size)
        y = reduce_partial_sums(self.tp, F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` on one rank, the add in the projection's op."""
        return linear(x, self.weight, self.bias, residual=residual)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)  # [T] -> [T, dim]


class VocabParallelEmbedding(Embedding):
    """This rank's rows of the embedding; an id outside them gives a zero row (a
    mask, not a branch), so the ranks' sum is the whole embedding."""

    def __init__(self, layout: TPLayout, dim: int, dtype, device, tp: TensorParallel):
        super().__init__(layout.vocab_per_rank, dim, dtype, device)
        self.tp = tp
        self.vocab_start = layout.vocab_start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])  # [T]
        rows = F.embedding(torch.where(inside, local, 0), self.weight)
        return reduce_partial_sums(self.tp, rows.masked_fill(~inside.unsqueeze(-1), 0))


class ParallelLMHead(Linear):
    """The LM head's rows of this rank's vocabulary (shared with a tied embedding)."""

    def __init__(self, layout: TPLayout, hidden_size: int, dtype, device, tp: TensorParallel):
        super().__init__(hidden_size, layout.vocab_per_rank, bias=False, dtype=dtype, device=device)
        self.tp = tp
        self.vocab_size = layout.vocab_size
        self.fused_projections = False  # set_fused_projections

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, H] -> [N, vocab]`` float32 logits, whole on every rank."""
        if self.fused_projections:
            return linear(hidden, self.weight, float32_out=True)
        local = float32_logits(hidden, self.weight)  # [N, Vp]
        if self.tp.size == 1:
            return local
        return self.tp.all_gather(local, dim=-1)[:, : self.vocab_size]


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[Llama3RopeScaling]) -> torch.Tensor:
    """Inverse frequencies, Llama-3 scaled if asked, computed as transformers does."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths stretched by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotary embedding ("rotate_half"): ``cos_sin_cache [positions, head_dim]``
    holds cos then sin, one row per position, gathered by ``positions``."""

    def __init__(self, config: ModelConfig, dtype, device):
        super().__init__()
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)
        t = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = t[:, None] * inv_freq[None, :]  # [P, D/2], float32 like transformers
        cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [P, D]
        cache = cache.to(device=device, dtype=dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # positions: [T]; x: [T, heads, D], rotated by each token's position
        if elementwise.eager(x) and self.cos_sin_cache.dtype == x.dtype:  # else the formula promotes
            return elementwise.rotary(positions, x, self.cos_sin_cache)
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)  # [T, D/2] each
        return _rotate(x, cos.unsqueeze(1), sin.unsqueeze(1))  # cos, sin: [T, 1, D/2]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, gate and up in one matmul (this rank's rows of each)."""

    def __init__(self, config: ModelConfig, layout: TPLayout, dtype, device, tp: TensorParallel):
        super().__init__()
        h, f = config.hidden_size, layout.intermediate_size  # f: this rank's columns of gate and of up
        self.gate_up_proj = Linear(h, 2 * f, bias=False, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(f, h, bias=False, dtype=dtype, device=device, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(x))  # [T, H]

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2F]
        if elementwise.eager(gate_up):
            return elementwise.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, F] each
        return F.silu(gate) * up

    def normed_activation(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``activation(norm(x))`` as one op (``ops.gate_up_silu``)."""
        return gate_up_silu(x, self.gate_up_proj.weight, norm_weight=norm.weight, eps=norm.eps)


class Attention(nn.Module):
    """Fused QKV projection and rotary (``project_qkv``), paged attention
    (``attend``, between the layer's two repeated regions) and ``o_proj``,
    over this rank's heads."""

    def __init__(self, config: ModelConfig, layout: TPLayout, layer_id: int, dtype, device, tp: TensorParallel):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = layout.num_heads
        self.num_kv_heads = layout.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = layout.q_size, layout.kv_size
        self.scaling = self.head_dim**-0.5
        h = config.hidden_size
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, bias=config.qkv_bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(self.q_size, h, bias=config.o_proj_bias, dtype=dtype, device=device, tp=tp)

    def project_qkv(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding) -> tuple:
        """``x [T, H]`` -> q and k rotated together as ``[T, Hq + Hkv, D]``, and v."""
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = rotary(positions, qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim))
        return qk, v.view(-1, self.num_kv_heads, self.head_dim)

    def normed_project_qkv(
        self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding, norm: RMSNorm
    ) -> tuple:
        """``project_qkv(positions, norm(x), rotary)`` as one op (``ops.qkv_rope``)."""
        proj, cache = self.qkv_proj, rotary.cos_sin_cache.to(x.dtype)  # the model's dtype: the same tensor
        return qkv_rope(
            x,
            proj.weight,
            proj.bias,
            positions,
            cache,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            norm_weight=norm.weight,
            eps=norm.eps,
        )

    def attend(self, qk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, Hq, D], [T, Hkv, D]
        o = unified_attention(q, k, v, layer_id=self.layer_id, scale=self.scaling)  # [T, Hq, D]
        return o.reshape(-1, self.q_size)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: attention, then the gated MLP. A model runs it
    through :meth:`run`, which takes the input norm computed and computes the
    next layer's, so each norm is one kernel with the residual add (and, where
    the group can, the all-reduce) before it. With ``fused_projections`` (one
    rank) :meth:`run_fused` instead puts norms and adds inside the projections."""

    def __init__(self, config: ModelConfig, layout: TPLayout, layer_id: int, dtype, device, tp: TensorParallel):
        super().__init__()
        eps, h = config.rms_norm_eps, config.hidden_size
        self.tp = tp
        self.input_layernorm = RMSNorm(h, eps, dtype, device)
        self.self_attn = Attention(config, layout, layer_id, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device)
        self.mlp = GatedMLP(config, layout, dtype, device, tp)
        self.fused_projections = False

    def forward(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        if self.fused_projections:
            return self.run_fused(positions, x, rotary)
        return self.run(positions, x, self.input_layernorm(x), rotary)

    def run_fused(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        qk, v = self._before_attention_fused(positions, x, rotary)
        return self._after_attention_fused(self.self_attn.attend(qk, v), x)

    @repeated_region
    def _before_attention_fused(self, positions: torch.Tensor, x: torch.Tensor, rotary: RotaryEmbedding) -> tuple:
        return self.self_attn.normed_project_qkv(positions, x, rotary, self.input_layernorm)

    @repeated_region
    def _after_attention_fused(self, attn_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = self.self_attn.o_proj.add_to(x, attn_out)
        return self.mlp.down_proj.add_to(x, self.mlp.normed_activation(x, self.post_attention_layernorm))

    def run(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        h: torch.Tensor,
        rotary: RotaryEmbedding,
        next_norm: Optional[RMSNorm] = None,
    ):
        """The stream after this layer from the stream ``x`` and its norm ``h``;
        with ``next_norm``, ``(stream, next_norm(stream))``. The attention call
        names its layer, so it stays outside the shared regions."""
        qk, v = self._before_attention(positions, h, rotary)
        return self._after_attention(self.self_attn.attend(qk, v), x, next_norm)

    @repeated_region
    def _before_attention(self, positions: torch.Tensor, h: torch.Tensor, rotary: RotaryEmbedding) -> tuple:
        h = gather_rows(self.tp, h, rows=positions.shape[0])  # the step's T rows
        return self.self_attn.project_qkv(positions, h, rotary)

    @repeated_region
    def _after_attention(self, attn_out: torch.Tensor, x: torch.Tensor, next_norm: Optional[RMSNorm]):
        x, h = add_projected_and_norm(self.self_attn.o_proj, attn_out, x, self.post_attention_layernorm)
        # Under sequence parallelism the MLP runs on all Tp rows (its reduce-scatter needs no padding).
        mlp_in = self.mlp.activation(gather_rows(self.tp, h))
        if next_norm is None:
            return x + self.mlp.down_proj(mlp_in)
        return add_projected_and_norm(self.mlp.down_proj, mlp_in, x, next_norm)


def add_projected_and_norm(proj: RowParallelLinear, inp: torch.Tensor, x: torch.Tensor, norm: RMSNorm) -> tuple:
    """``(y, norm(y))`` with ``y = x + proj(inp)``: one op with the all-reduce
    where the projection fuses it, else the add and norm in one kernel."""
    if proj.fuses_norm:
        return all_reduce_add_rms_norm(proj.tp, F.linear(inp, proj.weight), x, norm)
    return add_rms_norm(x, proj(inp), norm)


def set_fused_projections(model: nn.Module, enabled: bool) -> int:
    """Run ``model``'s layers and LM head through the fused projection ops
    (faster for small decode batches) from its next trace on; one rank only.
    Returns how many modules it set."""
    if not isinstance(enabled, bool):
        raise InvalidTypeError(f"enabled: expected a bool, got {enabled!r}")
    modules = [m for m in model.modules() if hasattr(m, "fused_projections")]
    if enabled and any(getattr(m, "tp", None) is not None and m.tp.size > 1 for m in modules):
        raise InvalidInputError("set_fused_projections: expected a model of one rank, got a tensor-parallel shard")
    for module in modules:
        module.fused_projections = enabled
    return len(modules)
