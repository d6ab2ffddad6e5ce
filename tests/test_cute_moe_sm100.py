"""The MoE form of the sm_100a W4A4 kernels (CuTe DSL), checked without a GPU, plus a GPU test.

PTX (every MoE variant compiled for sm_100a once per module, ~10 s): the list form's block-scaled MMA, TMA
stage and TMEM use, GEMM1's SiLU (ex2.approx, rcp.approx) times up with one 16-bit store per output
column, GEMM2's weight multiply with one fp32 store per column.  Host (CPU, torch references): the w13
gate/up interleave and w2 padding, the padded token-sorted rows (128-aligned expert offsets, every local
pair exactly once, empty experts, expert map -1), the tile walk covering every expert's rows exactly once,
and the per-expert pointer arrays of both GEMMs.
"""

from __future__ import annotations

import re

import pytest
import torch

import moe_nvfp4 as m
import moe_nvfp4.prepare_weights as prepare_weights
from moe_nvfp4.cute.grouped_w4a4_sm100 import TILE_M
from moe_nvfp4.cute.host import tile_walk
from moe_nvfp4.cute.moe_host import _gemm_plan, fused_moe_w4a4_sm100, padded_rows
from moe_nvfp4.cute.moe_w4a4_sm100 import GATE_UP_BLOCK, MOE_VARIANTS, MoeDownVariant, MoeGateUpVariant
from moe_nvfp4.formats import NVFP4Tensor, quantize_nvfp4
from moe_nvfp4.layouts import unswizzle_scales_128x4
from moe_nvfp4.routing import plan_routing
from moe_nvfp4.weight_layouts import Sm100Layout, padded_intermediate
from test_cute_sm100 import assert_block_scaled_mma, assert_tma_stage, assert_tmem_use, compile_ptx

GATE_UP = [v for v in MOE_VARIANTS if isinstance(v, MoeGateUpVariant)]
DOWN = [v for v in MOE_VARIANTS if isinstance(v, MoeDownVariant)]


@pytest.fixture(scope="module")
def ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return compile_ptx("moe_nvfp4.cute.moe_w4a4_sm100", MOE_VARIANTS, tmp_path_factory.mktemp("sm100a_moe_ptx"))


@pytest.mark.parametrize("variant", MOE_VARIANTS, ids=lambda v: v.name)
def test_mainloop_is_the_list_forms(ptx: dict[str, str], variant: MoeGateUpVariant | MoeDownVariant) -> None:
    text = ptx[variant.name]
    assert_block_scaled_mma(text, variant)
    assert_tma_stage(text, variant)
    assert_tmem_use(text, variant)


@pytest.mark.parametrize("variant", GATE_UP, ids=lambda v: v.name)
def test_gate_up_epilogue_is_silu_times_up(ptx: dict[str, str], variant: MoeGateUpVariant) -> None:
    """Each epilogue thread owns one row: tile_n / 2 output columns, each one exp2, one reciprocal, one
    conversion and one 16-bit store (gate and up of a column come from the same tile)."""
    text = ptx[variant.name]
    columns = variant.tile_n // 2
    assert len(re.findall(r"ex2\.approx\.ftz\.f32", text)) == columns
    assert len(re.findall(r"rcp\.approx\.ftz\.f32", text)) == columns
    cvt = "cvt.rn.bf16.f32" if variant.out_dtype == torch.bfloat16 else "cvt.rn.f16.f32"
    assert len(re.findall(re.escape(cvt), text)) == columns
    assert len(re.findall(r"st\.global\.b16", text)) == columns


