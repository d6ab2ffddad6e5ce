"""The W4A4 NVFP4 grouped GEMM's public entry points (``api`` re-exports them): one call
(``grouped_gemm_nvfp4``), or a plan made once and launched many times (``plan_grouped_gemm_nvfp4``,
``launch_grouped_gemm_nvfp4``: capturable in a CUDA graph), on the device's ``grouped_gemm`` backend, with the
operands checked before any launch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .dispatch import select_backends
from .formats import NVFP4, NVFP4Tensor, ScaleLayout
from .layouts import padded_scale_shape

if TYPE_CHECKING:
    from .cute.host import GroupedW4A4Sm100Plan
    from .triton.grouped_w4a4 import GroupedW4A4Plan

__all__ = ["grouped_gemm_nvfp4", "launch_grouped_gemm_nvfp4", "plan_grouped_gemm_nvfp4"]


def grouped_gemm_nvfp4(
    a: Sequence[NVFP4Tensor],
    b: Sequence[NVFP4Tensor],
    *,
    alpha: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> list[torch.Tensor]:
    """W4A4 NVFP4 grouped GEMM: per group g, ``alpha[g] * A_g @ B_g^T`` -> out_dtype [M_g, N_g], where A_g
    [M_g, K_g] and B_g [N_g, K_g] are NVFP4 (packed e2m1, e4m3 block scales in either layout, one global
    scale each) and alpha float32 [G] is optional.  The semantics of ``reference.grouped_gemm_nvfp4_torch``.

    One persistent launch over all groups, by device (``dispatch.select_backends``): Hopper and other CUDA GPUs run
    the Triton kernel (both operands decoded in registers, exact; fp32 accumulation); sm_100/sm_103 run the
    CuTe DSL kernel (block-scaled tcgen05 MMA; compiled and checked, not yet run on hardware); CPU runs the
    reference.  Each call plans on the host (pointer arrays, group sizes); to capture the launch in a CUDA
    graph, plan once with ``plan_grouped_gemm_nvfp4`` and launch the plan.
    """
    _check_grouped(a, b, alpha, out_dtype)
    return select_backends(a[0].packed.device).grouped_gemm.entry("grouped_gemm")(
        a, b, alpha=alpha, out_dtype=out_dtype
    )


def plan_grouped_gemm_nvfp4(
    a: Sequence[NVFP4Tensor],
    b: Sequence[NVFP4Tensor],
    *,
    alpha: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> GroupedW4A4Plan | GroupedW4A4Sm100Plan:
    """Checked inputs -> a plan for ``launch_grouped_gemm_nvfp4`` (CUDA; the backend's plan type): outputs
    allocated, operands with swizzled scales held, pointer arrays and group sizes on the device.  Launching
    the plan allocates and copies nothing, so it can be captured in a CUDA graph."""
    _check_grouped(a, b, alpha, out_dtype)
    planner = select_backends(a[0].packed.device).grouped_gemm.entry("plan_grouped_gemm")
    return planner(a, b, alpha=alpha, out_dtype=out_dtype)


def launch_grouped_gemm_nvfp4(plan: GroupedW4A4Plan | GroupedW4A4Sm100Plan) -> list[torch.Tensor]:
    """Run a plan: one kernel launch, no allocation or copy (capturable); returns the plan's outputs."""
    from .cute.host import GroupedW4A4Sm100Plan, launch_grouped_w4a4_sm100  # no cutlass import until a launch

    if isinstance(plan, GroupedW4A4Sm100Plan):
        return launch_grouped_w4a4_sm100(plan)
    from .triton.grouped_w4a4 import launch_grouped_w4a4

    return launch_grouped_w4a4(plan)


def _check_grouped(
    a: Sequence[NVFP4Tensor], b: Sequence[NVFP4Tensor], alpha: torch.Tensor | None, out_dtype: torch.dtype
) -> None:
    if not a or len(a) != len(b):
        raise ValueError(f"need one B per A and at least one group, got {len(a)} A and {len(b)} B groups")
    if out_dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"out_dtype must be float16 or bfloat16, got {out_dtype}")
    device = a[0].packed.device
    for g, (ag, bg) in enumerate(zip(a, b)):
        for name, t in (("A", ag), ("B", bg)):
            if t.packed.dim() != 2 or t.packed.dtype != torch.uint8:
                raise ValueError(
                    f"group {g}: {name} must be one packed uint8 [rows, K/2] matrix, got "
                    f"{t.packed.dtype} {tuple(t.packed.shape)}"
                )
            if t.block_scale.dtype != NVFP4.scale_dtype:  # a float32 / bf16 / uint8 view would be read as e4m3 bytes
                raise TypeError(
                    f"group {g}: {name}.block_scale must be {NVFP4.scale_dtype} (e4m3 block scales), got "
                    f"{t.block_scale.dtype}"
                )
            if t.global_scale.numel() != 1:
                raise ValueError(f"group {g}: {name} needs one global scale, got shape {tuple(t.global_scale.shape)}")
            if {t.packed.device, t.block_scale.device, t.global_scale.device} != {device}:
                raise ValueError(f"group {g}: {name} is not entirely on {device}")
        if ag.k != bg.k or ag.k % NVFP4.block_size:
            raise ValueError(f"group {g}: A has K={ag.k}, B has K={bg.k}; they must agree and be multiples of 16")
        for name, t in (("A", ag), ("B", bg)):  # a smaller scale tensor would leave rows scaled by its padding
            rows, cols = t.n, t.k // NVFP4.block_size
            want = (rows, cols) if t.scale_layout is ScaleLayout.LINEAR else padded_scale_shape(rows, cols)
            if tuple(t.block_scale.shape) != want:
                raise ValueError(
                    f"group {g}: {name}.block_scale ({t.scale_layout.value}) must be {want} for a "
                    f"[{rows}, {t.k}] operand, got {tuple(t.block_scale.shape)}"
                )
    if alpha is not None and (alpha.shape != (len(a),) or alpha.dtype != torch.float32 or alpha.device != device):
        raise ValueError(
            f"alpha must be float32 [{len(a)}] on {device}, got {alpha.dtype} {tuple(alpha.shape)} on {alpha.device}"
        )
    _check_grouped_scale_values(a, b)


