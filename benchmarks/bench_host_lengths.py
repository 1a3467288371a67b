"""What the host copy of the sequence lengths costs a whole-model step (a script, not a test).

A whole-model replay passes the backend's replay hook ``seq_lens_cpu`` and
``seq_lens_sum`` only where the backend reads them
(``AttentionBackend.replay_reads_host_lengths``); the graph backends here do
not, so their runners keep no host copy. This builds a suite shape (bf16,
``triton`` attention, context 1024), two whole-model runners recording the
model compiled whole over one backend — one as the backend declares, one
told the backend reads the host lengths (its registry copies
``seq_lens_cpu`` and the replay sums it, as before) — and times a whole
decode step (fill, replay, LM head) through each at ``--decode-bs``, in
interleaved rounds (``common.time_paths``).

    python benchmarks/bench_host_lengths.py --out results/ [--shape 1b]
    python benchmarks/bench_host_lengths.py --shape tiny --device cpu --out /tmp/smoke  # the logic, on a CPU
"""

from __future__ import annotations

import argparse
import types

import suite
import torch
from common import card_info, free_batch, graph_step_fn, time_paths, write_json  # noqa: E402

from sgl_piecewise.compile import CompiledModel, CompileOptions
from sgl_piecewise.runners import CudaGraphRunner


def runners(runner, sizes) -> dict:
    """name -> a whole-model runner, captured: without and with the host copy."""
    backend, graphs = runner.backend, {}
    declared = backend.replay_reads_host_lengths
    try:
        for name, reads in (("no host copy (as declared)", declared), ("host copy", True)):
            backend.replay_reads_host_lengths = reads  # read once, by the runner's constructor
            forward = CompiledModel(runner.model, CompileOptions(split_graph=False))
            graphs[name] = CudaGraphRunner(runner, sizes, forward=forward)
            graphs[name].capture(progress=False)
    finally:
        backend.replay_reads_host_lengths = declared
    runner.step_graphs = None
    return graphs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--shape", choices=sorted(suite.SHAPES), default="0.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--decode-bs", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=12)
    cli = p.parse_args()
    args = types.SimpleNamespace(shape=cli.shape, device=cli.device, backend="triton", context=1024,
                                 decode_bs=cli.decode_bs, extend=[16])  # fmt: skip
    model, runner = suite.build(args)
    graphs = runners(runner, sorted(cli.decode_bs))
    rows = {}
    with torch.no_grad():
        for bs in cli.decode_bs:
            batch = suite.step_batch(args, runner, "decode", bs)
            paths = {name: (lambda g=g, b=batch: graph_step_fn(runner, g, b)) for name, g in graphs.items()}
            rows[bs] = time_paths(paths, rounds=cli.rounds)
            print(f"decode bs {bs:3d}  " + "  ".join(f"{k}: {v:.4f} ms" for k, v in rows[bs].items()
                                                     if not k.endswith("_maxdiff")), flush=True)  # fmt: skip
            free_batch(runner, batch)
    info = card_info(shape=cli.shape, decode=rows) if cli.device == "cuda" else {"shape": cli.shape, "decode": rows}
    write_json(cli.out, f"host_lengths_{cli.shape}.json", info)


if __name__ == "__main__":
    main()
