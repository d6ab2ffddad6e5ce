"""Host side of the sm_100a W4A4 grouped GEMM: plan once (outputs, pointer arrays, sizes, descriptor workspace),
then launch; the same split and argument list as ``triton/grouped_w4a4.py`` (``plan_grouped_w4a4`` /
``launch_grouped_w4a4``), so dispatch can pick either.

The kernel reads the operands where they are: packed FP4 [rows, K/2] (K-major) and the 128x4 blocked scales
exactly as ``layouts.swizzle_scales_128x4`` writes them; CuTe's scale layout for an operand (rows, K) is that
layout (``scale_layout`` in the kernel module, checked against ``layouts.swizzled_offset`` in the tests).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ..dispatch import sm_count
from ..formats import NVFP4Tensor, grouped_operands

from .grouped_w4a4_sm100 import TILE_M, GroupedW4A4Variant, compiled_kernel, kernel_arguments

__all__ = [
    "GroupedW4A4Sm100Plan",
    "plan_grouped_w4a4_sm100",
    "launch_grouped_w4a4_sm100",
    "num_ctas_for",
    "tile_walk",
    "plan_grouped_nvfp4_sm100",
    "grouped_gemm_nvfp4_sm100",
]

DESCRIPTOR_WORDS = 4 * 128 // 8  # four 128-byte TMA descriptors per CTA, as int64
_TMA_ALIGN = 16  # bytes: TMA global addresses and row strides


@dataclass(frozen=True)
class GroupedW4A4Sm100Plan:
    """Everything one launch needs; ``launch_grouped_w4a4_sm100(plan)`` then only launches the kernel (it can
    be captured in a CUDA graph and replayed after writing new values into the same input tensors)."""

    outs: list[torch.Tensor]
    inputs: tuple[list[torch.Tensor], ...]  # held so the memory the pointers name stays alive
    pointers: torch.Tensor  # int64 [G, 5]: A, B, A scales, B scales, out
    sizes: torch.Tensor  # int32 [G, 3]: M, N, K (the kernel reads them on the device)
    alpha: torch.Tensor  # float32 [G]
    descriptors: torch.Tensor  # int64 [num_ctas, 64]: each CTA's four TMA descriptors, rewritten per group
    template_addresses: tuple[int, int, int, int]  # A, B, A scales, B scales of the descriptor templates
    template_mnk: tuple[int, int, int]  # their extents (each >= 1)
    num_ctas: int
    variant: GroupedW4A4Variant


def plan_grouped_w4a4_sm100(
    operands: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
    alpha: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    tile_n: int = 128,
    num_ctas: int | None = None,
) -> GroupedW4A4Sm100Plan:
    """``operands`` = (A packed, A scales, B packed, B scales) per group, what ``plan_grouped_w4a4`` takes and
    ``GroupedW4A4Plan.inputs`` holds (checked by api.plan_grouped_gemm_nvfp4): packed uint8 [M_g, K_g/2] /
    [N_g, K_g/2], 128x4-swizzled e4m3 scales; alpha float32 [G] (already times both global scales); outputs
    out_dtype [M_g, N_g].  TMA needs K_g % 32 == 0 (16-byte rows) and 16-byte aligned tensors.  ``num_ctas``
    defaults to the SM count (the grid never depends on the problem sizes)."""
    a_packed, a_scales, b_packed, b_scales = operands
    variant = GroupedW4A4Variant(tile_n, out_dtype)
    device = a_packed[0].device
    for g, tensors in enumerate(zip(a_packed, b_packed, a_scales, b_scales)):
        k = tensors[0].shape[1] * 2
        if k % 32:
            raise ValueError(f"group {g}: K={k}; the sm_100 kernel needs K % 32 == 0 (TMA rows of 16-byte multiples)")
        for name, t in zip(("A", "B", "A scales", "B scales"), tensors):
            if t.data_ptr() % _TMA_ALIGN or not t.is_contiguous():
                raise ValueError(f"group {g}: {name} must be contiguous and {_TMA_ALIGN}-byte aligned for TMA")
    sizes = [(a.shape[0], b.shape[0], a.shape[1] * 2) for a, b in zip(a_packed, b_packed)]
    outs = [torch.empty(m, n, dtype=out_dtype, device=device) for m, n, _ in sizes]
    scales_a = [s.view(torch.uint8) for s in a_scales]
    scales_b = [s.view(torch.uint8) for s in b_scales]
    columns = (a_packed, b_packed, scales_a, scales_b, outs)
    pointers = torch.tensor([[t[g].data_ptr() for t in columns] for g in range(len(sizes))], dtype=torch.int64)
    if num_ctas is None:
        num_ctas = num_ctas_for(device)
    return GroupedW4A4Sm100Plan(
        outs=outs,
        inputs=(a_packed, a_scales, b_packed, b_scales),
        pointers=pointers.to(device),
        sizes=torch.tensor(sizes, dtype=torch.int32).reshape(-1, 3).to(device),
        alpha=alpha,
        descriptors=descriptor_workspace(num_ctas, device),
        # The host builds each descriptor once from a template the kernel rewrites before any load; the largest
        # tensors make templates with real, non-empty memory behind them.
        template_addresses=tuple(max(ts, key=torch.Tensor.numel).data_ptr() for ts in columns[:4]),
        template_mnk=tuple(max(1, max(s[i] for s in sizes)) for i in range(3)),
        num_ctas=num_ctas,
        variant=variant,
    )


def plan_grouped_nvfp4_sm100(
    a: Sequence[NVFP4Tensor], b: Sequence[NVFP4Tensor], *, alpha: torch.Tensor | None, out_dtype: torch.dtype
) -> GroupedW4A4Sm100Plan:
    """The cute backend's ``plan_grouped_gemm`` (inputs checked by the API)."""
    operands, scale = grouped_operands(a, b, alpha)
    return plan_grouped_w4a4_sm100(operands, scale, out_dtype)


