"""The sm_90 MoE kernels compiled for Hopper on the CPU machine (Triton compiles without a GPU): with
programmatic dependent launch each kernel must wait for the previous kernel (griddepcontrol.wait) before its
first global memory access, or it could read routing data or activations that are not written yet."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_nvfp4.sm90 import gemm_triton as G
from moe_nvfp4.sm90 import host as K
from moe_nvfp4.sm90.default_config import TRITON_PREFILL_GEMM2
from moe_nvfp4.triton import combine as C
from moe_nvfp4.triton import routing_kernels as R

GLOBAL_ACCESS = re.compile(r"^\s*(@%p\d+\s+)?(ld\.global|st\.global|cp\.async|atom\.global|red\.global)", re.M)

GEMM_SIGNATURE = dict(
    a_ptr="*bf16",
    stride_a="i32",
    w_ptr="*u8",
    s_ptr="*u8",
    gs_ptr="*fp32",
    out_ptr="*bf16",
    stride_out="i32",
    sorted_pairs_ptr="*i32",
    tile_expert_ptr="*i32",
    tile_row_ptr="*i32",
    tile_row_end_ptr="*i32",
    num_tiles_ptr="*i32",
    n_out="i32",
    k="i32",
    kp="i32",
    a_desc="constexpr",
    a_desc_half="constexpr",
    a_desc_quarter="constexpr",
    w_desc="constexpr",
    s_desc="constexpr",
    epilogue=None,
)  # epilogue: _epilogue's; the TMA descriptors None but where a test gives them
# in the kernel's argument order
GEMM1_CONSTEXPRS = dict(
    TOP_K=2,
    IS_GEMM1=True,
    BLOCK_N=64,
    BLOCK_M=16,
    BLOCK_K=128,
    EVEN_K=True,
    DTYPE=tl.bfloat16,
    NUM_STAGES=4,
    USE_ASM=True,
    NARROW=0,
    TMA=False,
)

ROUTE_SIGNATURE = dict(
    ids_ptr="*i32",
    expert_map_ptr="*i32",
    hist_ptr="*i32",
    sorted_pairs_ptr="*i32",
    counts_ptr="*i32",
    offsets_ptr="*i32",
    cursor_ptr="*i32",
    tile_expert_ptr="*i32",
    tile_row_ptr="*i32",
    tile_row_end_ptr="*i32",
    num_tiles_ptr="*i32",
    num_pairs="i32",
    chunk="i32",
    num_chunks="i32",
    num_global="i32",
    num_experts="i32",
    max_tiles="i32",
)
# COUNTED goes first (the kernel's argument order)
ROUTE_CONSTEXPRS = dict(COUNTED=False, MAX_CHUNKS=128, HAS_MAP=False, BLOCK_M=16, BLOCK_P=128, E_POW2=128)

KERNELS = {
    "route": (R._route_kernel, ROUTE_SIGNATURE, dict(ROUTE_CONSTEXPRS, COUNTED=False), 8),
    "route counted": (R._route_kernel, ROUTE_SIGNATURE, dict(ROUTE_CONSTEXPRS, COUNTED=True, BLOCK_P=256), 8),
    "count": (
        R._count_kernel,
        dict(
            ids_ptr="*i32",
            expert_map_ptr="*i32",
            hist_ptr="*i32",
            num_pairs="i32",
            chunk="i32",
            num_global="i32",
            num_experts="i32",
        ),
        dict(HAS_MAP=False, BLOCK_P=256, E_POW2=128),
        4,
    ),
    "gemm1": (G._moe_gemm_kernel, GEMM_SIGNATURE, GEMM1_CONSTEXPRS, 4),
    "gemm2": (G._moe_gemm_kernel, dict(GEMM_SIGNATURE, out_ptr="*fp32"), dict(GEMM1_CONSTEXPRS, IS_GEMM1=False), 4),
    "combine": (
        C._combine_kernel,
        dict(
            partial_ptr="*fp32",
            ids_ptr="*i32",
            weights_ptr="*fp32",
            expert_map_ptr="*i32",
            out_ptr="*bf16",
            hidden="i32",
            num_global="i32",
            num_experts="i32",
        ),
        dict(TOP_K=2, WEIGHTED=True, HAS_MAP=False, BLOCK_H=1024, DTYPE=tl.bfloat16),
        4,
    ),
}


# common.Epilogue's fields: the host's defaults (gated SiLU without biases; GEMM2 plain)
DEFAULT_EPILOGUE = {True: (False, "silu", 1.702, 7.0, True), False: (False, None, None, None, False)}


def _epilogue(kernel, fields: tuple) -> tuple[tuple, dict]:
    """The kernel's ``epilogue`` tuple argument (common.Epilogue: has bias, activation, alpha, limit, gate and
    up rows) as its signature entry and its constexprs by path, as the JIT specializes a launch's Epilogue.of."""
    i = kernel.arg_names.index("epilogue")
    bias, *rest = fields
    return ("*fp32" if bias else "constexpr",) + ("constexpr",) * len(rest), {
        (i, j): v for j, v in enumerate((None, *rest)) if j or not bias
    }


def _divisibility(signature: dict, unaligned: tuple[str, ...] = ()) -> dict:
    """What the JIT specializes at launch: 16-byte aligned pointers (but ``unaligned`` ones; the epilogue's bias
    pointer included), strides and sizes divisible by 16, as the ``attrs`` of an AST source."""
    divisible = [
        (i,)
        for i, (n, t) in enumerate(signature.items())
        if (isinstance(t, str) and t.startswith("*") and n not in unaligned) or n.startswith(("stride", "n_", "k"))
    ]
    divisible += [
        (i, j)
        for i, t in enumerate(signature.values())
        if isinstance(t, tuple)
        for j, f in enumerate(t)
        if f.startswith("*")
    ]
    return {path: [["tt.divisibility", 16]] for path in divisible}


def _compile(
    name: str,
    pdl: bool,
    block_m: int | None = None,
    narrow: int | None = None,
    aligned: bool = False,
    epilogue: tuple | None = None,
    **options,
):
    """``aligned``: pointers, strides and sizes marked 16-divisible, as the JIT marks them at launch (without,
    Triton pipelines no loads through cp.async).  ``epilogue``: _epilogue's fields (GEMM kernels; the default
    variant where None)."""
    kernel, signature, constexprs, warps = KERNELS[name]
    constexprs = dict(
        constexprs,
        PDL=pdl,
        **({} if block_m is None else dict(BLOCK_M=block_m)),
        **({} if narrow is None else dict(NARROW=narrow)),
    )
    assert list(signature) + list(constexprs) == kernel.arg_names, "test signature out of date with the kernel"
    paths = {}
    if "epilogue" in signature:
        fields = DEFAULT_EPILOGUE[constexprs["IS_GEMM1"]] if epilogue is None else epilogue
        epilogue_sig, paths = _epilogue(kernel, fields)
        signature = dict(signature, epilogue=epilogue_sig)
    attrs = _divisibility(signature) if aligned else None
    absent = {n: None for n, t in signature.items() if t == "constexpr"}  # arguments passed as None
    src = ASTSource(
        kernel,
        dict(signature, **{c: "constexpr" for c in constexprs}),
        constexprs={**absent, **constexprs, **paths},
        attrs=attrs,
    )
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps, launch_pdl=pdl, **options)
    )


