"""Inputs for the activation-quantization tests (interpreter and GPU tiers share them)."""

from __future__ import annotations

import torch

import moe_nvfp4 as m

GLOBAL_SCALE = 2.0**-8  # a power of two: the exact-grid and tie rows below stay exact in every dtype


def hard_activations(rows: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows >= 8, k >= 48] activations over 2^-14..2^5 with the full code range, every rounding tie, zero and
    -0 blocks, subnormal and saturated block scales, and block scales that tie between two e4m3 values."""
    g = torch.Generator().manual_seed(seed)
    gs = torch.tensor(GLOBAL_SCALE)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-14, 6, (rows, 1), generator=g).float())
    full_range = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, -0.0])
    ties = torch.tensor([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5, -6])
    for r, s in ((0, 1.0), (1, 0.25), (2, 2.0**-9), (3, 448.0)):  # e4m3 block scales, the last two extreme
        x[r, :16] = full_range * s * gs
        x[r, 16:32] = ties * s * gs
    x[4] = 0.0  # zero blocks: scale 1.0, codes 0
    x[5, :16] = -0.0  # negative zeros: code 8
    x[6, :16] = torch.linspace(-1e4, 1e4, 16)  # past the calibrated range: scale 448, values saturate at 6
    # block scales exactly between two e4m3 values: 1.0625 -> 1.0, 1.1875 -> 1.25, 2.5 * 2^-9 -> 2^-8 (ties to even)
    for col, scale in ((0, 1.0625), (16, 1.1875), (32, 2.5 * 2.0**-9)):
        x[7, col : col + 16] = 0.0
        x[7, col] = 6 * scale * gs
    return x.to(dtype), gs


def compare_with_reference(x: torch.Tensor, gs: torch.Tensor, got: m.NVFP4Tensor) -> dict:
    """Byte mismatches of ``got`` against the CPU reference, and what the reference output covers."""
    ref = m.quantize_activations_nvfp4(x.cpu(), gs.cpu()).swizzled_scales()
    sb = ref.block_scale.view(torch.uint8)
    return dict(
        packed_mismatches=int((got.packed.cpu() != ref.packed).sum()),
        scale_mismatches=int((got.block_scale.cpu().view(torch.uint8) != sb).sum()),
        shapes=[list(got.packed.shape), list(got.block_scale.shape)],
        ref_shapes=[list(ref.packed.shape), list(ref.block_scale.shape)],
        layout=got.scale_layout.value,
        codes=torch.cat([ref.packed & 15, ref.packed >> 4]).unique().tolist(),
        subnormal_scales=int(((sb & 0x78) == 0).sum() - (sb == 0).sum()),  # exponent field 0, not the padding
        saturated_scales=int((sb == 0x7E).sum()),
        global_scale=float(got.global_scale),
    )


def assert_reference_bytes(result: dict) -> None:
    assert result["shapes"] == result["ref_shapes"] and result["layout"] == "swizzled_128x4", result
    assert result["packed_mismatches"] == 0 and result["scale_mismatches"] == 0, result
    assert result["codes"] == list(range(16)), result  # the inputs reached every code
    assert result["subnormal_scales"] > 0 and result["saturated_scales"] > 0, result
    assert result["global_scale"] == GLOBAL_SCALE
