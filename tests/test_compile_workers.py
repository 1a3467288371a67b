"""Inductor's compile worker processes start before Dynamo traces a model
compiled for CUDA (``piece_compiler.start_inductor_workers``): until they are
up, Inductor compiles each Triton kernel of the pieces in the calling
process, one after another. A CPU compile starts none."""

from unittest import mock

import pytest
import torch

import sgl_piecewise as sp
from sgl_piecewise.backends import ReferenceBackend
from sgl_piecewise.compile import CompiledModel, CompileOptions, compiled_model
from sgl_piecewise.engine.testing import random_batch, two_layer_llama_config
from sgl_piecewise.models import build_random_model

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _model_and_backend(device: str):
    model = build_random_model(two_layer_llama_config(), device=device, seed=1)
    pool = sp.KVPool(512, 2, 2, 16, device=device)
    return model, ReferenceBackend(sp.ReqToTokenPool(max_reqs=8, max_context_len=64, device=device), pool)


def _steps(compiled, backend, token_counts) -> None:
    for n in token_counts:
        batch = random_batch(sp.ForwardMode.EXTEND, backend.req_to_token_pool, backend.kv_pool, [0], [n],
                             vocab_size=256)  # fmt: skip
        backend.init_forward_metadata(batch)
        with torch.no_grad(), sp.forward_context(batch, backend):
            compiled(batch.input_ids, batch.positions)


def _workers_started(device: str, piece_compiler: str) -> list:
    """Per call of ``start_inductor_workers``: how many piecewise modules
    the backend had compiled by then."""
    model, backend = _model_and_backend(device)
    compiled = CompiledModel(model, CompileOptions(piece_compiler=piece_compiler))
    seen = []
    with mock.patch.object(
        compiled_model, "start_inductor_workers", lambda: seen.append(len(compiled.backend.modules))
    ):
        _steps(compiled, backend, (5, 3, 9))
    return seen


def test_a_cpu_compile_starts_no_compile_workers():
    assert _workers_started("cpu", "inductor") == []


@pytest.mark.gpu
def test_a_cuda_compile_starts_the_workers_once_before_its_trace():
    assert _workers_started("cuda", "inductor") == [0]


@pytest.mark.gpu
def test_a_compile_without_inductor_starts_no_compile_workers():
    assert _workers_started("cuda", "eager") == []