def _ptx(name: str, pdl: bool) -> str:
    return _compile(name, pdl).asm["ptx"]


def _ptxas_info(ptx: str) -> str:
    """``ptxas -v`` on PTX for sm_90a: its report (registers, spills, C75xx notes), stderr."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        return subprocess.run(
            [get_ptxas(90).path, "--gpu-name=sm_90a", "-v", f.name, "-o", "/dev/null"],
            capture_output=True,
            text=True,
            check=True,
        ).stderr


@pytest.mark.parametrize("name", list(KERNELS))
def test_every_kernel_waits_for_the_previous_one_before_touching_memory(name: str) -> None:
    ptx = _ptx(name, pdl=True)
    wait = ptx.find("griddepcontrol.wait")
    trigger = ptx.find("griddepcontrol.launch_dependents")
    first_access = GLOBAL_ACCESS.search(ptx)
    assert first_access is not None and 0 <= wait < first_access.start(), name
    assert wait < trigger < first_access.start(), name  # the next kernel may launch once this one is running
    assert "griddepcontrol" not in _ptx(name, pdl=False)  # plain launches (interpreter, pre-sm_90) have none


def test_launch_options_follow_the_device() -> None:
    import torch

    from moe_nvfp4.triton.common import _dependent_launch

    assert _dependent_launch(torch.device("cpu")) == dict(PDL=False)


def test_register_cap_bounds_the_gemm_registers() -> None:
    """GemmConfig.max_registers is Triton's maxnreg: the PTX carries .maxnreg and ptxas keeps under it, which is
    what lets more programs share an SM (65536 registers / (threads x registers per thread))."""
    from moe_nvfp4.sm90.configs import GemmConfig

    def registers(ptx: str) -> int:  # ptxas -v on the PTX Triton produced
        return int(re.search(r"Used (\d+) registers", _ptxas_info(ptx)).group(1))

    options = GemmConfig(max_registers=80).launch_options()
    capped = _compile("gemm1", True, maxnreg=options["maxnreg"]).asm["ptx"]
    free = _ptx("gemm1", True)
    assert ".maxnreg 80" in capped and ".maxnreg" not in free
    assert registers(capped) <= 80 < registers(free)


def _compile_ws(
    gated: bool,
    block_n: int,
    warps: int,
    maxnreg: int | None,
    chunks: int = 1,
    k_groups: int = 1,
    stages: int = 4,
    block_m: int = 16,
    narrow: int = 0,
    loader_warps: int = 4,
    pair_tiles: bool = False,
    has_map: bool = False,
    epilogue: tuple | None = None,
):
    """The warp-specialized Gluon GEMM (sm90.gemm_gluon) compiled for sm_90 with the launcher's descriptors (K of
    1024) and the launcher's constexprs for that GemmConfig; returns the compiled kernel's asm (ptx, cubin, ...).
    ``epilogue``: _epilogue's fields (the default variant where None)."""
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource

    from moe_nvfp4.sm90.configs import GemmConfig
    from moe_nvfp4.sm90 import gemm_gluon as W

    w = torch.zeros(8, 64, 4096, dtype=torch.uint8)  # any FragmentLayout-shaped bytes: only the views matter
    views = W._descriptors(w, w[:, :8], 1024, block_n // 64, chunks)
    descs = [native_specialize_impl(CUDABackend, d, False, True, True)[0] for d in views]
    signature = dict(
        a_ptr="*bf16",
        stride_a="i32",
        w_desc=descs[0],
        s_desc=descs[1],
        gs_ptr="*fp32",
        out_ptr="*bf16" if gated else "*fp32",
        stride_out="i32",
        sorted_pairs_ptr="*i32",
        tile_expert_ptr="*i32",
        tile_row_ptr="*i32",
        tile_row_end_ptr="*i32",
        num_tiles_ptr="*i32",
        ids_ptr="*i32",
        num_pairs="i32",
        expert_map_ptr="*i32",
        num_global="i32",
        num_experts="i32",
        n_out="i32",
        k="i32",
        kp="i32",
        epilogue=None,
    )
    gemm = GemmConfig(
        block_n,
        num_warps=warps,
        num_stages=stages,
        max_registers=maxnreg,
        warp_specialized=True,
        chunks_per_stage=chunks,
        k_groups=k_groups,
        narrow_tiles=narrow,
        loader_warps=loader_warps,
    )
    assert gemm.is_valid(1024) and block_m >> narrow >= 8
    constexprs = dict(
        TOP_K=2,
        IS_GEMM1=gated,
        BLOCK_N=block_n,
        BLOCK_M=block_m,
        STAGES=stages,
        DTYPE=W.gl.bfloat16,
        PDL=True,
        LOADER_REGS=W.LOADER_REGISTERS,
        CHUNKS=chunks,
        K_GROUPS=k_groups,
        MMA_REGS=W._mma_registers(gemm),
        NARROW=narrow,
        LOADER_WARPS=loader_warps,
        PAIR_TILES=pair_tiles,
        HAS_MAP=has_map,
    )
    assert list(signature) + list(constexprs) == W._moe_gemm_ws_kernel.arg_names, "test signature out of date"
    signature["epilogue"], paths = _epilogue(
        W._moe_gemm_ws_kernel, DEFAULT_EPILOGUE[gated] if epilogue is None else epilogue
    )
    attrs = _divisibility(signature, unaligned=("ids_ptr", "expert_map_ptr"))  # do_not_specialize_on_alignment
    src = GluonASTSource(
        W._moe_gemm_ws_kernel, dict(signature, **{c: "constexpr" for c in constexprs}), {**constexprs, **paths}, attrs
    )
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options=dict(launch_pdl=True, **gemm.launch_options())
    ).asm


# a PTX block that holds nothing but the wait for the previous kernel and the trigger for the next, then the
# partition's end
IDLE_EXIT = re.compile(
    r"^\$L__BB\d+_\d+:[^\n]*\n(?:(?:\s*//[^\n]*|\$L__tmp\d+:|\s*\.loc[^\n]*)\n)*"
    r"\s*griddepcontrol\.wait;[^\n]*\n(?:(?:\s*//[^\n]*|\s*\.loc[^\n]*)\n)*"
    r"\s*griddepcontrol\.launch_dependents;[^\n]*\n"
    r"(?=(?:(?:\s*//[^\n]*|\$L__\w+:[^\n]*|\s*\.loc[^\n]*)\n)*\s*barrier\.sync)",
    re.M,
)  # then ends


