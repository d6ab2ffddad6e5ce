"""Routing: top-k selection and grouping of (token, k) pairs by expert into fixed-size metadata.

Every output has a size fixed by (T, top_k, E, block_m), never by the routing decisions, so a kernel
grid built from it is the same on every call and the whole forward can be captured in a CUDA graph.
Plain torch here (CPU and GPU, no host synchronisation); the GPU kernels consume the same RoutingPlan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "RoutingPlan",
    "batched_max_tiles",
    "max_tiles",
    "plan_batched_routing",
    "plan_routing",
    "routed_pairs",
    "topk_softmax",
    "topk_sigmoid_grouped",
]


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, then top-k (Mixtral renormalizes, Qwen3-MoE by config).

    Returns (weights float32 [T, top_k], ids int32 [T, top_k]).
    """
    if not 1 <= top_k <= router_logits.shape[-1]:
        raise ValueError(f"top_k={top_k} must be in [1, {router_logits.shape[-1]}]")
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def topk_sigmoid_grouped(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    correction_bias: torch.Tensor | None = None,
    num_groups: int = 1,
    topk_groups: int = 1,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: sigmoid scores, the bias only for choosing, best groups first, then top-k.

    A group's score is the sum of its two best biased scores; experts outside the ``topk_groups`` best
    groups are excluded.  Weights are the unbiased sigmoid scores of the chosen experts, renormalized
    and multiplied by ``scaling_factor``.
    """
    t, e = router_logits.shape
    if e % num_groups:
        raise ValueError(f"{e} experts do not split into {num_groups} groups")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"topk_groups={topk_groups} must be in [1, {num_groups}]")
    if not 1 <= top_k <= (e // num_groups) * topk_groups:
        raise ValueError(f"top_k={top_k} exceeds the experts of {topk_groups} groups")
    scores = torch.sigmoid(router_logits.float())
    choice = scores if correction_bias is None else scores + correction_bias.float()
    grouped = choice.view(t, num_groups, e // num_groups)
    group_score = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(dim=-1)
    best_groups = group_score.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best_groups, True)
    masked = choice.masked_fill(~keep.repeat_interleave(e // num_groups, dim=1), float("-inf"))
    ids = masked.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scaling_factor, ids.to(torch.int32)


def routed_pairs(
    topk_ids: torch.Tensor, num_experts: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The meaning of routing data every path shares (kernels, plan_routing, the reference): flat pair p goes to
    local expert ``local[p]`` where ``routed[p]``; otherwise it contributes nothing.  A pair is routed when its id
    lies in [0, E_global) (E_global: the map's length, else ``num_experts``) and, with an expert map, its entry in
    [0, num_experts): vLLM's -1 for experts of other ranks, and any corrupt id or entry, selects no weights.
    Returns (local int64 [P], 0 where not routed; routed bool [P]); no host synchronisation."""
    ids = topk_ids.reshape(-1).long()
    n_global = num_experts if expert_map is None else expert_map.numel()
    routed = (ids >= 0) & (ids < n_global)
    local = torch.where(routed, ids, 0)
    if expert_map is not None:
        local = expert_map.to(device=ids.device, dtype=torch.long)[local]
        routed &= (local >= 0) & (local < num_experts)
    return torch.where(routed, local, 0), routed


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e ceil(count_e / block_m) over all routings of ``num_pairs`` pairs."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


@dataclass(frozen=True)
class RoutingPlan:
    """Pairs grouped by local expert, with a tile map for one block size. All tensors int32, fixed size.

    sorted_pairs:   [P] flat pair indices ``t * top_k + j`` in expert order; pairs routed nowhere
                    (``routed_pairs``) come last, after ``expert_offsets[E]``.
    expert_counts:  [E] pairs per local expert.
    expert_offsets: [E + 1] start of each expert's run in ``sorted_pairs``.
    tile_expert:    [max_tiles] local expert of each tile of ``block_m`` rows, -1 past ``num_tiles``.
    tile_row_start: [max_tiles] index into ``sorted_pairs`` where the tile's rows begin.
    tile_row_end:   [max_tiles] where they end (the tile's last row + 1: block_m rows on, or its expert's end),
                    0 past ``num_tiles``.  A kernel starting a tile reads its expert and rows side by side,
                    with no load that waits for another (the expert's end would wait for the expert).
    num_tiles:      [1] tiles in use.
    """

    sorted_pairs: torch.Tensor
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor
    tile_expert: torch.Tensor
    tile_row_start: torch.Tensor
    tile_row_end: torch.Tensor
    num_tiles: torch.Tensor
    block_m: int
    top_k: int


def plan_routing(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    *,
    expert_map: torch.Tensor | None = None,
) -> RoutingPlan:
    """Group the (token, k) pairs of ``topk_ids`` [T, top_k] by local expert.

    expert_map: int32 [E_global], global expert id -> local id on this rank or -1 (expert parallelism);
    ``num_experts`` is then the number of local experts.  Pairs that ``routed_pairs`` rejects (an id or a
    map entry out of range) belong to no expert and contribute nothing.
    """
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, top_k], got shape {tuple(topk_ids.shape)}")
    if block_m < 1 or num_experts < 1:
        raise ValueError(f"block_m and num_experts must be positive, got {block_m} and {num_experts}")
    device = topk_ids.device
    top_k = topk_ids.shape[1]
    num_pairs = topk_ids.numel()
    local, routed = routed_pairs(topk_ids, num_experts, expert_map)
    key = torch.where(routed, local, torch.full_like(local, num_experts))
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    sorted_pairs = torch.sort(key, stable=True).indices
    offsets = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    offsets[1:] = torch.cumsum(counts, 0)

    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, 0)
    n_max = max_tiles(num_pairs, num_experts, block_m)
    tile = torch.arange(n_max, device=device)
    expert = torch.searchsorted(tile_end, tile, right=True).clamp(max=num_experts - 1)
    first_tile = tile_end[expert] - tiles_per_expert[expert]
    in_use = tile < tile_end[-1]
    row_start = offsets[expert] + (tile - first_tile) * block_m
    row_end = torch.minimum(row_start + block_m, offsets[expert + 1])
    i32 = torch.int32
    return RoutingPlan(
        sorted_pairs=sorted_pairs.to(i32),
        expert_counts=counts.to(i32),
        expert_offsets=offsets.to(i32),
        tile_expert=torch.where(in_use, expert, -1).to(i32),
        tile_row_start=torch.where(in_use, row_start, 0).to(i32),
        tile_row_end=torch.where(in_use, row_end, 0).to(i32),
        num_tiles=tile_end[-1:].to(i32),
        block_m=block_m,
        top_k=top_k,
    )


