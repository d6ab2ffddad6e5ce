"""The sm_100a W4A4 grouped GEMM (CuTe DSL), checked without a GPU.

Every kernel variant is compiled for sm_100a once per session (a subprocess with CUTE_DSL_ARCH=sm_100a and
the DSL's cache off, so the PTX is really generated); the tests read that PTX: the block-scaled NVFP4 MMA and
its instruction descriptor (tile M x N, e2m1 operands, e4m3 scales), the TMA loads and the bytes one stage
expects (the four TMA boxes), scales copied to TMEM, the TMEM allocation, the per-group descriptor rewrites,
the epilogue's TMEM loads and output conversion.  The host side (operand and scale layouts as CuTe sees
them, the tile walk, the plan) is checked against ``layouts.py`` and the Triton path's metadata.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moe_nvfp4.cute.grouped_w4a4_sm100 import TILE_K, TILE_M, VARIANTS, GroupedW4A4Variant
from moe_nvfp4.cute.host import plan_grouped_w4a4_sm100, tile_walk
from moe_nvfp4.layouts import swizzled_offset

BLOCK_SCALED_MMA = "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16"
MMAS_PER_STAGE = TILE_K // 64  # the FP4 MMA has K = 64


def compile_ptx(module: str, variants: tuple, out: Path) -> dict[str, str]:
    """Run ``python -m module out`` (it compiles ``variants`` for sm_100a with the DSL's cache off) and return
    each variant's PTX text by name."""
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_100a", "CUTE_DSL_NO_CACHE": "1"}
    run = subprocess.run(
        [sys.executable, "-m", module, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert run.returncode == 0, run.stderr[-4000:]
    seconds = json.loads(run.stdout.strip().splitlines()[-1])
    texts = {}
    for variant in variants:
        files = list((out / variant.name).glob("*.sm_100a.ptx"))
        assert len(files) == 1, f"{variant.name}: {files}"
        texts[variant.name] = files[0].read_text()
    assert set(seconds) == set(texts)
    return texts


@pytest.fixture(scope="module")
def ptx(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """PTX text of every variant, by variant name (compiled once for the module: ~10 s on 2 cores)."""
    return compile_ptx("moe_nvfp4.cute.grouped_w4a4_sm100", VARIANTS, tmp_path_factory.mktemp("sm100a_ptx"))


def _immediates(ptx_text: str, register: str) -> set[int]:
    """Integer constants that flow into ``register`` through mov / or / selp (the PTX the DSL emits builds
    descriptors and byte counts that way)."""
    definitions = {}
    for line in ptx_text.splitlines():
        found = re.match(r"\s*(mov|or|selp)\.b32\s+(%r\d+),\s*(.*);", line)
        if found:
            definitions[found.group(2)] = [x.strip() for x in found.group(3).split(",")]
    values, todo, seen = set(), [register], set()
    while todo:
        reg = todo.pop()
        if reg in seen or reg not in definitions:
            continue
        seen.add(reg)
        for operand in definitions[reg]:
            if re.fullmatch(r"-?\d+", operand):
                values.add(int(operand))
            elif operand.startswith("%r"):
                todo.append(operand)
    return values


def _operands(ptx_text: str, instruction: str) -> list[list[str]]:
    """Operand lists of every occurrence of ``instruction``."""
    rows = []
    for line in ptx_text.splitlines():
        if line.strip().startswith(instruction):
            rows.append([x.strip(" []") for x in line.strip().rstrip(";")[len(instruction) :].split(",")])
    return rows


def assert_block_scaled_mma(text: str, variant: GroupedW4A4Variant) -> None:
    """The NVFP4 block-scaled MMA, one K stage unrolled, with the variant's tile in its instruction descriptor."""
    mmas = [line for line in text.splitlines() if "tcgen05.mma" in line]
    assert mmas and all(BLOCK_SCALED_MMA in line for line in mmas), mmas[:3]
    assert len(mmas) == MMAS_PER_STAGE  # one K stage, unrolled
    # Instruction descriptor (PTX ISA, block-scaled kinds; CUTLASS InstrDescriptorBlockScaled): bits 7-9 A type and
    # 10-12 B type (E2M1 = 1 for mxf4nvf4), 17-22 N >> 3, 23 scale type (0 = UE4M3), 24-28 M >> 4.  Bits 13/14
    # (negate A/B) come from the tiled MMA's runtime fields: the PTX selects between two constants.
    descriptors = set()
    for operands in _operands(text, BLOCK_SCALED_MMA):
        descriptors |= {v for v in _immediates(text, operands[3]) if v >> 24}
    assert descriptors, "no constant instruction descriptor found"
    for d in descriptors:
        assert ((d >> 24) & 0x1F) << 4 == TILE_M
        assert ((d >> 17) & 0x3F) << 3 == variant.tile_n
        assert (d >> 23) & 1 == 0, "scales must be UE4M3 (NVFP4), not UE8M0 (MXFP4)"
        assert (d >> 7) & 7 == 1, "A must be E2M1"
        assert (d >> 10) & 7 == 1, "B must be E2M1"


def assert_tma_stage(text: str, variant: GroupedW4A4Variant) -> None:
    """Four TMA loads per stage, the stage's bytes expected, the per-group descriptor rewrites."""
    loads = [line for line in text.splitlines() if "cp.async.bulk.tensor" in line]
    assert len(loads) == 4 and all("shared::cta.global.tile.mbarrier::complete_tx::bytes" in x for x in loads)
    # A [128, 256] and B [N, 256] FP4, their scales [128 | N, 256 / 16] e4m3: the bytes each stage's barrier expects
    stage_bytes = TILE_M * TILE_K // 2 + variant.tile_n * TILE_K // 2 + (TILE_M + variant.tile_n) * TILE_K // 16
    expected = [_immediates(text, ops[-1]) for ops in _operands(text, "mbarrier.arrive.expect_tx.shared.b64")]
    assert expected == [{stage_bytes}]
    # Each CTA points its descriptors at the group of its next tile: address, 2-3 extents and strides each.
    assert len(re.findall(r"tensormap\.replace\.tile\.global_address", text)) == 4
    assert "tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu" in text
    assert "fence.proxy.tensormap::generic.acquire.gpu" in text


def assert_tmem_use(text: str, variant: GroupedW4A4Variant) -> None:
    """Scales copied to TMEM, the TMEM allocation, the accumulator loads of the epilogue, 6 warps."""
    # One copy per 128 rows per MMA K block: 32 rows x 16 bytes from smem (the atom's 128 rows x 4 scales),
    # broadcast to the 4 TMEM lane quadrants (warpx4); A has 128 rows, B N.
    copies = re.findall(r"tcgen05\.cp\.cta_group::1\.32x128b\.warpx4", text)
    assert len(copies) == MMAS_PER_STAGE * (TILE_M + variant.tile_n) // 128
    allocs = _operands(text, "tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32")
    assert len(allocs) == 1 and _immediates(text, allocs[0][1]) == {512}
    assert "tcgen05.dealloc.cta_group::1.sync.aligned.b32" in text
    assert "tcgen05.commit.cta_group::1.mbarrier::arrive::one" in text
    # Epilogue: 4 warps read 32 lanes x 32 columns per load; the tile's N columns in N / 32 loads.
    loads = re.findall(r"tcgen05\.ld\.sync\.aligned\.32x32b\.x32\.b32", text)
    assert len(loads) == variant.tile_n // 32
    assert re.search(r"\.reqntid 192, 1, 1", text), "6 warps: 4 epilogue, MMA, TMA"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_mma_is_block_scaled_nvfp4_with_the_tile_shape(ptx: dict[str, str], variant: GroupedW4A4Variant) -> None:
    assert_block_scaled_mma(ptx[variant.name], variant)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_tma_loads_the_four_boxes_of_one_stage(ptx: dict[str, str], variant: GroupedW4A4Variant) -> None:
    assert_tma_stage(ptx[variant.name], variant)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_scales_and_accumulators_live_in_tmem(ptx: dict[str, str], variant: GroupedW4A4Variant) -> None:
    assert_tmem_use(ptx[variant.name], variant)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_epilogue_converts_to_the_output_dtype(ptx: dict[str, str], variant: GroupedW4A4Variant) -> None:
    text = ptx[variant.name]
    want, other = (
        ("cvt.rn.f16.f32", "cvt.rn.bf16.f32")
        if variant.out_dtype == torch.float16
        else ("cvt.rn.bf16.f32", "cvt.rn.f16.f32")
    )
    assert want in text and other not in text
    assert "st.global.b16" in text


def _cute_offsets(rows: int, k: int) -> tuple[list[int], list[int]]:
    """Trace-time (static) offsets of the kernel's operand and scale layouts for one (rows, K) operand:
    operand (r, k) for all r, k; scale (r, 16 j) for all r, j < K / 16."""
    import cutlass.cute as cute

    from moe_nvfp4.cute._grouped_w4a4_sm100_kernel import operand_layout, scale_layout

    found: dict[str, list[int]] = {}

    @cute.jit
    def probe() -> None:
        operand = operand_layout(rows, k)
        scales = scale_layout(operand.shape)
        found["operand"] = [cute.crd2idx((r, c, 0), operand) for r in range(rows) for c in range(k)]
        found["scale"] = [cute.crd2idx((r, 16 * j, 0), scales) for r in range(rows) for j in range(k // 16)]

    cute.compile(probe)
    return found["operand"], found["scale"]


@pytest.mark.parametrize("rows, k", [(1, 32), (130, 96), (300, 320), (128, 64)])
def test_cute_scale_layout_is_the_128x4_swizzle(rows: int, k: int) -> None:
    """Ragged rows and K not a multiple of 64: the layout CuTe loads the scales with maps (row, k-block) to the
    byte ``layouts.swizzled_offset`` (the layout ``swizzle_scales_128x4`` writes) gives."""
    operand, scale = _cute_offsets(rows, k)
    r = torch.arange(rows)[:, None]
    assert operand == (r * k + torch.arange(k)[None, :]).flatten().tolist()  # nibble r * K + k: K-major packing
    j = torch.arange(k // 16)[None, :]
    assert scale == swizzled_offset(r, j, k // 16).flatten().tolist()


@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("num_ctas", [1, 3, 148])
def test_tile_walk_covers_every_tile_once(tile_n: int, num_ctas: int) -> None:
    """Ragged groups, an empty group and one with K = 0: every output tile of every group is computed by
    exactly one CTA, in the Triton path's order (groups concatenated, row-major within a group)."""
    sizes = [(80, 4096, 7168), (0, 512, 256), (1, 300, 0), (257, 130, 64), (128, 256, 32)]
    walked = [t for cta in range(num_ctas) for t in tile_walk(sizes, tile_n, cta, num_ctas)]
    expected = [
        (g, i, j) for g, (m, n, _) in enumerate(sizes) for i in range(-(-m // TILE_M)) for j in range(-(-n // tile_n))
    ]
    assert sorted(walked) == sorted(expected) and len(walked) == len(expected)
    linear = {t: i for i, t in enumerate(expected)}
    for cta in range(num_ctas):
        assert [linear[t] for t in tile_walk(sizes, tile_n, cta, num_ctas)] == list(range(cta, len(expected), num_ctas))


def _groups(sizes: list[tuple[int, int, int]], gen: torch.Generator) -> tuple[list[torch.Tensor], ...]:
    a = [torch.randint(0, 256, (m, k // 2), dtype=torch.uint8, generator=gen) for m, _, k in sizes]
    b = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen) for _, n, k in sizes]
    sa = [torch.zeros(-(-m // 128) * 128, -(-k // 64) * 4, dtype=torch.float8_e4m3fn) for m, _, k in sizes]
    sb = [torch.zeros(-(-n // 128) * 128, -(-k // 64) * 4, dtype=torch.float8_e4m3fn) for _, n, k in sizes]
    return a, sa, b, sb


def test_plan_holds_pointers_sizes_and_a_descriptor_slot_per_cta(gen: torch.Generator) -> None:
    sizes = [(80, 256, 512), (0, 128, 96), (300, 64, 32)]
    a, sa, b, sb = _groups(sizes, gen)
    alpha = torch.ones(3)
    plan = plan_grouped_w4a4_sm100((a, sa, b, sb), alpha, torch.bfloat16, tile_n=256, num_ctas=5)
    assert plan.sizes.tolist() == [list(s) for s in sizes]
    for g in range(3):
        assert plan.pointers[g].tolist() == [t[g].data_ptr() for t in (a, b, sa, sb, plan.outs)]
        assert plan.outs[g].shape == sizes[g][:2] and plan.outs[g].dtype == torch.bfloat16
    assert plan.descriptors.shape == (5, 64) and plan.template_mnk == (300, 256, 512)
    assert plan.template_addresses == (a[0].data_ptr(), b[0].data_ptr(), sa[0].data_ptr(), sb[0].data_ptr())
    assert plan.variant == GroupedW4A4Variant(256, torch.bfloat16)


def test_plan_rejects_what_tma_cannot_load(gen: torch.Generator) -> None:
    a, sa, b, sb = _groups([(64, 64, 48)], gen)
    with pytest.raises(ValueError, match="K % 32"):
        plan_grouped_w4a4_sm100((a, sa, b, sb), torch.ones(1), torch.float16, num_ctas=1)
    a, sa, b, sb = _groups([(64, 64, 64)], gen)
    misaligned = torch.empty(64 * 32 + 1, dtype=torch.uint8)[1:].view(64, 32)
    with pytest.raises(ValueError, match="aligned"):
        plan_grouped_w4a4_sm100(([misaligned], sa, b, sb), torch.ones(1), torch.float16, num_ctas=1)
    with pytest.raises(ValueError, match="tile_n"):
        plan_grouped_w4a4_sm100((a, sa, b, sb), torch.ones(1), torch.float16, tile_n=64, num_ctas=1)


def test_import_moe_nvfp4_does_not_import_cutlass() -> None:
    code = "import sys, moe_nvfp4, moe_nvfp4.cute.host; assert 'cutlass' not in sys.modules, 'cutlass imported'"
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1]).returncode == 0