def _sass(cubin: bytes) -> str:
    """The cubin's SASS, by the nvdisasm Triton ships."""
    import os
    import subprocess
    import tempfile

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize(
    "gated,block_n,warps,maxnreg,chunks",
    [
        (True, 64, 4, None, 1),
        (False, 128, 4, 128, 1),
        (True, 128, 8, 128, 1),
        (True, 64, 4, 128, 2),
        (True, 128, 4, 128, 2),
        (False, 64, 4, None, 4),
    ],
)
def test_warp_specialized_gemm_protocol(
    gated: bool, block_n: int, warps: int, maxnreg: int | None, chunks: int
) -> None:
    """What the Gluon kernel's correctness rests on, in its sm_90 PTX: the loader's stage barrier counts 128 cp.async arrivals (.noinc) plus one expect-tx for one TMA box of
    values and one of scales per matrix, covering every unit and chunk of the stage; the MMA warps fence the
    async proxy after each wait (cp.async writes, wgmma reads) and issue wgmma with register A operands.
    Of the stage's MMAs (gate and up per chunk) at most one (128 rows per warp group) or two (64) run while
    the next decodes, each retired by a wait_group naming its operand; the stage ends with wait_group 0
    before it is freed, so no A register is reused while an MMA still reads it, across the loop back-edge
    above all."""
    ptx = _compile_ws(gated, block_n, warps, maxnreg, chunks)["ptx"]
    halves = 2 if gated else 1
    assert re.search(r"mbarrier\.init\.shared(::cta)?\.b64 \[[^]]+\], 129;", ptx)  # a warp group's threads + 1
    assert "cp.async.mbarrier.arrive.noinc" in ptx
    box_bytes = halves * (block_n // 64) * chunks * (4096 + 512)
    assert re.search(rf"expect_tx\.shared\.b64 _, \[%r\d+\], {box_bytes};", ptx)
    # values + scales per matrix (GEMM2: again for its first tile's stages, before the wait for GEMM1)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.4d", ptx)) == 2 * halves * (1 if gated else 2)
    assert "fence.proxy.async.shared::cta" in ptx
    wgmma = re.findall(r"wgmma\.mma_async[^\n]*\{", ptx)
    assert wgmma and all(".bf16.bf16" in w for w in wgmma)
    assert re.search(
        r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.bf16\.bf16 \{[^}]+\}, \{", ptx
    )  # A in registers
    in_flight = 2 if block_n == 16 * warps else 1
    mmas = halves * chunks
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)
    assert waits == [str(in_flight)] * max(0, mmas - in_flight) + ["0"]
    assert ptx.count("wgmma.commit_group") == mmas
    last_wait = ptx.rindex("wgmma.wait_group.sync.aligned 0;")
    release = ptx.index("mbarrier.arrive.shared::cta.b64", last_wait)  # the stage freed for the loader
    assert ptx.rindex("wgmma.mma_async", 0, release) < last_wait


@pytest.mark.parametrize(
    "gated,k_groups,maxnreg,stages,pairs",
    [
        (True, 1, 128, 4, False),
        (False, 1, 128, 4, False),
        (False, 2, 160, 2, False),
        (True, 2, 168, 4, False),
        (True, 2, 168, 4, True),
        (False, 1, 128, 4, True),
        (False, 1, 128, 4, "map"),
    ],
)
def test_warp_specialized_partitions_wait_for_the_previous_kernel(
    gated: bool, k_groups: int, maxnreg: int, stages: int, pairs: bool
) -> None:
    """Programmatic dependent launch in the Gluon GEMM: every partition (each MMA warp group, the loader) waits
    for the previous kernel itself, and lets the next one launch only after its wait, so a running kernel knows
    the kernel two back has ended.  What a partition reads before its wait must not come from the previous
    kernel: GEMM1 (after the routing kernel) reads nothing; GEMM2's loader (after GEMM1) reads the routing
    kernel's tile map (with pair tiles topk_ids, written before GEMM1) and issues its first tile's weight boxes
    (one per matrix and stage: the values and the scales), never the token rows GEMM1 writes.  The epilogue's
    stores come after the waits."""
    from moe_nvfp4.sm90 import gemm_gluon as W

    ptx = _compile_ws(gated, 64, 4, maxnreg, 1, k_groups, stages, pair_tiles=bool(pairs), has_map=pairs == "map")["ptx"]
    # With pair tiles the tile count is an argument, so ptxas knows a GEMM2 loader with no first tile has no tile
    # at all: it gets a block of its own that only waits, lets the next kernel launch and ends (nothing to check)
    ptx, idle = IDLE_EXIT.subn("", ptx)
    assert idle == (bool(pairs) and not gated)
    waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)]
    triggers = [m.start() for m in re.finditer(r"griddepcontrol\.launch_dependents", ptx)]
    assert len(waits) == len(triggers) == k_groups + 1  # the MMA groups and the loader
    assert all(w < t < (waits + [len(ptx)])[i + 1] for i, (w, t) in enumerate(zip(waits, triggers)))
    # each partition's code is one run of the PTX, entered through a setmaxnreg (the loader's to its registers)
    entries = [m.start() for m in re.finditer(r"setmaxnreg\.\w+\.sync\.aligned\.u32", ptx)]
    loader_wait = max(w for w in waits if w < ptx.index("cp.async.cg"))  # the partition that copies token rows
    for w in waits:
        before = ptx[max([e for e in entries if e < w], default=0) : w]
        if w != loader_wait:
            assert not GLOBAL_ACCESS.search(before) and "cp.async.bulk" not in before
            continue
        assert re.match(rf"setmaxnreg\.\w+\.sync\.aligned\.u32\s+{W.LOADER_REGISTERS};", before)
        assert "cp.async.cg" not in before and "st.global" not in before  # GEMM1's rows, outputs: after the wait
        assert len(re.findall(r"cp\.async\.bulk\.tensor", before)) == (0 if gated else 2)
        assert ("ld.global" in before) == (not gated)  # GEMM2's loader: the tile map
    assert min(m.start() for m in re.finditer(r"cp\.async\.cg", ptx)) > loader_wait