@pytest.mark.parametrize("variant", DOWN, ids=lambda v: v.name)
def test_down_epilogue_scales_rows_by_their_weight(ptx: dict[str, str], variant: MoeDownVariant) -> None:
    """tile_n fp32 stores per thread (one row), each value times alpha_e * weight (tile_n multiplies, plus
    the one forming that product); no SiLU; the row's pair and weight are loaded from global memory."""
    text = ptx[variant.name]
    assert len(re.findall(r"st\.global\.b32", text)) == variant.tile_n
    assert "ex2.approx" not in text and "cvt.rn.bf16.f32" not in text
    multiplies = re.findall(r"^\s*mul\.f32(x2)?\s", text, re.M)
    assert sum(2 if x else 1 for x in multiplies) == variant.tile_n + 1
    # the row offset pair * H in 64 bits (T * top_k * H passes 2^31 at large T): the pair is loaded widened
    widened = re.findall(r"ld\.global\.s32\s+(%rd\d+)", text)
    assert widened and any(re.search(rf"mul\.lo\.s64\s+%rd\d+, {r},", text) for r in widened)


def prepare_moe_weights_sm100(w13: NVFP4Tensor, w2: NVFP4Tensor) -> m.MoEWeights:
    """Our sm_100a layout whatever the device (the API packs in it only where dispatch picks the cute backend)."""
    return prepare_weights._packed(w13, w2, Sm100Layout())


def _weights(e: int, hidden: int, inter: int, gen: torch.Generator) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(e, hidden, inter, generator=gen)
    return quantize_nvfp4(w13, segments=2), quantize_nvfp4(w2)


