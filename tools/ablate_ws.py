"""Where the warp-specialized GEMM's time goes: the same forward with parts of moe_sm90_ws taken out.

    python tools/ablate_ws.py --out benchmarks/results        # ablate_ws.json and ablate_ws.md
    python tools/ablate_ws.py --cases mixtral-8x7b:16 --ablations full,no_decode

Each ablation edits the kernel's source (every edit must apply, or the run stops), loads it as a module of
its own and runs the shipped config of each case with it.  Its outputs are wrong where it takes work out
(``rel_err`` says by how much); only the times mean something:

* ``full``: the kernel as shipped.
* ``no_decode``: the MMA warps convert each FP4 byte to one 16-bit value (one instruction) instead of the
  decode PTX, so the scale bytes are never read.
* ``no_mma``: the decode runs, and an xor of each operand register into a sink stands in for the wgmma.
* ``loads_only``: both: the MMA warps read the stage's bytes from shared memory and free it.
* ``no_fence``: without the proxy fence after each stage's wait (correct here only by timing luck).
* ``stages_only``: the MMA warps only wait for each stage and free it (no shared-memory read, decode or MMA):
  the loader's rate.  ``loads_only`` still reads every stage, converts each byte and folds the result per tile.

Per case: the forward by CUDA-graph replay (median of three ``do_bench_cudagraph``) and each kernel's
device time with programmatic dependent launch off (torch profiler, 20 forwards), in launch order.  One copy
of the weights, not rotated as in bench_moe.py: a small layer's (Qwen3 at T=1: 21 MB) may be read from L2.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tools")]  # tools/README.md: imports

KERNEL_SOURCE = ROOT / "moe_nvfp4" / "triton" / "moe_sm90_ws.py"
# relative imports made absolute, so an edited copy loads from anywhere
_IMPORTS = [("from ..configs import", "from moe_nvfp4.configs import"),
            ("from ..layouts import", "from moe_nvfp4.layouts import"),
            ("from .sm90_common import", "from moe_nvfp4.triton.sm90_common import")]  # fmt: skip
_DECODE = ("    lo, hi = _decode_words(p, s8, DTYPE)\n",
           "    lo = p.to(gl.int16).to(DTYPE, bitcast=True)\n    hi = lo\n")  # fmt: skip
# the wgmma replaced by an xor of each operand register into a sink the tile then stores where it equals a value
# it cannot hold (ptxas would delete a decode whose result nobody reads)
_MMA = ("""                if h == 0:
                    acc = warpgroup_mma(a, b, acc, is_async=True)
                else:
                    acc_up = warpgroup_mma(a, b, acc_up, is_async=True)
""", """                bits = a.to(gl.int16, bitcast=True)
                sink = gl.inline_asm_elementwise("xor.b32 $0, $1, $2;", "=r,r,r", [sink, bits], dtype=gl.int16,
                                                 is_pure=True, pack=2)
