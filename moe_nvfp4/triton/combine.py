"""The fixed-order combine in Triton: each token's (token, k) partial rows times their top-k weights, summed in k
order (deterministic, no atomics on data).  The sm_90 host (sm90.host) and the Blackwell host (cute/moe_host) both
launch it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layouts import next_pow2
from . import common
from .common import _TL_DTYPES, _after_previous_kernel, _routed
from .launcher import launch


@triton.jit
def _combine_kernel(
    partial_ptr,
    ids_ptr,
    weights_ptr,
    expert_map_ptr,
    out_ptr,
    hidden,
    num_global,
    num_experts,
    TOP_K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    HAS_MAP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = the sum over k of w[t, k] partial[t * TOP_K + k] (WEIGHTED; else of the rows alone), in k order, over
    the pairs routed somewhere (_routed): the GEMMs never wrote the rows of the others."""
    _after_previous_kernel(PDL)
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        _, routed = _routed(tl.load(ids_ptr + pair), True, expert_map_ptr, num_global, num_experts, HAS_MAP)
        row = partial_ptr + pair.to(tl.int64) * hidden
        value = tl.load(row + offs, mask=mask & routed, other=0.0).to(tl.float32)
        if WEIGHTED:
            value *= tl.load(weights_ptr + pair, mask=routed, other=0.0)  # a skipped pair's weight may be NaN
        acc += value
    tl.store(out_ptr + token.to(tl.int64) * hidden + offs, acc.to(DTYPE), mask=mask)


def combine(
    partial: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    num_experts: int,
    out: torch.Tensor,
    topk_weights: torch.Tensor | None = None,
) -> None:
    """out[t] = the fixed-order sum of topk_weights[t, k] * partial[t * top_k + k] over k (one launch; the rows
    alone where ``topk_weights`` is None: their GEMM weighted them, or the router weight scaled the input); pairs
    routed nowhere (an id or map entry out of range, routing.routed_pairs) are skipped: their rows were never
    written.  The sm_90 GEMM2 leaves the weighting here: in its epilogue the weights' loads, issued after the K
    loop, held each tile up (design 002 decision 9)."""
    t, hidden = out.shape
    ids = topk_ids.reshape(-1)
    # 512 columns a program (4 per thread): at decode, more programs for the few token rows (design 002 decision 9)
    block_h = min(512, next_pow2(hidden))
    launch(
        _combine_kernel,
        (t, -(-hidden // block_h)),
        partial,
        ids,
        ids if topk_weights is None else topk_weights.reshape(-1),  # by flat pair index; unread where None
        ids if expert_map is None else expert_map,
        out,
        hidden,
        num_experts if expert_map is None else expert_map.numel(),
        num_experts,
        TOP_K=topk_ids.shape[1],
        WEIGHTED=topk_weights is not None,
        HAS_MAP=expert_map is not None,
        BLOCK_H=block_h,
        DTYPE=_TL_DTYPES[out.dtype],
        num_warps=4,
        **common._dependent_launch(out.device),
    )
