"""Groups for the W4A4 grouped-GEMM tests (interpreter and GPU tiers share them)."""

from __future__ import annotations

import torch

import moe_nvfp4 as m


def exact_operand(rows: int, k: int, global_scale: float, g: torch.Generator, swizzled: bool) -> m.NVFP4Tensor:
    """Random codes over all 16, block scales in {0.5, 1, 2}, a power-of-two global scale: every product and
    every K-sum of products (K <= 512) is exact in float32, so any summation order gives the same result."""
    codes = torch.randint(0, 16, (rows, k), generator=g, dtype=torch.uint8)
    scales = (2.0 ** torch.randint(-1, 2, (rows, k // 16), generator=g).float()).to(torch.float8_e4m3fn)
    t = m.NVFP4Tensor(m.formats.pack_fp4(codes), scales, torch.tensor(global_scale))
    return t.swizzled_scales() if swizzled else t


def exact_groups(sizes: list[tuple[int, int, int]], seed: int) -> tuple[list, list, torch.Tensor]:
    """(A groups, B groups, alpha) for (M, N, K) per group; layouts alternate between swizzled and linear."""
    g = torch.Generator().manual_seed(seed)
    a = [exact_operand(mm, k, 2.0**-4, g, swizzled=i % 2 == 0) for i, (mm, _, k) in enumerate(sizes)]
    b = [exact_operand(n, k, 2.0**-3, g, swizzled=i % 3 != 1) for i, (_, n, k) in enumerate(sizes)]
    alpha = 2.0 ** torch.arange(len(sizes), dtype=torch.float32).remainder(3).neg()  # 1, 1/2, 1/4, 1, ...
    return a, b, alpha


def random_groups(sizes: list[tuple[int, int, int]], seed: int) -> tuple[list, list]:
    """Quantized random normal data with the default (amax-based) global scales: sums round in float32."""
    g = torch.Generator().manual_seed(seed)
    a = [m.quantize_nvfp4(torch.randn(mm, k, generator=g)) for mm, _, k in sizes]
    b = [m.quantize_nvfp4(torch.randn(n, k, generator=g)) for _, n, k in sizes]
    return a, b