@pytest.mark.parametrize("inter", [64, 48])
def test_weights_interleave_gate_and_up_in_epilogue_blocks(inter: int, gen: torch.Generator) -> None:
    e, hidden = 3, 96
    w13, w2 = _weights(e, hidden, inter, gen)
    packed = prepare_moe_weights_sm100(w13, w2)
    ip = padded_intermediate(inter)
    assert ip % GATE_UP_BLOCK == 0 and ip >= inter
    # Row 32 * (2q + h) + r of the interleaved w13 is row 32q + r of gate (h = 0) or up (h = 1); padding is zero.
    row = torch.arange(2 * ip)
    half, within = (row // GATE_UP_BLOCK) % 2, (row // (2 * GATE_UP_BLOCK)) * GATE_UP_BLOCK + row % GATE_UP_BLOCK
    source = torch.where(within < inter, half * inter + within, -1)
    scales = unswizzle_scales_128x4(packed.w13_scale.view(torch.uint8), 2 * ip, hidden // 16)
    for r, s in enumerate(source.tolist()):
        if s < 0:
            assert not packed.w13_packed[:, r].any() and not scales[:, r].any()
        else:
            assert torch.equal(packed.w13_packed[:, r], w13.packed[:, s])
            assert torch.equal(scales[:, r], w13.block_scale.view(torch.uint8)[:, s])
    assert torch.equal(packed.w13_global, w13.global_scale)
    w2_scales = unswizzle_scales_128x4(packed.w2_scale.view(torch.uint8), hidden, ip // 16)
    assert torch.equal(packed.w2_packed[..., : inter // 2], w2.packed) and not packed.w2_packed[..., inter // 2 :].any()
    assert torch.equal(w2_scales[..., : inter // 16], w2.block_scale.view(torch.uint8))
    assert not w2_scales[..., inter // 16 :].any()


ROUTINGS = {  # (tokens, top_k, experts, which ids)
    "random": (37, 4, 8, "random"),
    "one expert takes everything (several tiles)": (300, 3, 6, "one"),
    "half the experts empty": (50, 2, 8, "even"),
    "expert map with -1": (41, 3, 8, "map"),
}


def _routing(case: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    t, k, e, kind = ROUTINGS[case]
    expert_map = None
    if kind == "one":
        ids = torch.stack([torch.full((t,), 2)] + [torch.randint(0, e, (t,), generator=gen) for _ in range(k - 1)], 1)
        ids[:, 1:] = torch.where(ids[:, 1:] == 2, 3, ids[:, 1:])
    else:  # "even": only even experts are chosen
        spread = 2 if kind == "even" else 1
        ids = torch.stack([torch.randperm(e // spread, generator=gen)[:k] * spread for _ in range(t)])
    if kind == "map":  # 8 global experts, 5 on this rank
        expert_map = torch.tensor([0, -1, 1, 2, -1, 3, -1, 4], dtype=torch.int32)
        e = 5
    weights = torch.rand(t, k, generator=gen)
    return ids.to(torch.int32), weights, expert_map, e


@pytest.mark.parametrize("case", ROUTINGS)
def test_padded_rows_hold_every_local_pair_once(case: str, gen: torch.Generator) -> None:
    """Also with the routing's unwritten tail (past the local pairs, the route kernel leaves whatever memory
    held: an expert map drops pairs) filled with out-of-range junk, which no row may index."""
    ids, weights, expert_map, e = _routing(case, gen)
    plan = plan_routing(ids, e, TILE_M, expert_map=expert_map)
    local = ids.long() if expert_map is None else expert_map.long()[ids.long()]
    counts = torch.bincount(local[local >= 0], minlength=e)
    sorted_pairs = plan.sorted_pairs.clone()
    sorted_pairs[int(counts.sum()) :] = 2**30
    rows = padded_rows(
        sorted_pairs, plan.expert_counts, plan.expert_offsets, plan.tile_expert, plan.tile_row_start, weights
    )
    assert rows.counts.tolist() == counts.tolist()
    padded = (counts + TILE_M - 1) // TILE_M * TILE_M
    assert rows.padded_offsets.tolist() == (torch.cumsum(padded, 0) - padded).tolist()  # 128-aligned, in order
    assert rows.row_pairs.numel() >= int(padded.sum())  # fixed size: the max_tiles bound
    pairs = rows.row_pairs.long()
    for expert in range(e):
        start, count = int(rows.padded_offsets[expert]), int(counts[expert])
        segment = pairs[start : start + count]
        assert sorted(segment.tolist()) == torch.nonzero(local.reshape(-1) == expert).flatten().tolist()
        assert (pairs[start + count : start + int(padded[expert])] == -1).all()
    assert int((pairs >= 0).sum()) == int(counts.sum())  # no other row holds a pair; -1-mapped pairs nowhere
    flat = weights.reshape(-1)
    assert torch.equal(rows.row_weights, torch.where(pairs >= 0, flat[pairs.clamp(min=0)], 0.0))


@pytest.mark.parametrize("case", ROUTINGS)
@pytest.mark.parametrize("num_ctas", [1, 7])
def test_tile_walk_covers_each_experts_rows_once(case: str, num_ctas: int, gen: torch.Generator) -> None:
    """The kernel's walk over groups (M = the expert's pair count) touches each expert's rows exactly once
    per output column tile and never a row of another expert's segment."""
    ids, weights, expert_map, e = _routing(case, gen)
    plan = plan_routing(ids, e, TILE_M, expert_map=expert_map)
    rows = padded_rows(
        plan.sorted_pairs, plan.expert_counts, plan.expert_offsets, plan.tile_expert, plan.tile_row_start, weights
    )
    n, tile_n = 384, 256
    sizes = [(c, n, 256) for c in rows.counts.tolist()]
    covered = torch.zeros(rows.row_pairs.numel(), -(-n // tile_n), dtype=torch.int32)
    for cta in range(num_ctas):
        for expert, tile_m, tile_col in tile_walk(sizes, tile_n, cta, num_ctas):
            start = int(rows.padded_offsets[expert]) + tile_m * TILE_M
            end = min(start + TILE_M, int(rows.padded_offsets[expert]) + sizes[expert][0])
            covered[start:end, tile_col] += 1
    assert torch.equal(covered, (rows.row_pairs >= 0).int()[:, None].expand_as(covered))


def test_gemm_plans_point_each_expert_at_its_rows_and_weights(gen: torch.Generator) -> None:
    ids, weights, expert_map, e = _routing("half the experts empty", gen)
    hidden, inter = 64, 96
    w13, w2 = _weights(e, hidden, inter, gen)
    packed = prepare_moe_weights_sm100(w13, w2)
    plan = plan_routing(ids, e, TILE_M, expert_map=expert_map)
    rows = padded_rows(
        plan.sorted_pairs, plan.expert_counts, plan.expert_offsets, plan.tile_expert, plan.tile_row_start, weights
    )
    r = rows.row_pairs.numel()
    a = m.quantize_activations(torch.randn(r, hidden, generator=gen), torch.tensor([0.01]))
    act = torch.empty(r, padded_intermediate(inter), dtype=torch.bfloat16)
    alpha = packed.w13_global * 0.01
    gemm1 = _gemm_plan(MoeGateUpVariant(128), a, packed.w13_packed, packed.w13_scale, act, rows, alpha, (), 3)
    partial = torch.empty(ids.numel(), hidden)
    gemm2 = _gemm_plan(
        MoeDownVariant(256),
        a,
        packed.w2_packed,
        packed.w2_scale,
        partial,
        rows,
        packed.w2_global[:, None],
        (rows.row_pairs, rows.row_weights),
        3,
    )
    scale_row = a.block_scale.shape[1]  # bytes per row of the swizzled A scales: a 128-row segment is 128 rows
    for expert in range(e):
        off = int(rows.padded_offsets[expert])
        a_columns = (a.packed.data_ptr() + off * hidden // 2, a.block_scale.data_ptr() + off * scale_row)
        expected1 = [
            a_columns[0],
            packed.w13_packed[expert].data_ptr(),
            a_columns[1],
            packed.w13_scale[expert].data_ptr(),
            act[off].data_ptr(),
        ]
        assert gemm1.pointers[expert].tolist() == expected1
        expected2 = [
            a_columns[0],
            packed.w2_packed[expert].data_ptr(),
            a_columns[1],
            packed.w2_scale[expert].data_ptr(),
            partial.data_ptr(),
            rows.row_pairs[off:].data_ptr(),
            rows.row_weights[off:].data_ptr(),
        ]
        assert gemm2.pointers[expert].tolist() == expected2
    count = rows.counts.tolist()
    assert gemm1.sizes.tolist() == [[c, 2 * padded_intermediate(inter), hidden] for c in count]
    assert gemm2.sizes.tolist() == [[c, hidden, hidden] for c in count]
    assert gemm1.alpha.shape == (e, 2) and gemm2.alpha.shape == (e, 1)
    assert gemm1.template_mnk == (r, 2 * padded_intermediate(inter), hidden)
    assert gemm1.descriptors.shape == (3, 64) and gemm2.variant == MoeDownVariant(256)


def _is_sm100() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


REL_TOL = 5e-2  # see test_fused_moe_matches_the_w4a4_reference


@pytest.mark.gpu
@pytest.mark.skipif(not _is_sm100(), reason="needs an sm_100 (Blackwell) GPU")
@pytest.mark.parametrize("case", ROUTINGS)
@pytest.mark.parametrize("tile_n", [128, 256])
def test_fused_moe_matches_the_w4a4_reference(case: str, tile_n: int, gen: torch.Generator) -> None:
    """||out - ref|| / ||ref|| <= REL_TOL against moe_dense_torch with the same input scales.  Not bit exact:
    the kernel rounds SiLU * up to bf16 (and uses ex2/rcp approximations) before quantizing it to NVFP4, the
    reference quantizes the float32 value, so a few elements (and block scales) round to a neighbouring
    code; each such flip moves a value by up to one e2m1 step."""
    ids, weights, expert_map, e_local = _routing(case, gen)
    hidden, inter = 256, 192
    w13, w2 = _weights(e_local, hidden, inter, gen)
    x = torch.randn(ids.shape[0], hidden, generator=gen).to(torch.bfloat16)
    s13, s2 = torch.tensor([4.0 / 2688]), torch.tensor([2.0 / 2688])
    packed = prepare_moe_weights_sm100(w13.to("cuda"), w2.to("cuda"))
    emap = None if expert_map is None else expert_map.cuda()
    got = fused_moe_w4a4_sm100(
        x.cuda(), packed, weights.cuda(), ids.cuda(), emap, (s13.cuda(), s2.cuda()), tile_n=tile_n
    ).cpu()
    ref = m.fused_moe_torch(x, w13, w2, weights, ids, expert_map=expert_map, w13_input_scale=s13, w2_input_scale=s2)
    error = (got.float() - ref.float()).norm() / ref.float().norm()
    assert error <= REL_TOL, f"relative error {error:.3g}"