@pytest.mark.parametrize("gated,block_n,chunks,k_groups", [(True, 64, 4, 1), (False, 128, 1, 1), (True, 64, 2, 2)])
def test_eight_token_tiles_are_wgmma_n8(gated: bool, block_n: int, chunks: int, k_groups: int) -> None:
    """block_m 8 in the Gluon kernel: every MMA a wgmma m64n8k16 with A in registers (not mma.sync, which is
    what Triton's tl.dot makes of an 8-wide tile), and no spills at the shipped decode residencies."""
    asm = _compile_ws(gated, block_n, 4, 168 if k_groups > 1 else 128, chunks, k_groups, 2 * k_groups, block_m=8)
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.bf16\.bf16 \{[^}]+\}, \{", asm["ptx"])
    assert wgmma and set(wgmma) == {"m64n8k16"}
    assert "mma.sync" not in asm["ptx"]
    assert ".local" not in asm["ptx"] and not re.search(r"\bSTL", _sass(asm["cubin"]))


@pytest.mark.parametrize(
    "gated,block_n,warps,maxnreg,chunks,k_groups,block_m,narrow,widths",
    [
        (True, 128, 8, 128, 2, 1, 32, 2, (8, 16, 32)),
        (False, 128, 4, None, 1, 1, 32, 1, (16, 32)),
        (True, 64, 4, 168, 2, 2, 16, 1, (8, 16)),
        (True, 128, 8, 128, 2, 1, 32, 0, (32,)),
    ],
)
def test_narrow_tiles_run_narrower_wgmma(
    gated: bool,
    block_n: int,
    warps: int,
    maxnreg: int | None,
    chunks: int,
    k_groups: int,
    block_m: int,
    narrow: int,
    widths: tuple[int, ...],
) -> None:
    """GemmConfig.narrow_tiles: the kernel holds one copy of the tile's K loop per MMA width (block_m, and
    block_m / 2, / 4 down to 8 tokens), each the full stage protocol (every MMA of a stage retired before the
    stage is freed), and chooses one per tile at run time; no width spills."""
    asm = _compile_ws(
        gated,
        block_n,
        warps,
        maxnreg,
        chunks,
        k_groups,
        2 * k_groups if k_groups > 1 else 4,
        block_m=block_m,
        narrow=narrow,
    )
    ptx = asm["ptx"]
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16 \{[^}]+\}, \{", ptx)
    assert sorted({int(n) for n in wgmma}) == list(widths)
    per_width = (2 if gated else 1) * chunks * (block_n // (16 * warps)) * k_groups  # wgmma per K step and width
    assert len(wgmma) == per_width * len(widths) * 8  # eight k16 steps per 128-wide chunk
    assert re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx).count("0") == len(widths) * k_groups
    assert ".local" not in ptx and not re.search(r"\bSTL", _sass(asm["cubin"]))


@pytest.mark.parametrize("loader_warps,block_m", [(1, 8), (2, 16), (4, 32), (4, 64)])
def test_loader_warps_issue_the_token_rows(loader_warps: int, block_m: int) -> None:
    """GemmConfig.loader_warps: that many warps of the loader's warp group issue the token rows' cp.async, each
    thread's arrival counted by the stage barrier (plus the TMA's expect-arrive, by one thread), the idle warps
    lowered to the fewest registers; no spills where each is shipped (one warp spilled from block_m 16 on)."""
    asm = _compile_ws(True, 128, 8, 128, 2, block_m=block_m, loader_warps=loader_warps)
    ptx = asm["ptx"]
    assert re.search(rf"mbarrier\.init\.shared(::cta)?\.b64 \[[^]]+\], {32 * loader_warps + 1};", ptx)
    assert ptx.count("cp.async.mbarrier.arrive.noinc") == 1
    assert len(re.findall(r"@%p\d+ mbarrier\.arrive\.expect_tx", ptx)) == 1  # predicated: one thread
    assert ".local" not in ptx and not re.search(r"\bSTL", _sass(asm["cubin"]))


@pytest.mark.parametrize(
    "gated,block_n,maxnreg,chunks,k_groups,stages,block_m,narrow,loader_warps",
    [
        (True, 64, 168, 2, 2, 4, 8, 0, 4),
        (False, 64, 128, 2, 1, 2, 8, 0, 2),
        (True, 128, 128, 2, 1, 2, 16, 1, 1),
        (False, 64, 168, 4, 2, 4, 16, 0, 4),
    ],
)
@pytest.mark.parametrize("has_map", [False, True], ids=["no map", "expert map"])
def test_pair_tiles_read_topk_ids_not_the_tile_map(
    gated: bool,
    block_n: int,
    maxnreg: int,
    chunks: int,
    k_groups: int,
    stages: int,
    block_m: int,
    narrow: int,
    loader_warps: int,
    has_map: bool,
) -> None:
    """MoEKernelConfig.pair_tiles: token tile m is pair m, its expert topk_ids[m] (checked against the global expert
    count, and with an expert map mapped and checked against the local count), so the kernel reads none of the
    routing kernel's buffers (its five tile-map parameters go unloaded) and no sorted pair ids; a tile of one row
    runs the narrowest MMAs the config allows (8 tokens wide here); the shipped T=1 shapes (Qwen3: 8-token tiles,
    2 K groups; Mixtral: 16-token tiles, narrow 1, one loader warp) spill nothing the routed builds do not."""
    asm = _compile_ws(
        gated,
        block_n,
        4,
        maxnreg,
        chunks,
        k_groups,
        stages,
        block_m=block_m,
        narrow=narrow,
        loader_warps=loader_warps,
        pair_tiles=True,
        has_map=has_map,
    )
    routed = _compile_ws(
        gated, block_n, 4, maxnreg, chunks, k_groups, stages, block_m=block_m, narrow=narrow, loader_warps=loader_warps
    )
    params = re.compile(r"ld\.param\.\w+\s+%\w+, \[_moe_gemm_ws_kernel_param_(\d+)\]")
    loaded, routed_loaded = set(params.findall(asm["ptx"])), set(params.findall(routed["ptx"]))
    # the tile map out; in: topk_ids, their count, the global expert count (with a map also the map, the local count)
    assert len(routed_loaded - loaded) == 5 and len(loaded - routed_loaded) == (5 if has_map else 3)
    widths = {int(n) for n in re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16", asm["ptx"])}
    assert widths == {block_m >> narrow}  # a tile holds one row: only the narrowest K loop is built
    # no spill the routed build lacks (Mixtral's narrow-1 GEMM1 spills one register a tile in both, outside the K loop)
    assert len(re.findall(r"\bSTL", _sass(asm["cubin"]))) <= len(re.findall(r"\bSTL", _sass(routed["cubin"]))) <= 1


def test_pair_tiles_launch_no_routing_kernel(monkeypatch) -> None:
    """The host's side of pair tiles (kernels stubbed, CPU tensors taken for rows the Gluon kernel can run): both
    Gluon GEMMs get topk_ids, pair_tiles and the expert map (or None), and in place of the tile map one 16-byte
    aligned int32 stand-in, and no routing kernel runs, with an expert map as without.  Rows the Gluon kernel cannot
    run or the field off route."""
    import moe_nvfp4 as m
    from moe_nvfp4.sm90.configs import GemmConfig, MoEKernelConfig

    class Routed(Exception):
        pass

    def route(*args, **kwargs):
        raise Routed

    launches = []
    monkeypatch.setattr(K, "route", route)
    monkeypatch.setattr(K, "combine", lambda *args, **kwargs: None)
    monkeypatch.setattr(K, "launch_gemm_ws", lambda a, weights, out, routing, *args, **kwargs: launches.append(routing))
    gluon_rows = True
    monkeypatch.setattr(K, "_gluon_rows_ok", lambda x, intermediate: gluon_rows)
    e, h, i, t, k = 8, 256, 128, 1, 2
    w = m.prepare_moe_weights(
        m.quantize_nvfp4(torch.randn(e, 2 * i, h), segments=2), m.quantize_nvfp4(torch.randn(e, h, i))
    )
    x = torch.randn(t, h).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(t, e), k)
    ws = GemmConfig(64, warp_specialized=True)
    cfg = MoEKernelConfig(8, ws, ws, pair_tiles=True)

    def forward(config: MoEKernelConfig, expert_map: torch.Tensor | None = None) -> None:
        K.fused_moe_sm90(x, w, tw, ti, expert_map, config)

    emap = torch.arange(e, dtype=torch.int32)
    forward(cfg)
    forward(cfg, emap)
    assert len(launches) == 4
    for n, (tile_map, ids, expert_map, pairs) in enumerate(launches):  # each launch's common.GemmRouting
        assert pairs is True and torch.equal(ids, ti.reshape(-1)) and expert_map is (None if n < 2 else emap)
        assert len({id(p) for p in tile_map}) == 1 and tile_map[0].dtype == torch.int32
        assert tile_map[0].data_ptr() % 16 == 0 and tile_map[0].data_ptr() != ids.data_ptr()
    for config, expert_map, rows in (
        (cfg, emap, False),
        (cfg, None, False),
        (dataclasses.replace(cfg, pair_tiles=False), None, True),
    ):
        gluon_rows = rows
        with pytest.raises(Routed):
            forward(config, expert_map)


def _gemm2_boxes(block_m: int, stages: int, maxnreg: int | None = None, tma: bool = True, narrow: int = 0):
    """GEMM2 at 8 warps, 128 weight rows, bf16 partials, on TMA boxes (the host's descriptors' specializations: a
    token-row box per width the tiles run) or through address tensors."""
    kernel, signature, constexprs, _ = KERNELS["gemm2"]
    signature = dict(signature, out_ptr="*bf16")
    if tma:
        boxes = dict(w_desc="u8[1, 2, 32, 128]", s_desc="u8[1, 2, 4, 128]")
        signature.update({name: f"tensordesc<{box}>" for name, box in boxes.items()})
        names = ("a_desc", "a_desc_half", "a_desc_quarter")[: narrow + 1]
        signature.update({name: f"tensordesc<bf16[{block_m >> j}, 128]>" for j, name in enumerate(names)})
    KERNELS["gemm2 boxes"] = (kernel, signature, dict(constexprs, BLOCK_N=128, NUM_STAGES=stages, TMA=tma), 8)
    try:
        return _compile(
            "gemm2 boxes",
            True,
            block_m=block_m,
            narrow=narrow,
            aligned=True,
            **({} if maxnreg is None else {"maxnreg": maxnreg}),
        )
    finally:
        del KERNELS["gemm2 boxes"]


def test_triton_gemm2_reads_boxes_and_fits_two_programs_an_sm() -> None:
    """The Triton GEMM2 at full width takes its token rows and weight blocks as TMA boxes (no cp.async), which frees
    the registers the address tensors held: a 128 x 128 tile compiles in fewer registers, and capped at 128 (two
    programs an SM) spills nothing where the address-tensor build spills; ptxas keeps its wgmmas unserialized
    (no C7515: the tile loop is not flattened, whose accumulator reset would serialize them)."""

    def report(k) -> tuple[int, int, str]:
        info = _ptxas_info(k.asm["ptx"])
        spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", info))
        return int(re.search(r"Used (\d+) registers", info).group(1)), spills, info

    boxes, pointers = _gemm2_boxes(128, 3), _gemm2_boxes(128, 3, tma=False)
    ptx = boxes.asm["ptx"]
    assert "cp.async.bulk.tensor" in ptx and not re.search(r"cp\.async\.c[ag]", ptx)
    regs_boxes, spills, info = report(boxes)
    regs_pointers, _, _ = report(pointers)
    assert regs_boxes < regs_pointers - 32 and spills == 0 and "C7515" not in info
    preset = TRITON_PREFILL_GEMM2  # what the default runs at 128-token tiles (design 002 decision 25)
    stages, cap = preset["num_stages"], preset["max_registers"]
    two_boxes, two_pointers = _gemm2_boxes(128, stages, cap), _gemm2_boxes(128, stages, cap, tma=False)
    regs, spills, info = report(two_boxes)
    assert regs <= cap and spills == 0 and not re.search(r"C751[235]", info)  # no serialized wgmma either
    assert report(two_pointers)[1] > 0  # what the boxes fixed
    assert 2 * two_boxes.metadata.shared <= 227 * 1024  # two programs' rings fit an SM


def test_triton_gemm_compiles_eight_token_tiles() -> None:
    """An 8-token config (Gluon-only) runs the Triton GEMM where rows are not 16-byte aligned: it must compile
    for sm_90 at BLOCK_M 8, its dot as mma.sync m16n8k16 (the interpreter tests check its sums)."""
    ptx = _compile("gemm1", pdl=True, block_m=8).asm["ptx"]
    assert "mma.sync.aligned.m16n8k16" in ptx and "wgmma" not in ptx


@pytest.mark.parametrize("block_m,narrow,widths", [(64, 2, (16, 32, 64)), (32, 1, (16, 32)), (64, 0, (64,))])
def test_triton_narrow_tiles_run_narrower_wgmma(block_m: int, narrow: int, widths: tuple[int, ...]) -> None:
    """GemmConfig.narrow_tiles in the Triton GEMM: one K loop per token width, each a wgmma of that N and each
    pipelined through cp.async (a wait per loop), in the shared memory of the full-width loop alone."""
    full = _compile("gemm1", pdl=True, block_m=block_m, narrow=0, aligned=True)
    asm = _compile("gemm1", pdl=True, block_m=block_m, narrow=narrow, aligned=True)
    ptx = asm.asm["ptx"]
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k16\.f32\.bf16\.bf16", ptx)
    assert sorted({int(n) for n in wgmma}) == list(widths) and "mma.sync" not in ptx
    assert len(wgmma) == len(widths) * len(re.findall(r"wgmma\.mma_async", full.asm["ptx"]))
    waits = len(re.findall(r"cp\.async\.wait_group", ptx))
    assert waits == len(widths) * len(re.findall(r"cp\.async\.wait_group", full.asm["ptx"])) > 0
    assert asm.metadata.shared == full.metadata.shared


@pytest.mark.parametrize(
    "gated,block_n,maxnreg,chunks,k_groups,stages",
    [(True, 64, 168, 2, 2, 4), (False, 128, 168, 1, 2, 4), (True, 64, 128, 1, 2, 2)],
)
def test_k_groups_share_a_tile(
    gated: bool, block_n: int, maxnreg: int, chunks: int, k_groups: int, stages: int
) -> None:
    """GemmConfig.k_groups: the program is k_groups MMA warp groups plus the loader's, every group running the
    same wgmma protocol as one alone (checked above) on its own K steps, the worker groups raised to the
    registers the loader leaves (setmaxnreg), and each worker group handing its sums to group 0 through
    shared memory under a full/free pair of one-arrival barriers: its stores, a barrier over its own warps,
    then the arrival."""
    from moe_nvfp4.sm90.configs import GemmConfig
    from moe_nvfp4.sm90 import gemm_gluon as W

    ptx = _compile_ws(gated, block_n, 4, maxnreg, chunks, k_groups, stages)["ptx"]
    gemm = GemmConfig(
        block_n,
        num_stages=stages,
        max_registers=maxnreg,
        warp_specialized=True,
        chunks_per_stage=chunks,
        k_groups=k_groups,
    )
    assert f".reqntid {32 * (4 * k_groups + 4)}" in ptx and f".maxnreg {maxnreg}" in ptx
    assert 32 * maxnreg * (4 * k_groups + 4) <= 65536  # one program fits an SM
    mma_regs = W._mma_registers(gemm)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{mma_regs};", ptx)
    assert maxnreg < mma_regs <= 256
    halves = 2 if gated else 1
    mmas = halves * chunks
    assert ptx.count("wgmma.commit_group") == mmas * k_groups
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)
    assert waits.count("0") == k_groups
    # stages' empty barriers and the groups' full/free pairs count one arrival; the stages' ready ones 129
    assert len(re.findall(r"mbarrier\.init\.shared(?:::cta)?\.b64 \[[^]]+\], 1;", ptx)) == stages + 2 * (k_groups - 1)
    f32_stores = [m.start() for m in re.finditer(r"st\.shared(?:\.v\d)?\.f32|st\.shared(?:\.v\d)?\.b32", ptx)]
    arrivals = [m.start() for m in re.finditer(r"mbarrier\.arrive\.shared::cta\.b64", ptx)]
    handed = 0
    for a in arrivals:
        before = [st for st in f32_stores if st < a]
        if before and ptx.rfind("bar.sync", 0, a) > before[-1] > ptx.rfind("mbarrier.arrive", 0, a):
            handed += 1  # stores, then the group's barrier, then this arrival
    assert handed >= k_groups - 1


