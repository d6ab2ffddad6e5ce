"""Routing: top-k selection against loop implementations, and plan_routing invariants.

The RoutingPlan is checked exactly (it is integer metadata): every valid pair once, experts in order,
counts/offsets consistent, tiles covering each expert's rows exactly, fixed-size tile arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_nvfp4.routing import RoutingPlan, max_tiles, plan_routing, routed_pairs, topk_sigmoid_grouped, topk_softmax

# Tolerance bounds of this file.
TOL = {
    # Router weights: float32 softmax / sigmoid against float64 loops.
    "weights_rtol": 1e-5,
    "weights_atol": 1e-7,
    # Expert ids and every RoutingPlan field: exact.
    "ids": 0,
    "plan": 0,
}


def assert_weights_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.double(), want, rtol=TOL["weights_rtol"], atol=TOL["weights_atol"])


# ----------------------------------------------------------------------------------------------------
# top-k


def softmax_topk_loop(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = [], []
    for row in logits.double().tolist():
        m = max(row)
        exps = [math.exp(v - m) for v in row]
        total = sum(exps)
        probs = [v / total for v in exps]
        order = sorted(range(len(row)), key=lambda e: -probs[e])[:k]
        w = [probs[e] for e in order]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights.append(w)
        ids.append(order)
    weights_t = torch.tensor(weights, dtype=torch.float64).reshape(-1, k)
    return weights_t, torch.tensor(ids, dtype=torch.int32).reshape(-1, k)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("experts, top_k", [(8, 2), (7, 1), (60, 4), (128, 8), (3, 3)])
def test_topk_softmax_against_loop(gen, experts, top_k, renormalize):
    logits = torch.randn(33, experts, generator=gen) * 3
    weights, ids = topk_softmax(logits, top_k, renormalize=renormalize)
    want_w, want_ids = softmax_topk_loop(logits, top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, want_ids)
    assert_weights_close(weights, want_w)
    if renormalize:
        assert_weights_close(weights.sum(-1), torch.ones(33, dtype=torch.float64))


def test_topk_softmax_bad_k():
    for k in (0, 9):
        with pytest.raises(ValueError, match="top_k"):
            topk_softmax(torch.randn(4, 8), k)


def sigmoid_grouped_loop(logits, top_k, bias, num_groups, topk_groups, renormalize, scaling):
    weights, ids = [], []
    e = logits.shape[1]
    size = e // num_groups
    for t, row in enumerate(logits.double().tolist()):
        scores = [1.0 / (1.0 + math.exp(-v)) for v in row]
        choice = [s + (bias[i] if bias is not None else 0.0) for i, s in enumerate(scores)]
        group_scores = []
        for g in range(num_groups):
            members = sorted((choice[i] for i in range(g * size, (g + 1) * size)), reverse=True)
            group_scores.append(sum(members[:2]))
        groups = sorted(range(num_groups), key=lambda g: -group_scores[g])[:topk_groups]
        candidates = [i for g in groups for i in range(g * size, (g + 1) * size)]
        chosen = sorted(candidates, key=lambda i: -choice[i])[:top_k]
        w = [scores[i] for i in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights.append([v * scaling for v in w])
        ids.append(chosen)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids, dtype=torch.int32)


SIGMOID_CASES = {
    "deepseek_v3": dict(experts=256, top_k=8, num_groups=8, topk_groups=4, bias=True, renormalize=True, scaling=2.5),
    "one_group": dict(experts=60, top_k=4, num_groups=1, topk_groups=1, bias=True, renormalize=True, scaling=1.0),
    "odd_experts": dict(experts=7, top_k=2, num_groups=1, topk_groups=1, bias=False, renormalize=False, scaling=1.0),
    "groups_of_one": dict(experts=6, top_k=2, num_groups=6, topk_groups=3, bias=True, renormalize=True, scaling=1.0),
    "no_renormalize": dict(experts=16, top_k=3, num_groups=4, topk_groups=2, bias=True, renormalize=False, scaling=1.5),
}


@pytest.mark.parametrize("case", SIGMOID_CASES.values(), ids=SIGMOID_CASES.keys())
def test_topk_sigmoid_grouped_against_loop(gen, case):
    logits = torch.randn(19, case["experts"], generator=gen) * 2
    bias = torch.randn(case["experts"], generator=gen) * 0.5 if case["bias"] else None
    kw = dict(num_groups=case["num_groups"], topk_groups=case["topk_groups"], renormalize=case["renormalize"])
    weights, ids = topk_sigmoid_grouped(
        logits, case["top_k"], correction_bias=bias, scaling_factor=case["scaling"], **kw
    )
    want_w, want_ids = sigmoid_grouped_loop(
        logits,
        case["top_k"],
        None if bias is None else bias.tolist(),
        case["num_groups"],
        case["topk_groups"],
        case["renormalize"],
        case["scaling"],
    )
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, want_ids)
    assert_weights_close(weights, want_w)


def test_sigmoid_bias_chooses_but_does_not_weigh():
    logits = torch.tensor([[4.0, 3.0, -3.0, 2.0]])
    bias = torch.tensor([0.0, 0.0, 10.0, 0.0])
    weights, ids = topk_sigmoid_grouped(logits, 2, correction_bias=bias, renormalize=False)
    assert ids.tolist() == [[2, 0]]
    assert_weights_close(weights, torch.sigmoid(torch.tensor([[-3.0, 4.0]], dtype=torch.float64)))


def test_sigmoid_grouped_bad_arguments():
    logits = torch.randn(2, 12)
    with pytest.raises(ValueError, match="groups"):
        topk_sigmoid_grouped(logits, 2, num_groups=5)
    with pytest.raises(ValueError, match="topk_groups"):
        topk_sigmoid_grouped(logits, 2, num_groups=4, topk_groups=5)
    with pytest.raises(ValueError, match="top_k"):
        topk_sigmoid_grouped(logits, 7, num_groups=4, topk_groups=2)


# ----------------------------------------------------------------------------------------------------
# plan_routing


def check_plan(plan: RoutingPlan, topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map=None) -> None:
    """Every documented invariant, checked with Python lists."""
    t, k = topk_ids.shape
    p = t * k
    for name in (
        "sorted_pairs",
        "expert_counts",
        "expert_offsets",
        "tile_expert",
        "tile_row_start",
        "tile_row_end",
        "num_tiles",
    ):
        assert getattr(plan, name).dtype == torch.int32, name
    assert (plan.block_m, plan.top_k) == (block_m, k)
    flat = topk_ids.reshape(-1).tolist()
    emap = None if expert_map is None else expert_map.tolist()
    local = [e if emap is None else emap[e] for e in flat]

    sorted_pairs = plan.sorted_pairs.tolist()
    counts = plan.expert_counts.tolist()
    offsets = plan.expert_offsets.tolist()
    assert len(sorted_pairs) == p and sorted(sorted_pairs) == list(range(p))  # every pair exactly once
    assert len(counts) == num_experts and len(offsets) == num_experts + 1
    assert counts == [local.count(e) for e in range(num_experts)]
    assert offsets[0] == 0 and all(offsets[e + 1] == offsets[e] + counts[e] for e in range(num_experts))
    valid = sum(1 for e in local if e >= 0)
    assert offsets[-1] == valid
    experts_in_order = [local[i] for i in sorted_pairs[:valid]]
    assert experts_in_order == sorted(experts_in_order)  # experts in order
    for e in range(num_experts):
        assert all(local[i] == e for i in sorted_pairs[offsets[e] : offsets[e + 1]])
    assert all(local[i] < 0 for i in sorted_pairs[valid:])  # other ranks' pairs last

    n_max = max_tiles(p, num_experts, block_m)
    assert plan.tile_expert.shape == plan.tile_row_start.shape == plan.tile_row_end.shape == (n_max,)
    assert plan.num_tiles.shape == (1,)
    num_tiles = plan.num_tiles.item()
    assert num_tiles == sum(-(-c // block_m) for c in counts) <= n_max
    tile_expert = plan.tile_expert.tolist()
    tile_start = plan.tile_row_start.tolist()
    tile_end = plan.tile_row_end.tolist()
    assert all(e == -1 for e in tile_expert[num_tiles:])
    assert all(s == 0 for s in tile_start[num_tiles:]) and all(r == 0 for r in tile_end[num_tiles:])
    used = tile_expert[:num_tiles]
    assert used == sorted(used) and all(0 <= e < num_experts for e in used)
    for e in range(num_experts):
        starts = [s for te, s in zip(used, tile_start) if te == e]
        assert starts == list(range(offsets[e], offsets[e + 1], block_m))  # block_m rows each, last partial
        ends = [r for te, r in zip(used, tile_end) if te == e]
        assert ends == [min(s + block_m, offsets[e + 1]) for s in starts]
        rows = [r for s, end in zip(starts, ends) for r in range(s, end)]
        assert rows == list(range(offsets[e], offsets[e + 1]))  # covers the expert's rows exactly


@dataclass(frozen=True)
class Case:
    why: str
    tokens: int
    experts: int
    top_k: int
    block_m: int
    skew: str = "uniform"  # uniform | one_expert | half_empty
    global_experts: int = 0  # > 0: expert map from this many global experts, some -1


CASES = [
    Case("no tokens", 0, 8, 2, 16),
    Case("no tokens with an expert map", 0, 4, 2, 16, global_experts=8),
    Case("all tokens to one expert", 50, 8, 1, 16, skew="one_expert"),
    Case("all tokens to one expert, top-k 2", 37, 8, 2, 8, skew="one_expert"),
    Case("experts with none", 40, 16, 2, 4, skew="half_empty"),
    Case("E not a power of two", 29, 7, 2, 4),
    Case("E = 60 (Qwen1.5-MoE)", 64, 60, 4, 16),
    Case("top-k 1", 31, 8, 1, 16),
    Case("top-k 8 of 128", 23, 128, 8, 64),
    Case("block_m 1: one row per tile", 9, 5, 2, 1),
    Case("block_m larger than all pairs", 3, 4, 2, 128),
    Case("exact multiples of block_m", 32, 4, 1, 8),
    Case("expert map with -1 entries", 30, 4, 2, 8, global_experts=10),
    Case("expert map, E=60 over 3 ranks", 40, 20, 4, 16, global_experts=60),
]


def make_ids(gen: torch.Generator, case: Case) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(topk_ids [T, k] of global experts, expert map or None, number of experts the ids index)."""
    n_ids = case.global_experts or case.experts
    if case.skew == "one_expert" and case.top_k == 1:
        ids = torch.full((case.tokens, 1), 3 % n_ids, dtype=torch.int32)
    else:
        pool = n_ids
        if case.skew == "half_empty":
            pool = n_ids // 2
        elif case.skew == "one_expert":
            pool = case.top_k
        ids = torch.rand(case.tokens, pool, generator=gen).argsort(-1)[:, : case.top_k].to(torch.int32)
        if case.skew == "half_empty":
            ids = ids * 2  # even experts only
    emap = None
    if case.global_experts:
        emap = torch.full((case.global_experts,), -1, dtype=torch.int32)
        owned = torch.randperm(case.global_experts, generator=gen)[: case.experts]
        emap[owned] = torch.randperm(case.experts, generator=gen).to(torch.int32)
    return ids, emap, n_ids


