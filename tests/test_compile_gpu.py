"""Piecewise CUDA graphs on a GPU: replay equals eager for every captured size
and the sizes between them, over several steps with changing inputs."""

from unittest import mock

import pytest
import torch

import sgl_piecewise as sp
from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.compile import CompiledModel, CompileOptions, counters
from sgl_piecewise.engine.testing import random_batch
from sgl_piecewise.models import build_random_model, default_config
from sgl_piecewise.ops.kernels import elementwise

pytestmark = pytest.mark.gpu
SIZES = (1, 2, 4, 8, 16, 24, 32)


def _setup():
    torch._dynamo.reset()
    counters.reset()
    model = build_random_model(default_config(), torch.bfloat16, "cuda", seed=3)
    cfg = model.config
    table = sp.ReqToTokenPool(8, 512, "cuda")
    pool = sp.KVPool(8192, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, torch.bfloat16, "cuda")
    return model, ReferenceBackend(table, pool)


def _step(fn, backend, prefix, extend, vocab):
    batch = random_batch(
        sp.ForwardMode.EXTEND, backend.req_to_token_pool, backend.kv_pool, prefix, extend, vocab_size=vocab
    )
    backend.init_forward_metadata(batch)
    with torch.no_grad(), sp.forward_context(batch, backend):
        out = fn(batch.input_ids, batch.positions)
    return batch, out


def _eager_padded(model, backend, batch, padded):
    """Eager on the same padded inputs the graphs saw: identical kernels. The
    eager piece compiler runs the traced plain formulas, so this does too
    (eagerly on CUDA the model would launch its fused kernels instead)."""
    n = batch.num_tokens
    ids = torch.zeros(padded, dtype=torch.int64, device="cuda")
    pos = torch.zeros_like(ids)
    ids[:n], pos[:n] = batch.input_ids, batch.positions
    with torch.no_grad(), sp.forward_context(batch, backend), mock.patch.object(elementwise, "eager", _never):
        return model(ids, pos)[:n]


def _never(x):
    return False


@pytest.mark.parametrize("piece_compiler", ["eager", "inductor"])
def test_graph_replay_equals_eager_for_every_size_and_between(piece_compiler):
    model, backend = _setup()
    opts = CompileOptions(cudagraphs=True, capture_sizes=SIZES, piece_compiler=piece_compiler, debug_checks=True)
    compiled = CompiledModel(model, opts)
    vocab = model.config.vocab_size
    for rnd in range(2):  # second round replays every size with new inputs
        for n in range(1, max(SIZES) + 1):
            prefix = [rnd * 7 + n % 5, 3]
            extend = [n - 1, 1] if n > 1 else [1]  # two ragged requests, one when n == 1
            prefix = prefix[: len(extend)]
            batch, got = _step(compiled, backend, prefix, extend, vocab)
            padded = opts.padded_size(batch.num_tokens)
            if piece_compiler == "eager":
                assert torch.equal(got, _eager_padded(model, backend, batch, padded)), n
            with torch.no_grad(), sp.forward_context(batch, backend):
                want = model(batch.input_ids, batch.positions)
            torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=5e-2)
            backend.req_to_token_pool.free(batch.req_pool_indices.tolist())  # 8 rows; slots suffice
    assert counters.graphs_captured == len(SIZES) * counters.pieces_seen
    assert not counters.eager_fallbacks