def test_decode_instruction_budget() -> None:
    """The MMA warps' decode, counted in the SASS of a warp-specialized GEMM1 (128-row tile of 4 warps, two K
    chunks a stage, gate and up: 64 words of eight values per thread a stage): 4 packed multiplies per word
    (the block scale), and one byte permute per word (the word's pair of scale bytes, selected by the asm
    from the register of four as loaded; building a per-word scale operand first cost a second, 17
    instructions per word instead of 16)."""
    import collections

    sass = _sass(_compile_ws(True, 128, 4, 128, 2)["cubin"])
    ops = collections.Counter(re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)", sass))
    words = 2 * 2 * 128 * 128 // 8 // 128  # matrices x chunks x values / (8 per word) / threads
    assert ops["HGMMA"] == 2 * 2 * 2 * 8  # per matrix and chunk: two 64-row halves x eight k16 steps
    assert ops["HMUL2"] == 4 * words
    assert words <= ops["PRMT"] <= words + 16  # the rest: a few outside the decode


def test_ab_moe_loads_another_version_of_the_package(tmp_path) -> None:
    """tools/ab_moe.py's ``pkg=DIR`` variant: a copy of the package (as ``git archive REV moe_nvfp4`` writes
    it) imports under a name of its own, its sm_90 host and Gluon module its own, not the installed package's; a
    tuned config reaches it as its own config class (an older copy may lack fields the installed one has)."""
    import shutil

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import ab_moe

    from moe_nvfp4.sm90 import host as moe_sm90

    archive = tmp_path / "rev"
    shutil.copytree(Path(moe_sm90.__file__).resolve().parent.parent, archive / "moe_nvfp4")
    older = archive / "moe_nvfp4" / "sm90" / "configs.py"  # a version from before pair tiles
    older.write_text(older.read_text().replace("    pair_tiles: bool = False\n", ""))
    host = ab_moe.load_package(archive, tmp_path / "scratch", "moe_nvfp4_rev")
    assert host.__name__ == "moe_nvfp4_rev.sm90.host" and host.fused_moe_sm90 is not moe_sm90.fused_moe_sm90
    assert Path(host.__file__).is_relative_to(tmp_path / "scratch")
    from moe_nvfp4_rev.sm90 import gemm_gluon as copied_ws  # what the copy's host launches

    assert copied_ws.launch_gemm_ws.__module__ == "moe_nvfp4_rev.sm90.gemm_gluon"
    from moe_nvfp4_rev.sm90 import configs as copied_configs

    from moe_nvfp4.sm90.configs import GemmConfig, MoEKernelConfig

    ws = GemmConfig(64, warp_specialized=True)
    cfg = MoEKernelConfig(8, ws, ws, pair_tiles=True)
    theirs = ab_moe.package_config(host, cfg)
    assert type(theirs) is copied_configs.MoEKernelConfig and not hasattr(theirs, "pair_tiles")
    assert theirs.to_dict() == {f: v for f, v in cfg.to_dict().items() if f != "pair_tiles"}