def grouped_gemm_nvfp4_sm100(
    a: Sequence[NVFP4Tensor], b: Sequence[NVFP4Tensor], *, alpha: torch.Tensor | None, out_dtype: torch.dtype
) -> list[torch.Tensor]:
    """The cute backend's ``grouped_gemm``: plan, then one launch."""
    return launch_grouped_w4a4_sm100(plan_grouped_nvfp4_sm100(a, b, alpha=alpha, out_dtype=out_dtype))


def descriptor_workspace(num_ctas: int, device: torch.device) -> torch.Tensor:
    """Each CTA's four 128-byte TMA descriptors; left uninitialised, as the kernel writes them before use."""
    return torch.empty(num_ctas, DESCRIPTOR_WORDS, dtype=torch.int64, device=device)


def num_ctas_for(device: torch.device) -> int:
    """The persistent grid: one CTA per SM (1 off the GPU, where plans are only inspected)."""
    return sm_count(device, off_gpu=1)


def launch_grouped_w4a4_sm100(plan: GroupedW4A4Sm100Plan) -> list[torch.Tensor]:
    """One persistent launch on the current stream (no allocation, no host-to-device copy); returns plan.outs."""
    arrays = (plan.pointers, plan.sizes, plan.alpha, plan.descriptors)
    addresses = (*plan.template_addresses, *(t.data_ptr() for t in arrays))
    stream = torch.cuda.current_stream(plan.outs[0].device).cuda_stream
    arguments = kernel_arguments(addresses, plan.template_mnk, plan.sizes.shape[0], plan.num_ctas, stream)
    compiled_kernel(plan.variant)(*arguments)
    return plan.outs


def tile_walk(
    sizes: list[tuple[int, int, int]], tile_n: int, cta: int, num_ctas: int
) -> Iterator[tuple[int, int, int]]:
    """The tiles CTA ``cta`` computes, in order, as (group, tile row, tile column): the host twin of the
    kernel's walk (``_w4a4_sm100_tensors.find_group``): tiles of all groups concatenated, row-major within a
    group, tile t to CTA t mod num_ctas."""
    group, first, tile = 0, 0, cta
    while group < len(sizes):
        m, n, _ = sizes[group]
        tiles_n = -(-n // tile_n)
        count = -(-m // TILE_M) * tiles_n
        if tile < first + count:
            yield group, (tile - first) // tiles_n, (tile - first) % tiles_n
            tile += num_ctas
        else:
            first += count
            group += 1