def _check_grouped_scale_values(a: Sequence[NVFP4Tensor], b: Sequence[NVFP4Tensor]) -> None:
    """Global scales finite and positive, block scales neither NaN nor negative (the Triton kernel reads their
    magnitude bits only: NaN as 480, -s as s).  Values, so one host synchronisation; both entries that call this
    plan on the host anyway (a plan's launch, the graph-capturable part, checks nothing)."""
    operands = [(g, name, t) for g, pair in enumerate(zip(a, b)) for name, t in zip("AB", pair)]

    def bad(t: NVFP4Tensor) -> torch.Tensor:
        gs = t.global_scale.float()
        scale_bits = t.linear_scales().block_scale.view(torch.uint8)  # real scales only, not the swizzle padding
        bad_block = ((scale_bits & 0x7F) == 0x7F) | (scale_bits > 0x80)  # NaN, or negative and non-zero
        return torch.stack(((~torch.isfinite(gs) | (gs <= 0)).any(), bad_block.any()))

    flags = torch.stack([bad(t) for _, _, t in operands]).cpu()
    if bool(flags.any()):
        i, what = (int(v) for v in flags.nonzero()[0])
        g, name, t = operands[i]
        if what == 0:
            raise ValueError(
                f"group {g}: {name}.global_scale must be finite and positive, got "
                f"{t.global_scale.float().reshape(-1).tolist()}"
            )
        raise ValueError(f"group {g}: {name}.block_scale holds NaN or negative e4m3 scales")