def test_ab_moe_rules_variant_runs_another_versions_selection(tmp_path) -> None:
    """tools/ab_moe.py's ``rules=DIR`` variant: the config another version's selector picks (its default rules), as
    this package's config class, so this package's kernels time a default-rule change against the rule before it."""
    import shutil

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import ab_moe

    from moe_nvfp4.shapes import DeviceTraits
    from moe_nvfp4.sm90 import default_config as rules
    from moe_nvfp4.sm90.configs import MoEKernelConfig
    from moe_nvfp4.sm90.tuned_configs import select_config
    from moe_nvfp4.zoo import zoo_shape

    archive = tmp_path / "rev"
    shutil.copytree(Path(rules.__file__).resolve().parent.parent, archive / "moe_nvfp4")
    older = archive / "moe_nvfp4" / "sm90" / "default_config.py"  # the 64-token tiles' bound before decision 13
    older.write_text(older.read_text().replace("(20, 32), (64, 64))", "(20, 32), (96, 64))"))
    host = ab_moe.load_package(archive, tmp_path / "scratch", "moe_nvfp4_rules")
    shape, device = zoo_shape("gpt-oss-120b").layer, DeviceTraits("no file", (9, 0), 132)
    for tokens, before in ((2304, 64), (4096, 128), (64, None)):  # 72 rows, 128 rows, decode
        theirs, ours = ab_moe.their_selection(host, tokens, shape, device), select_config(tokens, shape, device)
        assert type(theirs) is MoEKernelConfig
        assert theirs == ours if before is None else (theirs.block_m, ours.block_m) == (before, 128)


