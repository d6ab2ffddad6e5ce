"""W4A4 grouped GEMM (moe_nvfp4.grouped_gemm_nvfp4): the Triton kernel under the interpreter against the
reference.  Bounds: where every product and sum is exact in float32 (helpers_w4a4.exact_groups), fp16 output
bit for bit and bf16 output within one bf16 ulp (the interpreter truncates float32 -> bf16; the GPU tier
checks bf16 bit for bit); on quantized random data ||out - ref|| / ||ref|| < 2e-3 (fp16) or 8e-3 (bf16,
truncated), from output rounding and float32 sums in another order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import moe_nvfp4 as m

TESTS = Path(__file__).resolve().parent
REL_TOL = {"float16": 2e-3, "bfloat16": 8e-3}
# ragged M (one empty group), N not a multiple of the tile, K with a masked tail (48, 272) and per group
SIZES = [(37, 48, 48), (0, 64, 128), (130, 80, 272), (5, 130, 64)]
# every K a multiple of the default block_k: no K masks (the kernel's EVEN_K path)
EVEN_K_SIZES = [(37, 48, 64), (0, 64, 128), (130, 80, 192), (5, 130, 64)]

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, moe_nvfp4 as m
    from helpers_w4a4 import exact_groups, random_groups
    sizes, seed, out_dtype = json.loads(sys.argv[1]), int(sys.argv[2]), getattr(torch, sys.argv[3])
    a, b, alpha = exact_groups(sizes, seed)
    got = m.grouped_gemm_nvfp4(a, b, alpha=alpha, out_dtype=out_dtype)
    ref = m.grouped_gemm_nvfp4_torch(a, b, alpha=alpha, out_dtype=out_dtype)
    if out_dtype == torch.float16:
        exact = [bool(torch.equal(x, y)) for x, y in zip(got, ref)]
    else:  # the interpreter truncates float32 -> bf16 (no round to nearest): within one bf16 ulp (2^-7 relative)
        exact = [bool(((x.float() - y.float()).abs() <= y.float().abs() * 2.0**-7).all()) for x, y in zip(got, ref)]
    shapes = [list(x.shape) == list(y.shape) and x.dtype == y.dtype for x, y in zip(got, ref)]
    # a plan launched again after new A values and scales are written into the tensors it holds
    plan = m.plan_grouped_gemm_nvfp4(a, b, alpha=alpha, out_dtype=out_dtype)
    a2, _, _ = exact_groups(sizes, seed + 2)
    for packed, scales, new in zip(plan.inputs[0], plan.inputs[1], a2):
        packed.copy_(new.packed)
        scales.copy_(new.swizzled_scales().block_scale)
    m.launch_grouped_gemm_nvfp4(plan)
    ref2 = m.grouped_gemm_nvfp4_torch(a2, b, alpha=alpha, out_dtype=out_dtype)
    replanned = [bool((x.float() - y.float()).abs().le(y.float().abs() * 2.0**-7).all()) for x, y in zip(plan.outs, ref2)]
    a, b = random_groups(sizes, seed + 1)
    got = m.grouped_gemm_nvfp4(a, b, out_dtype=out_dtype)
    ref = m.grouped_gemm_nvfp4_torch(a, b, out_dtype=out_dtype)
    errs = [((x.float() - y.float()).norm() / y.float().norm().clamp_min(1e-30)).item() for x, y in zip(got, ref) if y.numel()]
    print(json.dumps(dict(exact=exact, shapes=shapes, errs=errs, replanned=replanned)))
    """
)

