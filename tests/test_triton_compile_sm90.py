"""The Triton kernels compiled offline for Hopper (sm_90): no register
spills and shared memory within an H100's limit, for every launch setting
the library uses (the projection kernels: every tiling of the shipped
tables). Needs Triton's bundled ptxas/cuobjdump, not a GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the Triton kernels need the `triton` package")

# Compiles the kernels for Hopper with Triton's bundled ptxas (no GPU needed)
# and prints one JSON line per config: registers, spill bytes (STACK) and
# dynamic shared memory. It must run without TRITON_INTERPRET, hence a child
# process. The interpreter cannot catch compile-only errors; this can.
_SM90_SCRIPT = r"""
import inspect, json, os, subprocess, sys, tempfile
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sgl_piecewise.backends.triton_kernels import decode as dec, extend as ext
if "constexprs" not in inspect.signature(ASTSource.__init__).parameters:
    print("SKIP this Triton's ASTSource takes no constexprs"); sys.exit(0)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}

def build(fn, meta, types):
    meta = dict(meta)
    opts = {"num_warps": meta.pop("num_warps"), "num_stages": meta.pop("num_stages")}
    sig = {n: types.get(n, "*i32" if n.endswith("_ptr") else "i32") for n in fn.arg_names}
    sig.update({n: "constexpr" for n in meta})
    # Pointers and strides are 16-aligned in real launches; say so, as the JIT does.
    aligned = [i for i, n in enumerate(fn.arg_names) if n.endswith("_ptr") and n != "mask_ptr"
               or n.startswith("stride_") and not n.endswith(("lh", "_lb"))]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    c = triton.compile(ASTSource(fn, sig, constexprs=meta, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                           capture_output=True, text=True, check=True).stdout
    fields = dict(kv.split(":") for kv in usage[usage.index("REG:"):].split()[:3])
    return {"regs": int(fields["REG"]), "spill": int(fields["STACK"]), "smem": c.metadata.shared}

for dtype, hq, hkv, d in [(torch.bfloat16, 32, 8, 128), (torch.bfloat16, 8, 1, 256),
                          (torch.float16, 14, 2, 80), (torch.bfloat16, 64, 1, 128),
                          (torch.float32, 8, 2, 128)]:
    for new_kv in (False, True):
        meta = dec.decode_kernel_meta(hq, hkv, d, d, dtype, None, new_kv)
        t = {n: PTR[dtype] for n in ("q_ptr", "k_ptr", "v_ptr", "new_k_ptr", "new_v_ptr", "out_ptr")}
        t.update({"loc_ptr": "*i64", "part_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32"})
        name = f"decode {dtype} {hq}/{hkv} d{d} new_kv={new_kv}"
        print(json.dumps({"kernel": name, **build(dec._decode_kernel, meta, t)}))
    for max_q, use_mask, new_kv in [(4096, False, False), (4096, True, False), (7, True, False), (4096, False, True)]:
        meta = ext.extend_kernel_meta(hq, hkv, d, d, dtype, max_q, use_mask, new_kv)
        t = {n: PTR[dtype] for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "new_k_ptr", "new_v_ptr")}
        t.update({"mask_ptr": "*i1", "loc_ptr": "*i64", "qk_scale": "fp32"})
        name = f"extend {dtype} {hq}/{hkv} d{d} q{max_q} mask={use_mask} new_kv={new_kv}"
        print(json.dumps({"kernel": name, **build(ext._extend_kernel, meta, t)}))

# The projection kernels under every tiling of every shipped table (the "1"
# band at one row, "many" at 32), bf16, chained by PDL as on a Hopper card.
from sgl_piecewise.ops.kernels import projection as proj
from sgl_piecewise.ops.kernels.tilings import TABLE_DIR, Tiling, rotary_head_dim
t = {n: "*bf16" for n in ("x_ptr", "nw_ptr", "w_ptr", "bias_ptr", "res_ptr", "out_ptr", "out2_ptr", "cs_ptr")}
t.update({"part_ptr": "*fp32", "pos_ptr": "*i64", "eps": "fp32"})
for table in sorted(TABLE_DIR.glob("*.json")):
    for key, bands in sorted(json.loads(table.read_text())["tilings"].items()):
        kind, n, k = key.split(":")
        for band, entry in sorted(bands.items()):
            if entry is None:
                continue
            tiling = Tiling(**entry)
            rows = 1 if band == "1" else 32
            if kind == "linear":
                fn, epilogue = proj._linear_kernel, dict(NORM=False, HAS_BIAS=False, RESIDUAL=True)
            else:
                head_dim = rotary_head_dim(kind)
                rotary = head_dim is not None
                fn = proj._paired_kernel
                epilogue = dict(HEAD_DIM=head_dim or 0, ROTATED_HEADS=2 if rotary else 0,
                                ROTARY=rotary, NORM=True, HAS_BIAS=False)
            meta = proj.kernel_meta(tiling, rows, int(k), tiling.split_k, torch.bfloat16, True, **epilogue)
            name = f"projection {table.stem} {key} rows {rows} {tiling}"
            print(json.dumps({"kernel": name, **build(fn, meta, t)}))
"""


def _have_nvidia_ptxas() -> bool:
    import os

    import triton

    root = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(root, tool)) for tool in ("ptxas", "cuobjdump"))


@pytest.mark.skipif(not _have_nvidia_ptxas(), reason="Triton's bundled ptxas/cuobjdump not found")
def test_kernels_compile_for_sm90_without_spills_or_smem_overflow():
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout[5:].strip())
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    # 5 shapes x (decode with and without the K/V write, 3 extend variants and
    # the one writing K/V), then the projection kernels' tilings
    assert len([r for r in rows if not r["kernel"].startswith("projection")]) == 5 * 6
    assert len([r for r in rows if r["kernel"].startswith("projection")]) >= 30
    # H100: 227 KiB of shared memory per block at most; any spill is a tile
    # choice to revisit.
    bad = [r for r in rows if r["spill"] > 0 or r["smem"] > 227 * 1024]
    assert not bad, bad