def test_ab_moe_calls_each_version_of_the_host_in_its_convention() -> None:
    """tools/ab_moe.py's forwards: the current host takes the weights as one MoEWeights; a tree from before
    2026-11-29 (``pkg=`` of an older revision) takes the six weight tensors and the intermediate size."""
    import types

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import ab_moe

    import moe_nvfp4 as m

    w = m.prepare_moe_weights(
        m.quantize_nvfp4(torch.randn(2, 64, 32), segments=2), m.quantize_nvfp4(torch.randn(2, 32, 32))
    )
    calls = []

    def loose(x, w13_packed, w13_scale, w13_global, w2_packed, w2_scale, w2_global, tw, ti, emap, inter, config):
        calls.append(((w13_packed, w13_scale, w13_global, w2_packed, w2_scale, w2_global), inter, config))

    def grouped(x, weights, tw, ti, emap, config):
        calls.append((weights, config))

    ab_moe.host_forward(types.SimpleNamespace(fused_moe_sm90=loose), "x", w, "tw", "ti", None, "cfg")()
    ab_moe.host_forward(types.SimpleNamespace(fused_moe_sm90=grouped), "x", w, "tw", "ti", None, "cfg")()
    assert calls[0][0] == w.tensors and calls[0][1:] == (32, "cfg")
    assert calls[1][0] is w and calls[1][1] == "cfg"


def test_ab_moe_reads_configs_from_another_directory(tmp_path) -> None:
    """tools/ab_moe.py's ``configs=DIR`` variant: select_config reads DIR's tuned files for it (a copy of
    configs/ taken before a tuner run), and the package's own files again after."""
    import json

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import ab_moe

    from moe_nvfp4 import shapes
    from moe_nvfp4.sm90 import configs, tuned_configs

    shipped_file = tuned_configs.config_path("NVIDIA H200")
    data = json.loads(shipped_file.read_text())
    for entry in data["entries"]:
        entry["config"]["gemm1"]["programs_per_sm"] = 7  # a value no shipped entry uses
    copy = tuned_configs.config_path("NVIDIA H200", tmp_path)
    copy.parent.mkdir(parents=True)
    copy.write_text(json.dumps(data))

    h200 = shapes.DeviceTraits("NVIDIA H200", (9, 0), 132, 140)

    def select() -> configs.MoEKernelConfig:
        return tuned_configs.select_config(1, shapes.LayerShape(8, 2, 4096, 14336, torch.bfloat16), h200)

    shipped = select()
    assert shipped.gemm1.programs_per_sm != 7
    assert ab_moe.tuned_config(tmp_path, select) == dataclasses.replace(
        shipped, gemm1=dataclasses.replace(shipped.gemm1, programs_per_sm=7)
    )
    assert select() == shipped  # the package's directory again


def test_ab_moe_gemm_variant_changes_one_gemms_fields() -> None:
    """tools/ab_moe.py's ``gemm1:field=value/...`` variant (A/Bs of one GEMM's fields in design 002): those
    fields of one GEMM (``gemms:``: both) changed, the rest of the config kept; ``none`` for None."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import ab_moe

    from moe_nvfp4.sm90.configs import GemmConfig, MoEKernelConfig

    cfg = MoEKernelConfig(
        8,
        GemmConfig(64, max_registers=168, k_groups=2, warp_specialized=True),
        GemmConfig(64, warp_specialized=True),
        pair_tiles=True,
    )
    one = ab_moe.gemm_variant(cfg, "gemm1:programs_per_sm=3/k_groups=1/max_registers=none")
    assert one == dataclasses.replace(
        cfg, gemm1=dataclasses.replace(cfg.gemm1, programs_per_sm=3, k_groups=1, max_registers=None)
    )
    assert ab_moe.gemm_variant(cfg, "gemm2:num_stages=2").gemm2.num_stages == 2
    both = ab_moe.gemm_variant(cfg, "gemms:narrow_tiles=2")
    assert both == dataclasses.replace(
        cfg, gemm1=dataclasses.replace(cfg.gemm1, narrow_tiles=2), gemm2=dataclasses.replace(cfg.gemm2, narrow_tiles=2)
    )
    joined = ab_moe.gemm_variant(cfg, "gemms:narrow_tiles=2+gemm1:num_stages=3/chunks_per_stage=1+gemm2:num_stages=2")
    assert joined == dataclasses.replace(
        both,
        gemm1=dataclasses.replace(both.gemm1, num_stages=3, chunks_per_stage=1),
        gemm2=dataclasses.replace(both.gemm2, num_stages=2),
    )


PARAM_LOAD = re.compile(r"ld\.param\.\w+\s+%\w+, \[(\w+)_param_(\d+)\]")


def _loaded_params(ptx: str) -> set[str]:
    return {n for _, n in PARAM_LOAD.findall(ptx)}


@pytest.mark.parametrize("family", ["triton", "gluon"])
def test_epilogue_variants_compile_to_what_they_need(family: str) -> None:
    """common.Epilogue's constexprs decide at compile time: a non-gated GEMM1 (relu2) streams one matrix (the
    Gluon kernel: one TMA box of values and one of scales per stage, half the expect-tx bytes, one wgmma per chunk),
    a bias adds one pointer parameter and loads it; every variant leaves the rest of the kernel as it is (same
    parameters, same PDL protocol)."""

    def build(gated: bool, fields: tuple) -> str:
        if family == "triton":
            return _compile("gemm1" if gated else "gemm2", True, aligned=True, epilogue=fields).asm["ptx"]
        return _compile_ws(gated, 64, 4, 128, 2, epilogue=fields)["ptx"]

    def params(ptx: str) -> int:  # declared by the entry (a TMA descriptor is one 128-byte parameter)
        entry = ptx.index(".entry")
        return len(re.findall(r"_param_\d+\b", ptx[entry : ptx.index(")", entry)]))

    silu = build(True, DEFAULT_EPILOGUE[True])
    relu2 = build(True, (False, "relu2", None, None, False))
    swiglu_bias = build(True, (True, "swiglu_oai", 1.702, 7.0, True))
    gemm2 = build(False, DEFAULT_EPILOGUE[False])
    gemm2_bias = build(False, (True, None, None, None, False))
    wgmma = re.compile(r"wgmma\.mma_async")
    assert len(wgmma.findall(relu2)) * 2 == len(wgmma.findall(silu)) > 0
    if family == "gluon":
        boxes = re.compile(r"cp\.async\.bulk\.tensor\.4d")
        assert len(boxes.findall(relu2)) * 2 == len(boxes.findall(silu)) == 4
        assert re.search(r"expect_tx\.shared\.b64 _, \[%r\d+\], 9216;", relu2)  # 2 chunks x (4096 + 512)
    assert params(relu2) == params(silu) and params(swiglu_bias) == params(silu) + 1
    assert params(gemm2_bias) == params(gemm2) + 1
    bias_param = str(params(silu) - 2)  # after the kernel's own parameters come Triton's two scratch pointers
    assert bias_param in _loaded_params(swiglu_bias) and bias_param not in _loaded_params(silu)
    for ptx in (relu2, swiglu_bias, gemm2_bias):
        assert "griddepcontrol.wait" in ptx and ".local" not in ptx
    # the activations' clamps keep NaN (a NaN token stays NaN, as in the torch reference): min/max.NaN, never plain
    plain = re.compile(r"\b(min|max)\.(xorsign\.abs\.)?f32")  # returns the other operand where one is NaN
    assert re.search(r"max\.NaN\.f32", relu2) and not plain.search(relu2)
    assert re.search(r"min\.NaN\.f32", swiglu_bias) and re.search(r"min\.NaN\.xorsign\.abs\.f32", swiglu_bias)
    assert not plain.search(swiglu_bias)


def test_ab_moe_reports_a_failed_case_and_keeps_the_rest(tmp_path, monkeypatch, capsys) -> None:
    """tools/ab_moe.py on a batch: a case that fails (here out of GPU memory) is named with its error and the exit
    status is 1, the other cases still run, and each case's rows reach --out as it ends."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import ab_moe

    def run_case(model, tokens, variants, modules, rounds, draw):
        if model == "kimi-k2":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 42.00 GiB")
        return [dict(model=model, tokens=tokens, variant="shipped", median_us=1.0, min_us=1.0, max_us=1.0, draw=draw)]

    monkeypatch.setattr(ab_moe, "run_case", run_case)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    out = tmp_path / "rows.jsonl"
    cases = "qwen3-30b-a3b:64,kimi-k2:4096,olmoe:16"
    monkeypatch.setattr(sys, "argv", ["ab_moe.py", "--cases", cases, "--out", str(out)])
    assert ab_moe.main() == 1
    printed = capsys.readouterr()
    assert "kimi-k2:4096 (draw 0): OutOfMemoryError: CUDA out of memory" in printed.out
    assert [json.loads(line)["model"] for line in out.read_text().splitlines()] == ["qwen3-30b-a3b", "olmoe"]
    assert "skipped" in next(line for line in printed.out.splitlines() if line.startswith("kimi-k2:4096"))