@pytest.mark.parametrize("case", CASES, ids=[c.why for c in CASES])
def test_plan_routing_cases(gen, case):
    ids, emap, _ = make_ids(gen, case)
    plan = plan_routing(ids, case.experts, case.block_m, expert_map=emap)
    check_plan(plan, ids, case.experts, case.block_m, emap)
    if case.skew == "half_empty":
        assert plan.expert_counts[1::2].eq(0).all() and plan.expert_counts[0::2].gt(0).any()


def test_tile_arrays_do_not_depend_on_routing(gen):
    t, k, e, bm = 40, 2, 8, 16
    spread = torch.rand(t, e, generator=gen).argsort(-1)[:, :k].to(torch.int32)
    packed = torch.zeros(t, k, dtype=torch.int32)
    packed[:, 1] = 1
    plans = [plan_routing(ids, e, bm) for ids in (spread, packed)]
    for name in (
        "sorted_pairs",
        "expert_counts",
        "expert_offsets",
        "tile_expert",
        "tile_row_start",
        "tile_row_end",
        "num_tiles",
    ):
        assert getattr(plans[0], name).shape == getattr(plans[1], name).shape, name
    assert plans[0].tile_expert.shape == (max_tiles(t * k, e, bm),)


def test_max_tiles_bounds_worst_cases():
    assert max_tiles(0, 8, 16) == 0
    # One pair per expert: every expert opens a partial tile.
    ids = torch.arange(8, dtype=torch.int32).reshape(8, 1)
    assert plan_routing(ids, 8, 16).num_tiles.item() == 8 <= max_tiles(8, 8, 16)
    # 17 pairs per expert with block_m 16: two tiles each, one of them a single row.
    ids = torch.arange(8, dtype=torch.int32).repeat_interleave(17).reshape(-1, 1)
    assert plan_routing(ids, 8, 16).num_tiles.item() == 16 <= max_tiles(136, 8, 16)


