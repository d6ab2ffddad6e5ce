"""benchmarks/tune_moe.py's candidate grid and its sampling (CPU; the timing itself needs a GPU)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from tune_moe import (  # noqa: E402
    DEFAULT_MODELS,
    GROUP_RINGS,
    MODELS,
    SWEEP_SHAPES,
    WS_K_GROUPS,
    WS_RESIDENCY,
    WS_RINGS,
    _spaced,
    candidates,
    climb_start,
    gemm_sweep,
    group_sweep,
    loader_sweep,
    merge_entries,
    neighbors,
    rotated_weights,
    search,
    spread,
    ws_sweep,
)

from moe_nvfp4.shapes import LayerShape  # noqa: E402
from moe_nvfp4.sm90.configs import WS_SMEM_LIMIT, GemmConfig, MoEKernelConfig
from moe_nvfp4.sm90.default_config import default_config
from moe_nvfp4.zoo import random_models


def triton_start(tokens: int, e: int, k: int, h: int, i: int) -> MoEKernelConfig:
    """The default's token tile (16 tokens at least) and tile rows with both GEMMs on the Triton kernel: the start
    the sweeps below are checked from (the default itself runs the Gluon kernel at decode)."""
    d = default_config(tokens, e, k, h, i)
    gemm = lambda g: GemmConfig(g.block_n, num_warps=4 if g.block_n == 64 else g.num_warps, num_stages=3)  # noqa: E731
    return MoEKernelConfig(max(d.block_m, 16), gemm(d.gemm1), gemm(d.gemm2))


def test_the_tuner_takes_its_shapes_from_the_zoo() -> None:
    assert MODELS["mixtral-8x7b"] == (8, 2, 4096, 14336) and MODELS["qwen3-30b-a3b"] == (128, 8, 2048, 768)
    assert "kimi-k2-tp8" in MODELS and "kimi-k2-ep8" not in MODELS  # no expert maps in the tuner
    assert "nemotron-3-nano" not in MODELS  # gated layers only (its experts are ReLU^2)
    assert set(DEFAULT_MODELS) <= set(MODELS)


@pytest.mark.parametrize("model", DEFAULT_MODELS)
@pytest.mark.parametrize("tokens", [1, 16, 64, 4096])
@pytest.mark.parametrize("limit", [2, 7, 10, 24, 1000])
def test_spread_keeps_the_default_and_spreads_over_the_grid(model: str, tokens: int, limit: int) -> None:
    e, k, h, i = MODELS[model]
    grid, first = candidates(tokens, e, k, h, i), default_config(tokens, e, k, h, i)
    picked = spread(grid, limit, first)
    assert picked[0] == first and len(picked) == len(set(picked)) == min(limit, len({first, *grid}))
    assert all(c.is_valid(-(-h // 128) * 128, -(-i // 128) * 128) for c in picked)
    others = [c for c in grid if c != first]
    assert picked[1:] == _spaced(others)[: limit - 1]  # every prefix spread over the whole grid
    if limit >= len(others) + 1:
        assert set(picked) == {first, *grid}
    if limit - 1 >= 2:  # the first two past the default come from the grid's two halves
        assert others.index(picked[1]) < len(others) / 2 <= others.index(picked[2])
    assert all(c.gemm1 == c.gemm2 for c in grid if c != first)  # both GEMMs share every parameter
    if tokens == 1:  # decode: more programs per SM
        assert {c.gemm1.programs_per_sm for c in grid} == {1, 2, 3, 4}


@pytest.mark.parametrize("model", DEFAULT_MODELS)
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_neighbors_differ_in_exactly_one_value(model: str, tokens: int) -> None:
    e, k, h, i = MODELS[model]
    first = triton_start(tokens, e, k, h, i)
    near = neighbors(first, tokens, e, k, h, i)
    assert near and len(near) == len(set(near)) and first not in near

    def values(c: MoEKernelConfig) -> list:
        def gemm(g: GemmConfig) -> list:
            return [
                g.block_n,
                g.num_stages,
                g.num_warps,
                g.programs_per_sm,
                g.max_registers,
                g.warp_specialized,
                g.chunks_per_stage,
                g.k_groups,
                g.narrow_tiles,
                g.loader_warps,
            ]

        assert len(dataclasses.fields(GemmConfig)) == 10, "a new GemmConfig field: add it above"
        return [c.block_m, c.partials_in_x_dtype, c.pair_tiles, *gemm(c.gemm1), *gemm(c.gemm2)]

    for c in near:
        assert c.is_valid(-(-h // 128) * 128, -(-i // 128) * 128)
        assert sum(a != b for a, b in zip(values(c), values(first))) == 1
    # GEMM1 and GEMM2 move independently
    assert any(c.gemm1 == first.gemm1 and c.gemm2 != first.gemm2 for c in near)
    # from a warp-specialized GEMM with tiles of 16 tokens or more, narrower MMAs are one step away; so are
    # loaders of other widths
    ws = dataclasses.replace(
        first, block_m=max(first.block_m, 16), gemm1=GemmConfig(128, num_warps=8, num_stages=4, warp_specialized=True)
    )
    assert ws.is_valid(-(-h // 128) * 128, -(-i // 128) * 128)
    ws_near = neighbors(ws, tokens, e, k, h, i)
    assert {c.gemm1.narrow_tiles for c in ws_near} >= {1, 2} - ({2} if ws.block_m < 32 else set())
    assert {c.gemm1.loader_warps for c in ws_near} == {1, 2, 4}


def test_search_climbs_to_the_optimum_within_the_limit() -> None:
    e, k, h, i = MODELS["qwen3-30b-a3b"]
    tokens = 1
    target = MoEKernelConfig(
        block_m=16,
        gemm1=GemmConfig(block_n=64, programs_per_sm=3, max_registers=168),
        gemm2=GemmConfig(block_n=128, num_stages=3, programs_per_sm=2),
    )
    assert target.is_valid(h, i)

    def distance(c: MoEKernelConfig) -> float:  # a cost with one minimum, at target
        fields = [(c.gemm1, target.gemm1), (c.gemm2, target.gemm2)]
        gemms = sum(a != b for g, t in fields for a, b in zip(dataclasses.astuple(g), dataclasses.astuple(t)))
        return 10.0 + gemms + (c.block_m != target.block_m)

    calls: list[MoEKernelConfig] = []

    def measure(c: MoEKernelConfig) -> float | None:
        calls.append(c)
        return None if c.gemm1.num_warps == 8 else distance(c)  # failures count, never win

    first = default_config(tokens, e, k, h, i)
    start = spread(candidates(tokens, e, k, h, i), 12, first)
    best, us = search(measure, start, lambda c: neighbors(c, tokens, e, k, h, i), 400)
    assert best == target and us == 10.0
    assert len(calls) == len(set(calls)) <= 400
    calls.clear()
    limited = search(measure, start, lambda c: neighbors(c, tokens, e, k, h, i), 15)
    assert limited is not None and limited[1] > 10.0 and len(calls) == 15  # stopped at the limit, short of it


def test_search_reports_nothing_when_every_config_fails() -> None:
    first = default_config(1, 8, 2, 4096, 14336)
    assert search(lambda c: None, [first], lambda c: [], 4) is None


def test_merge_entries_replaces_only_what_was_retuned() -> None:
    def entry(tokens: int, us: float, experts: int = 8) -> dict:
        return dict(
            experts=experts, top_k=2, hidden=4096, intermediate=14336, dtype="bfloat16", max_tokens=tokens, time_us=us
        )

    old = [entry(1, 90.0), entry(16, 280.0), entry(1, 30.0, experts=128)]
    new = [entry(1, 60.0)]
    merged = merge_entries(old, new)
    assert sorted((m["experts"], m["max_tokens"], m["time_us"]) for m in merged) == [
        (8, 1, 60.0),
        (8, 16, 280.0),
        (128, 1, 30.0),
    ]


def test_climb_start_is_the_config_the_file_serves_the_size_with() -> None:
    """--update starts each size from what the file runs it with now: its own entry, else the entry select_config
    picks (the next larger one), nothing (the default) past its entries and for a shape, top-k or dtype it lacks."""

    def entry(tokens: int, block_m: int, experts: int = 8, dtype: str = "bfloat16") -> dict:
        cfg = MoEKernelConfig(block_m, GemmConfig(), GemmConfig())
        return dict(
            experts=experts,
            top_k=2,
            hidden=4096,
            intermediate=14336,
            dtype=dtype,
            max_tokens=tokens,
            config=cfg.to_dict(),
        )

    entries = [
        entry(64, 32),
        entry(16, 16),
        entry(256, 64),
        entry(100, 128, experts=128),
        entry(128, 128, dtype="float16"),
    ]
    shape = LayerShape(8, 2, 4096, 14336)
    assert [c.block_m for c in climb_start(entries, shape, 64)] == [32]  # its own entry
    assert [c.block_m for c in climb_start(entries, shape, 1)] == [16]
    assert [c.block_m for c in climb_start(entries, shape, 100)] == [64]  # the entry serving 65..256
    assert climb_start(entries, shape, 4096) == []  # past every entry: select_config serves the default
    assert climb_start(entries, LayerShape(8, 2, 2048, 768), 64) == []
    assert climb_start(entries, LayerShape(8, 1, 4096, 14336), 64) == []
    assert climb_start(entries[:3], LayerShape(8, 2, 4096, 14336, "float16"), 64) == []


def test_token_tile_moves_lower_narrow_tiles_only_as_far_as_they_must() -> None:
    """From Mixtral's T <= 64 entry (32-token tiles, narrow MMAs of 16 and 8 tokens), the climb at T=32 offers 16-token
    tiles with both GEMMs at narrow_tiles 1 (8-wide MMAs) and 8-token tiles without narrow ones; a Triton GEMM's
    narrowest MMA stays 16 wide."""
    ws = GemmConfig(128, num_warps=4, num_stages=2, max_registers=128, warp_specialized=True, chunks_per_stage=2)
    cfg = MoEKernelConfig(32, dataclasses.replace(ws, narrow_tiles=1), dataclasses.replace(ws, narrow_tiles=2))
    e, k, h, i = MODELS["mixtral-8x7b"]
    assert not dataclasses.replace(cfg, block_m=16).is_valid(4096, 14336)  # what the climb used to offer
    tiles = {
        c.block_m: (c.gemm1.narrow_tiles, c.gemm2.narrow_tiles)
        for c in neighbors(cfg, 32, e, k, h, i)
        if c.block_m != cfg.block_m
    }
    assert tiles == {16: (1, 1), 8: (0, 0)}
    assert all(
        getattr(c, g) == dataclasses.replace(getattr(cfg, g), narrow_tiles=getattr(c, g).narrow_tiles)
        for c in neighbors(cfg, 32, e, k, h, i)
        if c.block_m != cfg.block_m
        for g in ("gemm1", "gemm2")
    )  # nothing else moves with the tile
    triton = MoEKernelConfig(32, GemmConfig(128, narrow_tiles=1), GemmConfig(128, narrow_tiles=1))
    assert triton.with_token_tile(16).gemm1.narrow_tiles == 0 and triton.with_token_tile(64).gemm2.narrow_tiles == 1
    assert cfg.with_token_tile(64) == dataclasses.replace(cfg, block_m=64)  # wider tiles keep them
    # the sweeps that move the token tile do the same
    assert any(c.block_m == 16 and c.gemm2.narrow_tiles == 1 for c in ws_sweep(cfg, "gemm1", 32, e, k, h, i))
    assert any(c.block_m == 16 and c.gemm2.narrow_tiles == 1 for c in gemm_sweep(cfg, "gemm1", 32, e, k, h, i))


def test_rotated_weights_cover_four_l2_sizes_of_touched_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner times cold weights, as the bench does: copies enough that 4 x L2 of the touched experts'
    bytes stream between two uses of one copy, the first copy the weights themselves, clones made once."""
    import torch

    import moe_nvfp4 as m

    experts = 16
    weights = m.prepare_moe_weights(
        m.quantize_nvfp4(torch.randn(experts, 128, 128), segments=2), m.quantize_nvfp4(torch.randn(experts, 128, 64))
    )
    per_expert = sum(t[0].numel() * t.element_size() for t in weights.tensors)  # bytes of an expert's slice
    l2 = [50 * per_expert]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"L2_cache_size": l2[0]}))
    one_expert = torch.zeros(1, 2, dtype=torch.long)
    copies = rotated_weights(weights, one_expert)
    assert len(copies) == 16 and copies[0] is weights  # harness.rotation_copies caps at 16
    for c in copies[1:]:
        for a, b in zip(c.tensors, weights.tensors):
            assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()
    touched = torch.arange(14).view(7, 2)  # 14 experts touched: ceil(200 / 14) = 15 copies
    assert [id(c) for c in rotated_weights(weights, touched, copies)[1:]] == [id(c) for c in copies[1:15]]
    assert len(rotated_weights(weights, torch.arange(experts).view(8, 2))) == 13  # ceil(200 / 16)
    l2[0] = per_expert // 4
    assert rotated_weights(weights, one_expert) == [weights]  # one expert's bytes are 4 x L2: no clone