""")  # fmt: skip
_SINK = [("    acc_up = gl.zeros([BLOCK_N, WIDTH], gl.float32, MMA_L)\n",
          "    acc_up = gl.zeros([BLOCK_N, WIDTH], gl.float32, MMA_L)\n"
          "    sink = gl.zeros([BLOCK_N, 128], gl.int16, DOT_L)\n"),
         ("    if GROUP > 0:  # hand this group's sums to group 0\n",
          "    folded = gl.max(gl.max(sink.to(gl.int32), axis=1), axis=0)\n"
          "    gl.store(out_ptr, folded.to(out_ptr.dtype.element_ty), mask=folded == 1 << 20)\n"
          "    if GROUP > 0:  # hand this group's sums to group 0\n")]  # fmt: skip
# the stage's reads, decode and MMAs all taken out (a loop over no chunks): the MMA warps wait for each stage and
# free it, and the epilogue stores zero sums, so the GEMM runs at its loader's rate
_STAGES = ("        for c in gl.static_range(CHUNKS):\n            b = a_smem",
           "        for c in gl.static_range(0):\n            b = a_smem")  # fmt: skip
_FENCE = ("        fence_async_shared()  # the token rows", "        # fence_async_shared()  # the token rows")
ABLATIONS: dict[str, list[tuple[str, str]]] = {
    "full": [],
    "no_decode": [_DECODE],
    "no_mma": [_MMA, *_SINK],
    "loads_only": [_DECODE, _MMA, *_SINK],
    "no_fence": [_FENCE],
    "stages_only": [_STAGES],
}
CASES = ("mixtral-8x7b:1", "mixtral-8x7b:16", "mixtral-8x7b:64", "qwen3-30b-a3b:1", "qwen3-30b-a3b:16")


def ablated_source(name: str) -> str:
    """moe_sm90_ws's source with ablation ``name``'s edits (each must match exactly once)."""
    src = KERNEL_SOURCE.read_text()
    for old, new in _IMPORTS + ABLATIONS[name]:
        if src.count(old) != 1:
            raise RuntimeError(f"ablation {name!r}: the kernel source no longer has {old.strip()[:60]!r} once")
        src = src.replace(old, new)
    return src


def module_from_source(src: str, directory: Path, name: str):
    """``src`` as module ``name`` (Gluon reads a kernel's source from its file, so it is written out first)."""
    path = directory / f"{name}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_ablation(name: str, directory: Path):
    """The ablated source as a module."""
    return module_from_source(ablated_source(name), directory, f"moe_sm90_ws_{name}")


def run_case(model: str, tokens: int, kernels: dict, layers: dict) -> list[dict]:
    import torch
    from triton.testing import do_bench_cudagraph

    from moe_nvfp4.configs import LayerShape, device_traits, select_config
    from moe_nvfp4.triton import moe_sm90, moe_sm90_ws
    from profile_moe import kernel_times
    from tune_moe import MODELS, packed_layer, seeded_inputs

    e, k, h, i = MODELS[model]
    if model not in layers:
        layers[model] = packed_layer(model)
    weights = layers[model]
    x, tw, ti = seeded_inputs(model, tokens)
    cfg = select_config(tokens, LayerShape(e, k, h, i, x.dtype), device_traits(x.device))
    shipped = moe_sm90_ws._moe_gemm_ws_kernel
    rows, ref = [], None
    try:
        for name, kernel in kernels.items():
            moe_sm90_ws._moe_gemm_ws_kernel = kernel  # what launch_gemm_ws launches

            def forward():
                return moe_sm90.fused_moe_sm90(x, *weights, tw, ti, None, i, cfg)

            out = forward().float()
            ref = out if ref is None else ref
            rel_err = ((out - ref).norm() / ref.norm()).item()
            forward_us = sorted(1e3 * do_bench_cudagraph(forward, rep=50) for _ in range(3))[1]
            kernel_us = [list(launch) for launch in kernel_times(forward)]  # each kernel's time its own (PDL off)
            rows.append(dict(model=model, tokens=tokens, ablation=name, rel_err=rel_err, forward_us=forward_us,
                             kernel_us=kernel_us, config=cfg.to_dict()))  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    finally:
        moe_sm90_ws._moe_gemm_ws_kernel = shipped
    return rows


def report(rows: list[dict], meta: dict, out: Path) -> None:
    """ablate_ws.json (meta + rows) and ablate_ws.md (one line per case and ablation) in ``out``."""
    from harness import markdown_table, write_json, write_markdown

    write_json(str(out / "ablate_ws.json"), meta, rows)
    def kernels(row: dict) -> str:
        return " · ".join(f"{name.strip('_').removesuffix('_kernel')} {us:.1f}" for name, us in row["kernel_us"])

    lines = [dict(r, kernels=kernels(r)) for r in rows]
    table = markdown_table(lines, [("model", "model", ""), ("tokens", "T", "d"), ("ablation", "ablation", ""),
                                   ("forward_us", "forward µs", ".1f"),
                                   ("kernels", "per kernel, µs, launch order (PDL off)", "")])  # fmt: skip
    write_markdown(str(out / "ablate_ws.md"), "Warp-specialized GEMM ablations",
                   [f"device: {meta.get('device')}, torch {meta.get('torch')}, triton {meta.get('triton')}",
                    f"command: `{meta.get('command')}`", f"date: {meta.get('date')}"], table)  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(CASES), help="model:tokens, comma separated")
    p.add_argument("--ablations", default=",".join(ABLATIONS), help=f"from {', '.join(ABLATIONS)}")
    p.add_argument("--out", type=Path, default=None, help="directory for ablate_ws.json and ablate_ws.md")
    args = p.parse_args()
    from harness import environment

    with tempfile.TemporaryDirectory() as tmp:
        kernels = {name: load_ablation(name, Path(tmp))._moe_gemm_ws_kernel for name in args.ablations.split(",")}
        layers: dict = {}
        rows = [row for case in args.cases.split(",") for row in run_case(*_case(case), kernels, layers)]
    if args.out:
        report(rows, environment(), args.out)
    return 0


def _case(text: str) -> tuple[str, int]:
    model, tokens = text.split(":")
    return model, int(tokens)


if __name__ == "__main__":
    raise SystemExit(main())
