"""`moe-nvfp4 demo`: one MoE layer with random weights in NVFP4.

On an sm_90 GPU it runs the fused kernel on a real model's layer shape (the zoo's, or ``--shape``), checks it against
the torch reference on the same NVFP4 weights and times it against the BF16 paths and the HBM floor, through the
bench's own code (``moe_nvfp4.bench.moe.run_model``).  On a CPU it runs the torch reference (no kernel) and shows
what NVFP4 costs in accuracy against the BF16 layer.
"""

from __future__ import annotations

import importlib.util
import time

import torch

from .bench.harness import MoEShape, format_value, measure_ceilings
from .formats import quantize_nvfp4
from .reference import fused_moe_torch, moe_dense_torch
from .routing import topk_softmax

__all__ = ["CPU_SHAPE", "run_reference_demo", "run_kernel_demo"]

# Mixtral-8x7B's routing (8 experts, top-2) with hidden and intermediate sizes scaled down by 4: a float64
# reference over a full-size layer takes minutes on a CPU.
CPU_SHAPE = MoEShape("Mixtral-8x7B scaled down by 4", experts=8, top_k=2, hidden=1024, intermediate=3584)
_NAME_WIDTH = 36


def _row(name: str, out: torch.Tensor, ref: torch.Tensor) -> str:
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()
    return f"| {name:<{_NAME_WIDTH}} | {rel:>10.4f} | {cos:>8.5f} |"


def run_reference_demo(shape: MoEShape = CPU_SHAPE, *, tokens: int = 64, seed: int = 0) -> str:
    """The CPU demo: NVFP4 W4A16 through the torch reference against the BF16 layer in float64."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i, t = shape.experts, shape.hidden, shape.intermediate, tokens
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(torch.bfloat16)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    logits = torch.randn(t, e, generator=gen)
    weights, ids = topk_softmax(logits, shape.top_k, renormalize=True)

    start = time.perf_counter()
    q13 = quantize_nvfp4(w13, segments=2)  # gate and up keep their own global scales
    q2 = quantize_nvfp4(w2)
    quant_s = time.perf_counter() - start

    ref = moe_dense_torch(x, w13, w2, weights, ids, compute_dtype=torch.float64)
    start = time.perf_counter()
    out = fused_moe_torch(x, q13, q2, weights, ids)
    ref_s = time.perf_counter() - start
    bf16_bytes = (w13.numel() + w2.numel()) * 2
    fp4_bytes = q13.nbytes() + q2.nbytes()
    lines = [
        f"moe-nvfp4 demo on the CPU: ran the torch reference (moe_nvfp4.fused_moe_torch), not the fused kernel, "
        "which needs an sm_90 GPU",
        f"{shape.name}: E={e} top-{shape.top_k} H={h} I={i} T={t} (random weights, seed {seed})",
        "",
        f"| {'output vs BF16 MoE (float64)':<{_NAME_WIDTH}} | rel. error | cosine   |",
        f"|{'-' * (_NAME_WIDTH + 2)}|------------|----------|",
        _row("NVFP4 W4A16, reference forward", out, ref),
        _row("NVFP4 W4A16, output rounded to bf16", out.to(torch.bfloat16), ref),
        "",
        f"expert weights: BF16 {bf16_bytes / 2**20:.1f} MiB -> NVFP4 {fp4_bytes / 2**20:.1f} MiB "
        f"({bf16_bytes / fp4_bytes:.2f}x smaller, {100 * (1 - fp4_bytes / bf16_bytes):.1f}% saved)",
        f"quantize {quant_s * 1e3:.0f} ms, reference forward {ref_s * 1e3:.0f} ms",
    ]
    return "\n".join(lines)


# The demo's rows: path, its label, whether vLLM provides it.
_PATHS = (
    ("ours", "ours: fused NVFP4 kernel (W4A16)", False),
    ("torch", "torch BF16 (per-expert loop)", False),
    ("bf16", "vLLM Triton BF16 (fused_experts)", True),
    ("marlin", "vLLM Marlin NVFP4", True),
)


def run_kernel_demo(key: str, shape: MoEShape, *, tokens: int = 64, seed: int = 0) -> tuple[str, bool]:
    """The GPU demo on zoo shape ``key`` (or a --shape key): the bench's rows for one token count, told briefly.
    Returns (text, whether the kernel ran and agreed with the reference)."""
    from .bench import moe as bench

    bench.quiet_vllm()
    has_vllm = importlib.util.find_spec("vllm") is not None
    paths = [name for name, _, vllm in _PATHS if has_vllm or not vllm]
    args = bench.finish_args(
        bench.build_parser().parse_args(
            [
                "--models" if not key[0].isdigit() else "--shape",
                key,
                "--tokens",
                str(tokens),
                "--paths",
                ",".join(paths),
                "--quick",
                "--seed",
                str(seed),
            ]
        )
    )
    ceilings = measure_ceilings(quick=True)
    props = torch.cuda.get_device_properties(0)
    row = bench.run_model(key, shape, [tokens], args, ceilings, props.L2_cache_size, float("inf"), log=lambda _: None)[
        0
    ]
    err, ours = row.get("rel_err_ours_vs_ref"), row.get("ours_us")
    ok = ours is not None and err is not None and err <= args.tol
    table = [
        (
            label,
            format_value(row.get(f"{name}_us")),
            "" if name == "ours" else format_value(row.get(f"speedup_vs_{name}"), ".2f") + "x",
        )
        for name, label, _ in _PATHS
        if name in paths
    ]
    floor = f"HBM floor ({row['touched_experts']} experts' NVFP4 weights once)"
    table.append((floor, f"{row['hbm_floor_us']:.1f}", ""))
    width = max(len(label) for label, _, _ in table)
    lines = [
        f"moe-nvfp4 demo on {props.name} (sm_{props.major}{props.minor}): the fused kernel on {shape.name}'s MoE layer,"
        f" E={shape.experts} top-{shape.top_k} H={shape.hidden} I={shape.intermediate}, T={tokens} "
        f"(random weights, seed {seed})",
        f"kernel vs torch reference (same NVFP4 weights, float32): ||out-ref||/||ref|| = "
        + (f"{err:.1e} ({'ok' if ok else 'MISMATCH'}: bound {args.tol:.0e})" if err is not None else "not computed"),
        "",
        f"| {'path':<{width}} | µs/forward | ours faster |",
        f"|{'-' * (width + 2)}|-----------:|------------:|",
        *(f"| {label:<{width}} | {us:>10} | {speedup:>11} |" for label, us, speedup in table),
        "",
        f"ours at {format_value(row.get('pct_of_floor'), '.0f')}% of the floor's speed (the larger of the HBM floor, at "
        f"the measured {ceilings.copy_bytes_per_s / 1e9:.0f} GB/s, and the bf16 compute floor); times: CUDA graph "
        "replay (the torch loop eager), weights rotated so L2 holds none between calls",
    ]
    if not has_vllm:
        lines.append("vLLM is not installed: its Triton BF16 and Marlin NVFP4 paths are left out")
    if row.get("notes"):
        lines.append("notes: " + "; ".join(row["notes"]))
    lines.append(f"more token counts and paths: moe-nvfp4 bench {'--shape' if key[0].isdigit() else '--model'} {key}")
    return "\n".join(lines), ok