@pytest.mark.parametrize(
    "model,tokens,offered",
    [
        ("qwen3-30b-a3b", 1, True),
        ("qwen3-30b-a3b", 2, True),
        ("qwen3-30b-a3b", 3, False),
        ("mixtral-8x7b", 1, True),
        ("mixtral-8x7b", 16, False),
    ],
)
def test_pair_tiles_are_offered_up_to_two_tokens(model: str, tokens: int, offered: bool) -> None:
    """One token's k pairs hit k distinct experts, two tokens' mostly do; past that, pairs sharing an expert would
    each stream its weights (configs.PAIR_TILE_TOKENS, where the default takes them too).  Pair tiles need both GEMMs
    warp-specialized, so the climb offers them from such a config."""
    e, k, h, i = MODELS[model]
    assert any(c.pair_tiles for c in candidates(tokens, e, k, h, i)) == offered
    ws = GemmConfig(64, warp_specialized=True, max_registers=128)
    start = dataclasses.replace(triton_start(tokens, e, k, h, i), gemm1=ws, gemm2=ws)
    assert any(c.pair_tiles for c in neighbors(start, tokens, e, k, h, i)) == offered


@pytest.mark.parametrize("model", DEFAULT_MODELS)
@pytest.mark.parametrize("gemm", ["gemm1", "gemm2"])
def test_gemm_sweep_varies_one_gemm_over_every_shape_and_register_cap(model: str, gemm: str) -> None:
    e, k, h, i = MODELS[model]
    first = triton_start(1, e, k, h, i)
    swept = gemm_sweep(first, gemm, 1, e, k, h, i)
    other = "gemm2" if gemm == "gemm1" else "gemm1"
    assert swept and len(swept) == len(set(swept))
    assert all(c.is_valid(-(-h // 128) * 128, -(-i // 128) * 128) for c in swept)
    assert all(getattr(c, other) == getattr(first, other) for c in swept)
    assert all(c.block_m == first.block_m for c in swept)  # one token tile at T=1 (16 rows)
    mid = triton_start(64, e, k, h, i)  # the token tile moves with GEMM1's sweep only
    tiles = {c.block_m for c in gemm_sweep(mid, gemm, 64, e, k, h, i)}
    assert tiles == ({16, 32} if model == "mixtral-8x7b" else {16}) if gemm == "gemm1" else tiles == {mid.block_m}
    g = [getattr(c, gemm) for c in swept]
    assert {(x.block_n, x.num_warps) for x in g} == set(SWEEP_SHAPES)
    assert {x.max_registers for x in g} == {None, 168, 128} and {x.programs_per_sm for x in g} == {1, 2, 3, 4}
    assert {x.num_stages for x in g} == {getattr(first, gemm).num_stages}  # not swept


def test_search_times_each_sweep_from_the_best_so_far_before_climbing() -> None:
    e, k, h, i = MODELS["qwen3-30b-a3b"]
    first = triton_start(1, e, k, h, i)
    target = dataclasses.replace(
        first,
        gemm1=dataclasses.replace(first.gemm1, block_n=128, max_registers=168, programs_per_sm=3),
        gemm2=dataclasses.replace(first.gemm2, programs_per_sm=2, max_registers=128),
    )

    def cost(c: MoEKernelConfig) -> float:  # separable: each GEMM's sweep finds its half of the target
        return 10.0 + (c.gemm1 != target.gemm1) + (c.gemm2 != target.gemm2) + (c.block_m != target.block_m)

    batches: list[list[MoEKernelConfig]] = []
    sweeps = [lambda c, g=g: gemm_sweep(c, g, 1, e, k, h, i) for g in ("gemm1", "gemm2")]
    best, us = search(cost, [first], lambda c: neighbors(c, 1, e, k, h, i), 1000, sweeps, batches.append)
    assert best == target and us == 10.0
    assert [len(b) for b in batches[:3]] == [1, len(sweeps[0](first)) - 1, len(sweeps[1](best)) - 1]
    timed = [c for b in batches for c in b]
    assert len(timed) == len(set(timed))  # nothing timed twice


def test_ws_sweep_makes_one_gemm_warp_specialized_in_every_shape_and_residency() -> None:
    """--sweep-ws: one GEMM as the warp-specialized kernel in every tile shape x ring (chunks per stage, stages) x
    (register cap, programs per SM) whose ring fits in shared memory, at the config's token tile and the search
    space's; the other GEMM kept.  Neighbours can turn it on from the Triton kernel (one step: only the switch
    moves) and off from a multi-chunk ring (the Triton kernel takes one chunk per stage)."""
    e, k, h, i = MODELS["mixtral-8x7b"]
    first = triton_start(1, e, k, h, i)
    for gemm, block_m in (("gemm1", 16), ("gemm1", 64), ("gemm2", 16), ("gemm2", 64)):
        other = "gemm2" if gemm == "gemm1" else "gemm1"
        swept = ws_sweep(dataclasses.replace(first, block_m=block_m), gemm, 1, e, k, h, i)
        fits = [
            (shape, ring)
            for shape in SWEEP_SHAPES
            for ring in WS_RINGS
            if GemmConfig(shape[0], num_stages=ring[1], chunks_per_stage=ring[0]).ws_shared_bytes(
                gemm == "gemm1", block_m
            )
            <= WS_SMEM_LIMIT
        ]
        # at block_m 16 every ring fits (the largest, GEMM1's 128-row tiles in 4 stages of 2 chunks, takes 176 KiB)
        every = len(SWEEP_SHAPES) * len(WS_RINGS)
        assert len(fits) == every if block_m == 16 or gemm == "gemm2" else 0 < len(fits) < every
        at_tile = [c for c in swept if c.block_m == block_m]
        assert len(swept) == len(set(swept)) and len(at_tile) == len(fits) * len(WS_RESIDENCY)
        assert {(getattr(c, gemm).chunks_per_stage, getattr(c, gemm).num_stages) for c in at_tile} == set(WS_RINGS)
        assert all(getattr(c, gemm).warp_specialized for c in swept)
        assert all(getattr(c, other) == getattr(first, other) for c in swept)
        # and the search space's token tiles at T=1, 8 and 16: 8 needs both GEMMs warp-specialized, not so here
        assert {c.block_m for c in swept} == {block_m, 16}
    gluon2 = dataclasses.replace(
        first, gemm1=GemmConfig(), gemm2=GemmConfig(128, max_registers=128, programs_per_sm=2, warp_specialized=True)
    )
    assert {c.block_m for c in ws_sweep(gluon2, "gemm1", 1, e, k, h, i)} == {8, 16}
    turned_on = [c for c in neighbors(first, 1, e, k, h, i) if c.gemm1.warp_specialized]
    assert turned_on == [dataclasses.replace(first, gemm1=dataclasses.replace(first.gemm1, warp_specialized=True))]
    ring = dataclasses.replace(first, gemm1=GemmConfig(warp_specialized=True, chunks_per_stage=4, num_stages=2))
    turned_off = [c for c in neighbors(ring, 1, e, k, h, i) if not c.gemm1.warp_specialized]
    assert turned_off and all(c.gemm1.chunks_per_stage == 1 for c in turned_off)


@pytest.mark.parametrize("model", DEFAULT_MODELS)
def test_group_sweep_offers_every_fitting_k_group_ring(model: str) -> None:
    """--sweep-groups: one GEMM warp-specialized with 2 K groups of 4 MMA warps, one program per SM at their
    register cap, in every ring whose stages are a multiple of the groups and that fits in shared memory with
    group 1's sums; the other GEMM and the token tile kept."""
    e, k, h, i = MODELS[model]
    first = default_config(1, e, k, h, i)
    for gemm in ("gemm1", "gemm2"):
        swept = group_sweep(first, gemm, 1, e, k, h, i)
        kp = -(-(h if gemm == "gemm1" else i) // 128) * 128
        expected = {
            (bn, groups, ring)
            for bn in (64, 128)
            for groups, _ in WS_K_GROUPS
            for ring in GROUP_RINGS
            if ring[1] % groups == 0
            and (kp // 128) % ring[0] == 0
            and GemmConfig(bn, num_stages=ring[1], chunks_per_stage=ring[0], k_groups=groups).ws_shared_bytes(
                gemm == "gemm1", first.block_m
            )
            <= WS_SMEM_LIMIT
        }
        got = [
            (
                getattr(c, gemm).block_n,
                getattr(c, gemm).k_groups,
                (getattr(c, gemm).chunks_per_stage, getattr(c, gemm).num_stages),
            )
            for c in swept
        ]
        assert len(got) == len(set(got)) and set(got) == expected and {g for _, g, _ in got} == {2}
        assert {r for _, _, r in got} == {r for r in GROUP_RINGS if (kp // 128) % r[0] == 0} and len(expected) > 8
        regs = dict(WS_K_GROUPS)
        assert all(getattr(c, gemm).max_registers == regs[getattr(c, gemm).k_groups] for c in swept)
        assert all(getattr(c, gemm).programs_per_sm == 1 and getattr(c, gemm).warp_specialized for c in swept)
        other = "gemm2" if gemm == "gemm1" else "gemm1"
        assert all(getattr(c, other) == getattr(first, other) and c.block_m == first.block_m for c in swept)


def test_loader_sweep_offers_every_narrow_and_loader_width() -> None:
    """--sweep-loader: a warp-specialized GEMM in every narrow_tiles x loader_warps its token tile allows (no
    MMA under 8 tokens), nothing else changed; a Triton GEMM in every narrow_tiles that keeps 16 tokens."""
    e, k, h, i = MODELS["mixtral-8x7b"]
    ws = GemmConfig(128, num_warps=8, num_stages=4, max_registers=128, warp_specialized=True, chunks_per_stage=2)
    for block_m, narrows in ((32, {0, 1, 2}), (16, {0, 1}), (8, {0})):
        cfg = MoEKernelConfig(block_m, ws, GemmConfig(128) if block_m > 8 else ws)
        swept = loader_sweep(cfg, "gemm1", 64, e, k, h, i)
        got = {(c.gemm1.narrow_tiles, c.gemm1.loader_warps) for c in swept}
        assert len(got) == len(swept) and got == {(n, w) for n in narrows for w in (1, 2, 4)}
        assert all(dataclasses.replace(c.gemm1, narrow_tiles=0, loader_warps=4) == ws for c in swept)
        assert all(c.gemm2 == cfg.gemm2 and c.block_m == block_m for c in swept)
        if block_m > 8:
            triton_narrows = {n for n in narrows if block_m >> n >= 16}
            swept = loader_sweep(cfg, "gemm2", 64, e, k, h, i)
            assert {c.gemm2.narrow_tiles for c in swept} == triton_narrows and len(swept) == len(triton_narrows)
            assert all(dataclasses.replace(c.gemm2, narrow_tiles=0) == cfg.gemm2 and c.gemm1 == ws for c in swept)


def test_packed_layer_and_seeded_inputs(monkeypatch) -> None:
    """The tuner's layer and inputs, shared with tools/ (ab_moe, profile_moe, power_moe): the weights fused_moe_sm90
    takes, and inputs that repeat for a token count and differ between counts."""
    import torch
    import tune_moe

    monkeypatch.setitem(tune_moe.MODELS, "tiny", (4, 2, 128, 64))
    w = tune_moe.packed_layer("tiny", "cpu")
    assert (w.num_experts, w.hidden, w.intermediate, w.activation.gated) == (4, 128, 64, True)
    x, tw, ti = tune_moe.seeded_inputs("tiny", 5, "cpu")
    assert x.shape == (5, 128) and x.dtype == torch.bfloat16 and tw.shape == ti.shape == (5, 2)
    assert torch.allclose(tw.sum(-1), torch.ones(5)) and int(ti.max()) < 4
    again = tune_moe.seeded_inputs("tiny", 5, "cpu")
    assert all(torch.equal(a, b) for a, b in zip((x, tw, ti), again))
    assert not torch.equal(tune_moe.seeded_inputs("tiny", 6, "cpu")[0][:5], x)
    layer = random_models(4)[3]  # a random sweep's row by its key (tools/ab_moe.py's cases)
    x, tw, ti = tune_moe.seeded_inputs(layer.key, 3, "cpu")
    assert x.shape == (3, layer.hidden) and ti.shape == (3, layer.top_k) and int(ti.max()) < layer.experts
    with pytest.raises(ValueError, match="no-such-model"):
        tune_moe.seeded_inputs("no-such-model", 3, "cpu")
    # Nemotron's ReLU^2 layers (tools/ab_moe.py packs them with their activation): w13 is I rows, one global scale
    from moe_nvfp4 import prepare_moe_weights
    from moe_nvfp4.expert_activation import RELU2

    w13, w2 = tune_moe.make_layer(4, 128, 64, "cpu", gated=False)
    assert w13.packed.shape == (4, 64, 64) and w13.global_scale.shape == (4,) and w2.packed.shape == (4, 128, 32)
    relu2 = prepare_moe_weights(w13, w2, activation=RELU2)
    assert (relu2.intermediate, relu2.activation.gated) == (64, False)
