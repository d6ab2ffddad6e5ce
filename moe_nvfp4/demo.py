"""`moe-nvfp4 demo`: a random Mixtral-like MoE layer, quantized to NVFP4, against its BF16 original."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .formats import quantize_nvfp4
from .reference import fused_moe_torch, moe_dense_torch
from .routing import topk_softmax


@dataclass(frozen=True)
class DemoShape:
    """Mixtral-8x7B's routing (8 experts, top-2) with hidden and intermediate sizes scaled down by 4."""

    experts: int = 8
    top_k: int = 2
    hidden: int = 1024
    intermediate: int = 3584
    tokens: int = 64


_NAME_WIDTH = 36


def _row(name: str, out: torch.Tensor, ref: torch.Tensor) -> str:
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()
    return f"| {name:<{_NAME_WIDTH}} | {rel:>10.4f} | {cos:>8.5f} |"


def run_demo(shape: DemoShape = DemoShape(), *, seed: int = 0, device: str = "cpu") -> str:
    gen = torch.Generator().manual_seed(seed)
    e, h, i, t = shape.experts, shape.hidden, shape.intermediate, shape.tokens
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(torch.bfloat16).to(device)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(torch.bfloat16).to(device)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16).to(device)
    logits = torch.randn(t, e, generator=gen).to(device)
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
        f"moe-nvfp4 demo: E={e} top-{shape.top_k} H={h} I={i} T={t} on {device} (random weights, seed {seed})",
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