def test_plan_routing_bad_arguments():
    with pytest.raises(ValueError, match="topk_ids"):
        plan_routing(torch.zeros(4, dtype=torch.int32), 4, 16)
    with pytest.raises(ValueError, match="positive"):
        plan_routing(torch.zeros(4, 2, dtype=torch.int32), 4, 0)
    with pytest.raises(ValueError, match="positive"):
        plan_routing(torch.zeros(4, 2, dtype=torch.int32), 0, 16)


@settings(max_examples=80)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(0, 48),
    experts=st.integers(1, 70),
    top_k=st.sampled_from([1, 2, 4, 8]),
    block_m=st.sampled_from([1, 3, 16, 64, 128]),
    skew=st.sampled_from(["uniform", "one_expert", "half_empty"]),
    ranks=st.sampled_from([0, 2, 3]),
)
def test_plan_routing_invariants_hold_for_any_routing(seed, tokens, experts, top_k, block_m, skew, ranks):
    top_k = min(top_k, experts)
    if skew == "half_empty" and experts < 2 * top_k:
        skew = "uniform"
    local = max(1, experts // ranks) if ranks else experts
    case = Case("hypothesis", tokens, local, top_k, block_m, skew, global_experts=experts if ranks else 0)
    ids, emap, _ = make_ids(torch.Generator().manual_seed(seed), case)
    plan = plan_routing(ids, local, block_m, expert_map=emap)
    check_plan(plan, ids, local, block_m, emap)


@pytest.mark.parametrize("with_map", [False, True])
def test_out_of_range_ids_and_map_entries_route_nowhere(with_map: bool, gen: torch.Generator) -> None:
    """routed_pairs' meaning, checked against a loop: an id outside [0, E_global) or a map entry outside [0, E)
    (vLLM's -1, or corrupt) routes its pair nowhere; the plan counts and tiles only the routed pairs, exactly, and
    lists the others last (no index is ever taken through an out-of-range value)."""
    e, k, t, block_m = 5, 3, 40, 8
    n_global = 8 if with_map else e
    emap = torch.tensor([-1, 0, 1, 2, 3, 4, 7, -5], dtype=torch.int32) if with_map else None
    poison = torch.tensor([-1, n_global, 1000, -(2**31), 2**31 - 1], dtype=torch.int32)
    ids = torch.randint(0, n_global, (t, k), generator=gen, dtype=torch.int32)
    bad = torch.rand(t, k, generator=gen) < 0.3
    ids = torch.where(bad, poison[torch.randint(0, len(poison), (t, k), generator=gen)], ids)
    want: list[int | None] = []
    for i in ids.reshape(-1).tolist():
        local = i if 0 <= i < n_global else None
        if local is not None and emap is not None:
            local = emap.tolist()[local]
        want.append(local if local is not None and 0 <= local < e else None)
    local, routed = routed_pairs(ids, e, emap)
    assert routed.tolist() == [w is not None for w in want]
    assert local.tolist() == [0 if w is None else w for w in want]
    plan = plan_routing(ids, e, block_m, expert_map=emap)
    counts = [sum(w == x for w in want) for x in range(e)]
    assert plan.expert_counts.tolist() == counts
    assert plan.num_tiles.item() == sum(-(-c // block_m) for c in counts)
    n_routed = sum(counts)
    for x in range(e):
        run = plan.sorted_pairs[plan.expert_offsets[x] : plan.expert_offsets[x + 1]].tolist()
        assert sorted(run) == [p for p, w in enumerate(want) if w == x]
    assert sorted(plan.sorted_pairs[n_routed:].tolist()) == [p for p, w in enumerate(want) if w is None]