DECODE_SCRIPT = textwrap.dedent(
    """
    import torch, triton, triton.language as tl, moe_nvfp4 as m
    from moe_nvfp4.triton.grouped_w4a4 import _decode_portable, _scale_words

    @triton.jit
    def decode(bytes_ptr, scale_ptr, lo_ptr, hi_ptr, ROWS: tl.constexpr, BYTES: tl.constexpr):
        o = tl.arange(0, ROWS)[:, None] * BYTES + tl.arange(0, BYTES)[None, :]
        scales = _scale_words(tl.load(scale_ptr + o).to(tl.uint32))
        lo, hi = _decode_portable(tl.load(bytes_ptr + o), scales, ROWS, BYTES)
        tl.store(lo_ptr + o, lo.to(tl.float32))
        tl.store(hi_ptr + o, hi.to(tl.float32))

    # every packed byte (low and high nibble: all 16 codes each) with every positive e4m3 byte (0x7f is NaN)
    packed = torch.arange(256, dtype=torch.uint8).repeat(128)
    scale = torch.arange(128, dtype=torch.uint8).repeat_interleave(256)
    lo, hi = torch.empty(packed.shape), torch.empty(packed.shape)
    decode[(1,)](packed, scale, lo, hi, 1024, 32)
    values = m.formats.decode_e2m1(m.formats.unpack_fp4(packed)).reshape(-1, 2)
    want = values * scale.view(torch.float8_e4m3fn).float()[:, None] * 2.0**-7
    finite = scale < 127
    print(torch.equal(lo[finite], want[finite, 0]), torch.equal(hi[finite], want[finite, 1]))
    """
)


@pytest.mark.slow
def test_decode_covers_every_code_and_scale_byte() -> None:
    """The plain-Triton twin of the decode PTX: all 16 e2m1 codes in both nibbles times all 127 finite positive
    e4m3 scale bytes (subnormals included) give code * scale * 2^-7 exactly."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", DECODE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "True"]


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [SIZES, EVEN_K_SIZES], ids=["k_tail", "even_k"])
@pytest.mark.parametrize("out_dtype", ["float16", "bfloat16"])
def test_triton_kernel_matches_the_reference(out_dtype: str, sizes: list, seed: int) -> None:
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        MOE_NVFP4_BACKEND="triton",
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(sizes), str(seed % 2**31), out_dtype],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(result["shapes"]) and all(result["exact"]) and all(result["replanned"]), result
    assert len(result["errs"]) == 3 and max(result["errs"]) < REL_TOL[out_dtype], result


CONFIG_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, moe_nvfp4 as m
    from helpers_w4a4 import exact_groups
    from moe_nvfp4.triton.grouped_w4a4 import plan_grouped_w4a4
    sizes, seed, config = json.loads(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    a, b, alpha = exact_groups(sizes, seed)
    default = m.plan_grouped_gemm_nvfp4(a, b, alpha=alpha, out_dtype=torch.float16)
    plan = plan_grouped_w4a4(*default.inputs, default.alpha, torch.float16, **config)
    got = m.launch_grouped_gemm_nvfp4(plan)
    ref = m.grouped_gemm_nvfp4_torch(a, b, alpha=alpha, out_dtype=torch.float16)
    print(json.dumps([bool(torch.equal(x, y)) for x, y in zip(got, ref)]))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [SIZES, EVEN_K_SIZES], ids=["k_tail", "even_k"])
@pytest.mark.parametrize(
    "config",
    [
        dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=2),
        dict(block_m=64, block_n=256, block_k=64, num_warps=4, num_stages=3),
    ],
)
def test_other_tile_configs_are_exact(config: dict, sizes: list, seed: int) -> None:
    """Tiles other than the default (two scale words per row at block_k 128; 256 rows of B, past one 128-row
    scale block) are bit exact too: fp16 out, exact data."""
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        MOE_NVFP4_BACKEND="triton",
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", CONFIG_SCRIPT, json.dumps(sizes), str(seed % 2**31), json.dumps(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_cpu_path_is_the_reference() -> None:
    sys.path.insert(0, str(TESTS))
    from helpers_w4a4 import exact_groups

    a, b, alpha = exact_groups([(3, 16, 32), (4, 8, 48)], seed=1)
    got = m.grouped_gemm_nvfp4(a, b, alpha=alpha)
    ref = m.grouped_gemm_nvfp4_torch(a, b, alpha=alpha)
    assert all(torch.equal(x, y) for x, y in zip(got, ref))


def _operand(rows: int, k: int) -> m.NVFP4Tensor:
    return m.quantize_nvfp4(torch.ones(rows, k))


@pytest.mark.parametrize(
    "a,b,kwargs,error,match",
    [
        ([], [], {}, ValueError, "at least one group"),
        ([_operand(4, 32)], [_operand(8, 48)], {}, ValueError, "group 0: A has K=32, B has K=48"),
        ([_operand(4, 32)], [_operand(8, 32)], {"out_dtype": torch.float32}, TypeError, "float16 or bfloat16"),
        ([_operand(4, 32)], [_operand(8, 32)], {"alpha": torch.ones(2)}, ValueError, r"alpha must be float32 \[1\]"),
        ([m.quantize_nvfp4(torch.ones(2, 4, 32))], [_operand(8, 32)], {}, ValueError, "group 0: A must be one packed"),
    ],
)
def test_bad_inputs_fail_before_any_kernel(a, b, kwargs, error, match) -> None:
    with pytest.raises(error, match=match):
        m.grouped_gemm_nvfp4(a, b, **kwargs)


@pytest.mark.parametrize(("rows", "expected"), [(128, 128), (128 * 8, 128), (128 * 9, 256)])
def test_wide_tiles_only_past_four_waves(rows: int, expected: int) -> None:
    """block_n=None picks 256 only when 128-wide tiles exceed WIDE_TILE_WAVES waves (2 'SMs' on the CPU: 8
    tiles); the measured H200 trade-off is in plan_grouped_w4a4's docstring."""
    sys.path.insert(0, str(TESTS))
    from helpers_w4a4 import exact_groups

    from moe_nvfp4.triton.grouped_w4a4 import WIDE_TILE_WAVES, plan_grouped_w4a4

    assert WIDE_TILE_WAVES == 4
    a, b, alpha = exact_groups([(rows, 128, 64)], seed=0)
    default = m.plan_grouped_gemm_nvfp4(a, b, alpha=alpha, out_dtype=torch.float16)
    plan = plan_grouped_w4a4(*default.inputs, default.alpha, torch.float16)
    assert (plan.block_n, default.block_n) == (expected, expected)