def test_ab_moe_table_averages_the_draws_of_an_expert_parallel_case() -> None:
    """tools/ab_moe.py's table: one draw shows its median and range over rounds; several draws of a routing show
    the mean of their medians, their range and each draw's local pairs; a variant a case skipped says so."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import ab_moe

    def row(model, tokens, variant, median, draw=0, pairs=4):
        return dict(
            model=model,
            tokens=tokens,
            variant=variant,
            median_us=median,
            min_us=median - 1,
            max_us=median + 1,
            draw=draw,
            local_pairs=pairs,
        )

    rows = [
        row("qwen3-30b-a3b", 1, "shipped", 14.0),
        row("qwen3-30b-a3b", 1, "x", 13.0),
        row("dbrx-ep2", 1, "shipped", 80.0, 0, 2),
        row("dbrx-ep2", 1, "x", 60.0, 0, 2),
        row("dbrx-ep2", 1, "shipped", 4.0, 1, 0),
        row("dbrx-ep2", 1, "x", 6.0, 1, 0),
    ]
    header, one, two = ab_moe.table(rows, ["qwen3-30b-a3b:1", "dbrx-ep2:1"], ["shipped", "x", "gemms:block_n=64"])
    assert one.split()[1:] == ["14.0", "(13.0-15.0)", "13.0", "(12.0-14.0)", "skipped"], one
    assert two.split()[1:7] == ["42.0", "(4.0-80.0)", "33.0", "(6.0-60.0)", "skipped", "local"], two
    assert two.endswith("local pairs by draw [2, 0]"), two


def _shipped_gluon_gemms() -> dict[tuple, str]:
    """Every warp-specialized GEMM the default configs choose on the zoo's gated shapes and ranks at 1-4096
    tokens: _compile_ws's arguments -> the first (shape, T) that chose it."""
    from moe_nvfp4.sm90.default_config import default_config
    from moe_nvfp4.zoo import zoo_shapes

    seen: dict[tuple, str] = {}
    for s in zoo_shapes():
        if not s.activation.gated:
            continue
        for t in (1, 2, 4, 16, 64, 256, 1024, 4096):
            cfg = default_config(t, s.experts, s.top_k, s.hidden, s.intermediate)
            for gated, g in ((True, cfg.gemm1), (False, cfg.gemm2)):
                if g.warp_specialized:
                    key = (gated, g.block_n, g.num_warps, g.max_registers, g.chunks_per_stage, g.k_groups)
                    key += (g.num_stages, cfg.block_m, g.narrow_tiles, g.loader_warps, cfg.pair_tiles)
                    seen.setdefault(key, f"{s.key}:{t}")
    return seen


@pytest.mark.slow
def test_shipped_gluon_gemms_keep_their_wgmmas_in_flight() -> None:
    """No default config's Gluon GEMM is one ptxas serializes (C7512: too few registers; C7514: sums read while
    their MMA runs): the Gluon presets once timed at prefill were, every HGMMA of GEMM1 then followed by a wait for
    all (prefill_probes_2026-11-29/gluon_w4a16_ptxas_scan.md), and their timings measured that."""
    shipped = _shipped_gluon_gemms()
    assert len(shipped) >= 20, shipped  # decode, two-group and prefill families across the zoo
    serialized = {}
    for key, where in shipped.items():
        gated, block_n, warps, maxnreg, chunks, k_groups, stages, block_m, narrow, loader_warps, pair_tiles = key
        ptx = _compile_ws(
            gated,
            block_n,
            warps,
            maxnreg,
            chunks=chunks,
            k_groups=k_groups,
            stages=stages,
            block_m=block_m,
            narrow=narrow,
            loader_warps=loader_warps,
            pair_tiles=pair_tiles,
        )["ptx"]
        codes = set(re.findall(r"\((C751[24])\)", _ptxas_info(ptx)))
        if codes:
            serialized[where] = (key, sorted(codes))
    assert not serialized, serialized


def test_ab_moe_config_variants() -> None:
    """tools/ab_moe.py's W4A16 variants of the tuned config: ``at=T`` is what the selector picks for the same layer at
    T tokens (Kimi-K2 at 2560 tokens timed with the 128-token prefill tiles of 16384), ``tile=N`` the config at
    another token tile, ``gemm2:...`` one GEMM's fields, a field name that field flipped."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    import ab_moe

    from moe_nvfp4.sm90.default_config import default_config

    def select_at(tokens: int):
        return default_config(tokens, 384, 8, 7168, 2048)

    cfg = select_at(2560)
    assert cfg.block_m == 64
    prefill = ab_moe.config_variant(cfg, "at=16384", select_at)
    assert prefill == select_at(16384) and prefill.block_m == 128 and not prefill.gemm1.warp_specialized
    wider = ab_moe.config_variant(cfg, "tile=128", select_at)
    assert wider.block_m == 128 and wider.gemm1 == cfg.gemm1.narrowed_for(128)
    assert ab_moe.config_variant(cfg, "gemm2:num_stages=2", select_at).gemm2.num_stages == 2
    flipped = ab_moe.config_variant(cfg, "partials_in_x_dtype", select_at)
    assert flipped.partials_in_x_dtype is not cfg.partials_in_x_dtype
    joined = ab_moe.config_variant(cfg, "at=16384+gemms:narrow_tiles=1", select_at)
    assert joined.block_m == 128 and joined.gemm1.narrow_tiles == joined.gemm2.narrow_tiles == 1
    assert joined.gemm1.block_n == prefill.gemm1.block_n