def batched_max_tiles(num_experts: int, max_tokens: int, block_m: int) -> int:
    """Upper bound on the tiles of a batched layout: every expert's ``max_tokens`` rows full."""
    return num_experts * -(-max_tokens // block_m)


def plan_batched_routing(expert_num_tokens: torch.Tensor, max_tokens: int, block_m: int) -> RoutingPlan:
    """The plan of vLLM's batched activation format: x [E, max_tokens, H] holds expert e's tokens in rows
    e * max_tokens .. e * max_tokens + count_e of its flat view, each row one (token, expert) pair of its own.

    So a row is its own pair (``sorted_pairs`` = 0 .. E * max_tokens - 1, top_k 1): GEMM1 reads flat row r of x and
    GEMM2 writes flat row r of the [E * max_tokens, H] output, which is the batched output; rows past an expert's
    count are in no tile.  ``expert_offsets[e]`` = e * max_tokens (the last one E * max_tokens).  Counts are clamped
    to [0, max_tokens] (a corrupt count costs rows of its own expert, never memory safety), as the kernel does; no
    host synchronisation.
    """
    if expert_num_tokens.dim() != 1 or expert_num_tokens.numel() < 1:
        raise ValueError(f"expert_num_tokens must be [E] with E >= 1, got shape {tuple(expert_num_tokens.shape)}")
    if block_m < 1 or max_tokens < 0:
        raise ValueError(f"block_m must be positive and max_tokens >= 0, got {block_m} and {max_tokens}")
    device = expert_num_tokens.device
    num_experts = expert_num_tokens.numel()
    counts = expert_num_tokens.long().clamp(0, max_tokens)
    starts = torch.arange(num_experts + 1, device=device) * max_tokens
    tiles_per_expert = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles_per_expert, 0)
    tile = torch.arange(batched_max_tiles(num_experts, max_tokens, block_m), device=device)
    expert = torch.searchsorted(tile_end, tile, right=True).clamp(max=num_experts - 1)
    in_use = tile < tile_end[-1]
    row_start = starts[expert] + (tile - (tile_end[expert] - tiles_per_expert[expert])) * block_m
    row_end = torch.minimum(row_start + block_m, starts[expert] + counts[expert])
    i32 = torch.int32
    return RoutingPlan(
        sorted_pairs=torch.arange(num_experts * max_tokens, device=device, dtype=i32),
        expert_counts=counts.to(i32),
        expert_offsets=starts.to(i32),
        tile_expert=torch.where(in_use, expert, -1).to(i32),
        tile_row_start=torch.where(in_use, row_start, 0).to(i32),
        tile_row_end=torch.where(in_use, row_end, 0).to(i32),
        num_tiles=tile_end[-1:].to(i32),
        block_m=block_m,
        top_k=1,
    )