def test_capability_switch_picks_the_cute_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where dispatch picks cute for the grouped GEMM (sm_100/sm_103) the API plans for the CuTe DSL kernel, with the same operands
    and alpha the Triton plan gets, and launches that plan through its own launcher."""
    sys.path.insert(0, str(TESTS))
    import moe_nvfp4.grouped_gemm as grouped_gemm
    import moe_nvfp4.cute.host as cute_host
    from helpers_w4a4 import exact_groups

    a, b, alpha = exact_groups([(37, 48, 64), (5, 130, 128)], seed=0)
    triton_plan = m.plan_grouped_gemm_nvfp4(a, b, alpha=alpha, out_dtype=torch.bfloat16)
    from moe_nvfp4.dispatch import _select

    monkeypatch.setattr(grouped_gemm, "select_backends", lambda device: _select("sm_100", None))
    plan = m.plan_grouped_gemm_nvfp4(a, b, alpha=alpha, out_dtype=torch.bfloat16)
    assert isinstance(plan, cute_host.GroupedW4A4Sm100Plan)
    assert plan.variant.out_dtype == torch.bfloat16
    assert torch.equal(plan.alpha, triton_plan.alpha)
    for ours, theirs in zip(plan.inputs, triton_plan.inputs):
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(ours, theirs))
    launched = []
    monkeypatch.setattr(cute_host, "launch_grouped_w4a4_sm100", lambda p: launched.append(p) or p.outs)
    assert m.launch_grouped_gemm_nvfp4(plan) is plan.outs and launched == [plan]
