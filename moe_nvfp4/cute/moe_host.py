"""Host side of the sm_100a W4A4 fused MoE (weights in ``weight_layouts.Sm100Layout``): per forward the padded token-sorted
row map, the per-expert pointer/size arrays (device tensors: no host synchronisation, CUDA-graph safe), and
``fused_moe_w4a4_sm100``, the Hopper path's ``fused_moe_sm90`` with input scales and this kernel.

Rows: the routing of ``triton/routing_kernels.route`` with block_m = TILE_M numbers each expert's tiles
consecutively, so padded row ``128 * tile + i`` is sorted pair ``tile_row[tile] + i`` (or padding), and
expert e's rows start at ``128 * (its first tile)``: the padded offsets are multiples of 128 by construction.
The number of padded rows is ``128 * max_tiles(T * top_k, E, 128)``, fixed by the shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from ..formats import NVFP4Tensor
from ..triton.launcher import launch
from ..weight_layouts import padded_intermediate
from .grouped_w4a4_sm100 import TILE_M, GroupedW4A4Variant
from .host import GroupedW4A4Sm100Plan, descriptor_workspace, launch_grouped_w4a4_sm100, num_ctas_for
from .moe_w4a4_sm100 import MoeDownVariant, MoeGateUpVariant

if TYPE_CHECKING:
    from ..weights import MoEWeights

__all__ = ["PaddedRows", "padded_rows", "expert_pointers", "fused_moe_w4a4_sm100"]


@dataclass(frozen=True)
class PaddedRows:
    """The padded token-sorted rows of one forward (all fixed-size device tensors).

    row_pairs:      int32 [R] pair index t * top_k + k of each padded row, -1 for padding rows.
    row_weights:    float32 [R] the pair's top-k weight (0 for padding).
    padded_offsets: int64 [E] first padded row of each expert (a multiple of 128).
    counts:         int32 [E] pairs per expert (the kernels' M per group).
    """

    row_pairs: torch.Tensor
    row_weights: torch.Tensor
    padded_offsets: torch.Tensor
    counts: torch.Tensor


def padded_rows(
    sorted_pairs: torch.Tensor,
    counts: torch.Tensor,
    offsets: torch.Tensor,
    tile_expert: torch.Tensor,
    tile_row: torch.Tensor,
    topk_weights: torch.Tensor,
) -> PaddedRows:
    """Routing metadata for block_m = TILE_M (``routing_kernels.route`` or ``routing.plan_routing``) -> PaddedRows.
    Vectorised torch on the routing's device: no host synchronisation."""
    rows = torch.arange(tile_expert.numel() * TILE_M, device=tile_expert.device)
    tile = rows // TILE_M
    expert = tile_expert.long()[tile]
    sorted_index = tile_row.long()[tile] + rows % TILE_M
    valid = (expert >= 0) & (sorted_index < offsets.long()[expert.clamp(min=0) + 1])
    # With an expert map the routing writes only the local pairs: entries past them hold whatever memory was
    # there, so a padding row's pair is replaced before it indexes anything.
    pair = torch.where(valid, sorted_pairs.long()[sorted_index.clamp(max=sorted_pairs.numel() - 1)], 0)
    row_pairs = torch.where(valid, pair, -1)
    tiles = (counts.long() + TILE_M - 1) // TILE_M
    return PaddedRows(
        row_pairs=row_pairs.to(torch.int32),
        row_weights=torch.where(valid, topk_weights.reshape(-1).float()[pair], 0.0),
        padded_offsets=TILE_M * (torch.cumsum(tiles, 0) - tiles),
        counts=counts.to(torch.int32),
    )


def expert_pointers(columns: list[tuple[torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """int64 [E, len(columns)]: per column (tensor, index [E] or None), the address of ``tensor[index[e]]``
    (its first dimension's stride; None: the tensor's base for every expert)."""
    index = next(i for _, i in columns if i is not None)
    return torch.stack(
        [
            t.data_ptr() + (torch.zeros_like(index) if i is None else i.long() * t.stride(0) * t.element_size())
            for t, i in columns
        ],
        1,
    )


def _gemm_plan(
    variant: GroupedW4A4Variant,
    a: NVFP4Tensor,
    b_packed: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
    rows: PaddedRows,
    alpha: torch.Tensor,
    pair_columns: tuple[torch.Tensor, ...],
    num_ctas: int,
) -> GroupedW4A4Sm100Plan:
    """One MoE GEMM as a list-form plan: group e = expert e, A at its padded offset, B its stacked slice.
    GEMM1 writes per expert at the padded offset; GEMM2 (``pair_columns`` = row pairs, row weights) writes
    rows by pair index into one buffer."""
    experts = torch.arange(b_packed.shape[0], device=out.device)
    offsets = rows.padded_offsets
    out_index = None if pair_columns else offsets
    columns = [(a.packed, offsets), (b_packed, experts), (a.block_scale, offsets), (b_scale, experts), (out, out_index)]
    columns += [(t, offsets) for t in pair_columns]
    k = a.k
    sizes = torch.stack(
        (rows.counts, torch.full_like(rows.counts, b_packed.shape[1]), torch.full_like(rows.counts, k)), 1
    )
    return GroupedW4A4Sm100Plan(
        outs=[out],
        inputs=([a.packed, a.block_scale, b_packed, b_scale, *pair_columns],),
        pointers=expert_pointers(columns),
        sizes=sizes.to(torch.int32).contiguous(),
        alpha=alpha.float().contiguous(),
        descriptors=descriptor_workspace(num_ctas, out.device),
        template_addresses=(a.packed.data_ptr(), b_packed.data_ptr(), a.block_scale.data_ptr(), b_scale.data_ptr()),
        template_mnk=(a.packed.shape[0], b_packed.shape[1], k),
        num_ctas=num_ctas,
        variant=variant,
    )


@triton.jit
def _gather_rows_kernel(x_ptr, stride_x, row_pairs_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[row] = x[row_pairs[row] // TOP_K], zeros for padding rows (row_pairs = -1)."""
    row = tl.program_id(0)
    pair = tl.load(row_pairs_ptr + row)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = cols < hidden
    token = tl.maximum(pair, 0) // TOP_K
    values = tl.load(x_ptr + token.to(tl.int64) * stride_x + cols, mask=inside & (pair >= 0), other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * hidden + cols, values, mask=inside)


def gather_rows(x: torch.Tensor, row_pairs: torch.Tensor, top_k: int) -> torch.Tensor:
    """x [T, H] -> [R, H] in padded token-sorted order (one Triton launch)."""
    hidden = x.shape[1]
    out = torch.empty(row_pairs.numel(), hidden, dtype=x.dtype, device=x.device)
    block_h = min(1024, triton.next_power_of_2(hidden))
    launch(
        _gather_rows_kernel,
        (row_pairs.numel(), triton.cdiv(hidden, block_h)),
        x,
        x.stride(0),
        row_pairs,
        out,
        hidden,
        TOP_K=top_k,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return out


def fused_moe_w4a4_sm100(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    input_scales: tuple[torch.Tensor, torch.Tensor],
    tile_n: int = 128,
) -> torch.Tensor:
    """W4A4 fused MoE on sm_100a -> [T, H] in x's dtype (inputs checked by ``api.fused_moe_w4a4``): the Hopper
    path's routing and combine around two block-scaled GEMMs.  ``input_scales`` (GEMM1's, GEMM2's: one float32
    value each, ModelOpt's ``input_scale``) quantize the activations entering each GEMM, as ``reference.moe_dense_torch(..., w13_input_scale=,
    w2_input_scale=)``.  Launches: routing, gather, quantize, GEMM1 (SiLU * up), quantize, GEMM2 (top-k
    weight, one row per pair), combine (fixed order); no host synchronisation."""
    from ..activations import quantize_activations
    from ..triton.combine import combine
    from ..triton.routing_kernels import route

    w13_input_scale, w2_input_scale = input_scales
    t, hidden = x.shape
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if t == 0:
        return out
    experts = weights.num_experts
    sorted_pairs, counts, offsets, tile_expert, tile_row, *_ = route(topk_ids, experts, TILE_M, expert_map)
    rows = padded_rows(sorted_pairs, counts, offsets, tile_expert, tile_row, topk_weights)
    num_ctas = num_ctas_for(x.device)

    a1 = quantize_activations(gather_rows(x, rows.row_pairs, top_k), w13_input_scale)
    # Rows past each expert's pairs stay unwritten: they only feed padding rows of GEMM2, which are masked.
    act = torch.empty(rows.row_pairs.numel(), padded_intermediate(weights.intermediate), dtype=x.dtype, device=x.device)
    alpha1 = weights.w13_global * w13_input_scale.reshape(())
    launch_grouped_w4a4_sm100(
        _gemm_plan(
            MoeGateUpVariant(tile_n, x.dtype),
            a1,
            weights.w13_packed,
            weights.w13_scale,
            act,
            rows,
            alpha1,
            (),
            num_ctas,
        )
    )

    a2 = quantize_activations(act, w2_input_scale)
    partial = torch.empty(t * top_k, hidden, dtype=torch.float32, device=x.device)  # [pair, H]
    alpha2 = (weights.w2_global * w2_input_scale.reshape(()))[:, None]
    launch_grouped_w4a4_sm100(
        _gemm_plan(
            MoeDownVariant(tile_n),
            a2,
            weights.w2_packed,
            weights.w2_scale,
            partial,
            rows,
            alpha2,
            (rows.row_pairs, rows.row_weights),
            num_ctas,
        )
    )
    combine(partial, topk_ids, expert_map, experts, out)
    return out
