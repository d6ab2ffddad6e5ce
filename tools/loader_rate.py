"""How fast the warp-specialized GEMMs stream their weights: one GEMM's time per kernel (plain launches,
profile_moe.kernel_times) with the stages alone (ablate_ws's ``stages_only``: the ring's TMA boxes and token rows
arrive and the MMA warps free each stage unread) and in full, over ring shapes, against a plain read of 2 GiB on
the same GPU (harness.measure_read_bandwidth: the read ceiling).

    python tools/loader_rate.py --cases mixtral-8x7b:1,mixtral-8x7b:16 \\
        --variants shipped,gemm1:num_stages=3,gemm1:chunks_per_stage=2/num_stages=4 --out benchmarks/results/archive/loader

A variant is ``shipped`` (the tuned config) or ab_moe's ``gemm1:field=value[/...]`` (or ``gemm2:``), applied to
the tuned config; the GEMM it names is the one timed (``shipped``: each of --gemms).  Rates count the touched experts'
weight and block-scale bytes of that GEMM (MoEShape's NVFP4 bytes), once.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tools")]  # tools/README.md: imports

from ab_moe import gemm_variant  # noqa: E402
from harness import nvfp4_matrix_bytes  # noqa: E402

# ablate_ws's kernels timed, with their column labels
KERNEL_LABELS = {"stages_only": "stages alone", "full": "full"}


def gemm_bytes(gemm: str, touched_experts: int, hidden: int, inter: int) -> int:
    """NVFP4 bytes GEMM1 (gate and up, [2I, H], two global scales) or GEMM2 ([H, I]) reads for the touched experts."""
    if gemm == "gemm1":
        return touched_experts * nvfp4_matrix_bytes(2 * inter, hidden, global_scales=2)
    return touched_experts * nvfp4_matrix_bytes(hidden, inter)


def timed_gemms(variant: str, shipped_gemms: list[str]) -> list[str]:
    """The GEMM a variant changes (``shipped``: each of ``shipped_gemms``)."""
    return [variant.split(":", 1)[0]] if variant.startswith(("gemm1:", "gemm2:")) else shipped_gemms


def run_case(model: str, tokens: int, variants: list[str], shipped_gemms: list[str], kernels: dict,
             read_bps: float) -> list[dict]:
    import torch

    from moe_nvfp4.configs import LayerShape, device_traits, select_config
    from moe_nvfp4.layouts import FragmentLayout
    from moe_nvfp4.triton import moe_sm90, moe_sm90_ws
    from profile_moe import kernel_times
    from tune_moe import MODELS, packed_layer, seeded_inputs

    e, k, h, i = MODELS[model]
    weights = packed_layer(model)
    x, tw, ti = seeded_inputs(model, tokens)
    shipped_cfg = select_config(tokens, LayerShape(e, k, h, i, x.dtype), device_traits(x.device))
    touched = len(torch.unique(ti))
    padded = FragmentLayout().padded_k
    shipped_kernel = moe_sm90_ws._moe_gemm_ws_kernel
    rows = []
    for variant, gemm in [(v, g) for v in variants for g in timed_gemms(v, shipped_gemms)]:
        cfg = shipped_cfg if variant == "shipped" else gemm_variant(shipped_cfg, variant)
        if not cfg.is_valid(padded(h), padded(i)) or not getattr(cfg, gemm).warp_specialized:
            print(f"{model}:{tokens} {variant}: not a valid warp-specialized {gemm} here, skipped", flush=True)
            continue
        nbytes = gemm_bytes(gemm, touched, h, i)
        row = dict(model=model, tokens=tokens, variant=variant, gemm=gemm, bytes=nbytes, config=cfg.to_dict())
        try:
            for name, kernel in kernels.items():
                moe_sm90_ws._moe_gemm_ws_kernel = kernel  # what launch_gemm_ws launches

                def forward():
                    return moe_sm90.fused_moe_sm90(x, *weights, tw, ti, None, i, cfg)

                gemms = [us for n, us in kernel_times(forward) if "moe_gemm" in n]
                us = gemms[0 if gemm == "gemm1" else 1]
                row[name] = dict(us=us, tb_per_s=nbytes / us / 1e6, pct_of_read=100 * nbytes / (us * 1e-6) / read_bps)
        finally:
            moe_sm90_ws._moe_gemm_ws_kernel = shipped_kernel
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="mixtral-8x7b:1,mixtral-8x7b:16", help="model:tokens, comma separated")
    p.add_argument("--variants", default="shipped", help="shipped or gemm1:/gemm2: field changes, comma separated")
    p.add_argument("--gemms", default="gemm1,gemm2", help="the GEMMs `shipped` times, comma separated")
    p.add_argument("--out", type=Path, default=None, help="directory for loader_rate.json and loader_rate.md")
    args = p.parse_args()

    from ablate_ws import load_ablation
    from harness import environment, markdown_table, measure_read_bandwidth, write_json, write_markdown

    read_bps, read_detail = measure_read_bandwidth()
    print(f"read ceiling {read_bps / 1e12:.2f} TB/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {name: load_ablation(name, Path(tmp))._moe_gemm_ws_kernel for name in KERNEL_LABELS}
        rows = []
        for case in args.cases.split(","):
            model, tokens = case.split(":")
            rows += run_case(model, int(tokens), args.variants.split(","), args.gemms.split(","), kernels, read_bps)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = dict(environment(), read_bytes_per_s=read_bps, read_detail=read_detail)
        write_json(str(args.out / "loader_rate.json"), meta, rows)
        lines = [dict(r, **{f"{k}_{f}": r[k][f] for k in KERNEL_LABELS for f in ("us", "pct_of_read")}) for r in rows]
        columns = [("model", "model", ""), ("tokens", "T", "d"), ("variant", "variant", ""), ("gemm", "GEMM", "")]
        for k, label in KERNEL_LABELS.items():
            columns += [(f"{k}_us", f"{label} µs", ".1f"), (f"{k}_pct_of_read", "% of read", ".0f")]
        table = markdown_table(lines, columns)
        write_markdown(str(args.out / "loader_rate.md"), "Weight streaming rate of the Gluon GEMMs",
                       [f"device: {meta.get('device')}, torch {meta.get('torch')}, triton {meta.get('triton')}",
                        f"read ceiling (sum over 2 GiB): {read_bps / 1e12:.2f} TB/s",
                        f"command: `{meta.get('command')}`", f"date: {meta.get('date')}"], table)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
