"""The W4A8 mode (sm90.w4a8, sm90.gemm_fp8) under the Triton interpreter on CPU, tiny shapes, and its folding and row
quantization on their own.

Bounds: the kernels against the pure-torch twin (same e4m3 operands, float32 sums) ||out - twin|| / ||twin|| < 5e-3
(GEMM1's output rounds to x's dtype before its e4m3 rounding, so a sum differing in its last bit can move a code);
the twin against the float64 W4A16 reference < 1e-1 (design 008 measured 5.2-6.0e-2 for folded scales on every zoo
layer; these tiny layers with 16 K-blocks are noisier).  The row quantizer equals its twin byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from moe_nvfp4 import prepare_moe_weights, quantize_nvfp4
from moe_nvfp4.formats import dequantize_nvfp4
from moe_nvfp4.sm90.w4a8 import Fp8Config, fold_to_fp8, fp8_copy_bytes, fused_moe_w4a8_torch, quantize_rows_fp8_torch

SCRIPT = textwrap.dedent(
    """
    import sys, torch, moe_nvfp4 as m
    from moe_nvfp4.expert_activation import ExpertActivation
    from moe_nvfp4.sm90.w4a8 import (Fp8Config, fold_to_fp8, fused_moe_w4a8, fused_moe_w4a8_torch,
                                     quantize_rows_fp8, quantize_rows_fp8_torch)
    e, k, h, i, t, use_map, act, bias, block_m, nan_row, seed = sys.argv[1:]
    e, k, h, i, t, use_map, bias, block_m, nan_row, seed = map(int, (e, k, h, i, t, use_map, bias, block_m, nan_row, seed))
    activation = ExpertActivation(act)
    g = torch.Generator().manual_seed(seed)
    rows13 = 2 * i if activation.gated else i
    w13 = torch.randn(e, rows13, h, generator=g) / h**0.5
    w13[..., :16] = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -1.5, -2, -3, -4, -6, 6]) / 6  # every code
    q13 = m.quantize_nvfp4(w13, segments=2 if activation.gated else 1)
    q2 = m.quantize_nvfp4(torch.randn(e, h, i, generator=g) / i**0.5)
    biases = dict(w13_bias=torch.randn(e, rows13, generator=g) * 0.1, w2_bias=torch.randn(e, h, generator=g) * 0.1) if bias else {}
    w = m.prepare_moe_weights(q13, q2, activation=activation, **biases)
    x = torch.randn(t, h, generator=g).half()
    n_global = e + 2 if use_map else e
    logits = torch.randn(t, n_global, generator=g)
    logits[:, 1] -= 100.0  # expert 1 (global) gets no token
    tw, ti = m.topk_softmax(logits, k, renormalize=True)
    emap = torch.tensor([-1] + list(range(e)) + [-1], dtype=torch.int32) if use_map else None
    if nan_row:
        x[nan_row - 1, 3] = float("nan")
    a8, s = quantize_rows_fp8(x)
    b8, s_twin = quantize_rows_fp8_torch(x)
    ok = ~x.isnan().any(dim=1)
    assert torch.equal(a8.view(torch.uint8)[ok], b8.view(torch.uint8)[ok]) and torch.equal(s[ok], s_twin[ok])
    # gathered into a pair order: rows r < count are token src[r] // k's, bytes and scale
    src = torch.randperm(t * k, generator=g).int()
    n = max(1, t * k - 3)  # the routed count: the rows past it stay unwritten
    g8, gs = quantize_rows_fp8(x, src=src, top_k=k, count=torch.tensor([n], dtype=torch.int32))
    tok = src[:n].long() // k
    assert torch.equal(g8.view(torch.uint8)[:n], a8.view(torch.uint8)[tok])
    torch.testing.assert_close(gs[:n], s[tok], rtol=0, atol=0, equal_nan=True)
    f = fold_to_fp8(w)
    out = torch.full_like(x, float("nan"))
    out = fused_moe_w4a8(x, f, tw, ti, emap, Fp8Config(block_m, 64, 2, warp_specialized=False))
    twin = fused_moe_w4a8_torch(x, f, tw, ti, emap)
    ref = m.fused_moe_torch(x, q13, q2, tw, ti, expert_map=emap, activation=activation, compute_dtype=torch.float64, **biases)
    if nan_row:  # that token is NaN, every other one finite and as without it
        assert out[nan_row - 1].isnan().all(), out[nan_row - 1]
        keep = torch.arange(t) != nan_row - 1
        out, twin, ref = out[keep], twin[keep], ref[keep]
    assert not out.isnan().any(), "unwritten or NaN output"
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item() if t else 0.0
    print(rel(out, twin), rel(twin, ref))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "e,k,h,i,t,use_map,act,bias,block_m,nan_row",
    [
        pytest.param(4, 2, 256, 128, 9, 0, "silu", 0, 16, 0, id="basic"),
        pytest.param(5, 3, 144, 48, 13, 0, "silu", 0, 16, 0, id="K tails: H=144, I=48"),
        pytest.param(6, 2, 128, 128, 11, 1, "silu", 0, 32, 0, id="expert map, an expert with no token"),
        pytest.param(4, 2, 128, 64, 40, 0, "silu", 0, 16, 0, id="ragged: several tiles an expert"),
        pytest.param(3, 2, 128, 128, 1, 0, "silu", 0, 16, 0, id="one token"),
        pytest.param(3, 2, 128, 128, 0, 0, "silu", 0, 16, 0, id="no tokens"),
        pytest.param(4, 2, 128, 96, 7, 0, "relu2", 1, 16, 0, id="relu2, not gated, biases"),
        pytest.param(4, 2, 128, 64, 7, 1, "swiglu_oai", 1, 16, 0, id="swiglu_oai, biases, expert map"),
        pytest.param(4, 2, 128, 64, 6, 0, "silu", 0, 16, 3, id="a NaN in token 3"),
    ],
)
def test_w4a8_matches_twin_and_reference(e, k, h, i, t, use_map, act, bias, block_m, nan_row) -> None:
    args = [e, k, h, i, t, use_map, act, bias, block_m, nan_row, 0]
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *map(str, args)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    to_twin, to_ref = map(float, proc.stdout.split())
    assert to_twin < 5e-3 and to_ref < 1e-1, (to_twin, to_ref)


def test_fold_rounds_each_weight_once_to_e4m3() -> None:
    """Each folded value is code x block scale x global scale / 2^p to the nearest e4m3 (relative error <= 2^-4,
    3 mantissa bits; exact where the product fits), 2^p a power of two per row putting its amax in [224, 448];
    padding dropped; the copy's size is what fp8_copy_bytes says."""
    g = torch.Generator().manual_seed(1)
    e, h, i = 3, 144, 80  # rows and K padded in the layout
    q13 = quantize_nvfp4(torch.randn(e, 2 * i, h, generator=g) * torch.logspace(-3, 1, h)[None, None], segments=2)
    q2 = quantize_nvfp4(torch.randn(e, h, i, generator=g))
    w = prepare_moe_weights(q13, q2)
    f = fold_to_fp8(w)
    from_checkpoint = fold_to_fp8(w, (q13, q2))  # the checkpoint's tensors: no layout unpacking, the same bytes
    for a, b in ((f.w13, from_checkpoint.w13), (f.w2, from_checkpoint.w2)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(f.w13_scale, from_checkpoint.w13_scale) and torch.equal(f.w2_scale, from_checkpoint.w2_scale)
    assert f.w13.shape == (e, 2 * 128, h) and f.w2.shape == (e, h, i) and f.nbytes() == fp8_copy_bytes(w)
    # interleaved: 64 gate rows, their 64 up rows, then the next 16 outputs' gate and up rows and 48 zero rows each
    w13, w13_scale = f.w13_rows()
    assert torch.equal(f.w13[:, 64:80].view(torch.uint8), w13[:, 80:96].view(torch.uint8))
    assert (f.w13[:, 144:192].view(torch.uint8) == 0).all() and (f.w13[:, 208:].view(torch.uint8) == 0).all()
    for q, w8, scale in ((q13, w13, w13_scale), (q2, f.w2, f.w2_scale)):
        exact = dequantize_nvfp4(q)
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two
        folded = w8.float() * scale[..., None]
        amax = (w8.float().abs()).amax(dim=-1)
        assert ((amax >= 224) & (amax <= 448)).all()
        err = (folded - exact).abs()
        normal = exact.abs() >= scale[..., None] * 2.0**-6  # e4m3 normals: the relative bound holds
        assert (err[normal] <= exact.abs()[normal] * 2.0**-4).all()
        assert (err[~normal] <= scale[..., None].expand_as(err)[~normal] * 2.0**-10).all()  # half a subnormal step
        assert (err > 0).any() and (err == 0).any()  # rounded where the product needs more bits, exact elsewhere


def test_row_quantizer_twin_keeps_zero_rows_and_range() -> None:
    x = torch.randn(5, 64, dtype=torch.float16)
    x[2] = 0
    q, scale = quantize_rows_fp8_torch(x)
    assert scale[2] == 0 and (q[2].float() == 0).all()
    assert torch.equal(q.float().abs().amax(dim=1)[[0, 1, 3, 4]], torch.full((4,), 448.0))
    assert (
        (q.float() * scale[:, None] - x.float()).abs() <= x.float().abs() * 2.0**-4 + scale[:, None] * 2.0**-10
    ).all()


def test_fp8_config_is_validated() -> None:
    with pytest.raises(ValueError, match="Fp8Config.block_k"):
        Fp8Config(block_k=96)
    with pytest.raises(ValueError, match="Fp8Config.num_stages"):
        Fp8Config(num_stages=9)
    with pytest.raises(ValueError, match="warp_specialized takes 32 <= block_m <= 128"):
        Fp8Config(block_m=16, warp_specialized=True)
    with pytest.raises(ValueError, match="warp_specialized takes 32 <= block_m <= 128"):
        Fp8Config(block_m=256, warp_specialized=True)
    with pytest.raises(ValueError, match="num_stages >= 2"):  # a group holds two stages: one would deadlock
        Fp8Config(num_stages=1)
    assert Fp8Config(block_m=16, warp_specialized=False).block_m == 16
    assert Fp8Config().launcher(on_gpu=True).__name__ == "launch_fp8_ws"  # what the mode runs
    assert Fp8Config(block_m=64).launcher(on_gpu=False).__name__ == "launch_fp8_gemm"  # the interpreter's


@pytest.mark.slow
@pytest.mark.parametrize(
    "gated,block_m,block_k,stages,panel",
    [
        (True, 128, 128, 4, 0),
        (False, 32, 64, 4, 0),
        (True, 64, 128, 6, 0),
        (False, 128, 128, 3, 0),
        (False, 128, 128, 4, 6),
    ],
)
def test_warp_specialized_kernel_compiles_for_sm90(gated, block_m, block_k, stages, panel) -> None:
    """The Gluon kernel (gemm_fp8_ws) for sm_90a on the CPU: FP8 wgmma of 64 weight rows by each group's half of the
    token rows, two TMA boxes a stage, the register budgets of the second MMA warp group and the loader, no spills
    under ptxas (maxnreg 168), and no MMA that ptxas serializes (C7514: the sums read while MMAs are in flight)."""
    import re

    import triton
    from test_sm90_ptx import DEFAULT_EPILOGUE, _divisibility, _epilogue, _ptxas_info
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from moe_nvfp4.sm90 import gemm_fp8_ws as W

    def descriptor(rows: int, block: list[int]):
        t = torch.zeros(rows, 1024, dtype=torch.float8_e4m3fn)
        d = TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv))
        return native_specialize_impl(CUDABackend, d, False, True, True)[0]

    signature = dict(
        a_desc=descriptor(512, [block_m, block_k]),
        a_scale_ptr="*fp32",
        w_desc=descriptor(2048, [128, block_k]),
        w_scale_ptr="*fp32",
        out_ptr="*bf16" if gated else "*fp32",
        stride_out="i32",
        sorted_pairs_ptr="*i32",
        tile_expert_ptr="*i32",
        tile_row_ptr="*i32",
        tile_row_end_ptr="*i32",
        num_tiles_ptr="*i32",
        n_out="i32",
        n_rows="i32",
        k="i32",
        epilogue=None,
    )
    chunk_n = 4 if panel else 0  # GEMM2 of Qwen3-30B-A3B: K = 768 in 6 steps kept, 16 weight tiles in units of 4
    constexprs = dict(
        IS_GEMM1=gated, BLOCK_M=block_m, BLOCK_K=block_k, STAGES=stages, PANEL=panel, CHUNK_N=chunk_n, PDL=True
    )
    assert list(signature) + list(constexprs) == W._fp8_ws_kernel.arg_names, "test signature out of date"
    signature["epilogue"], paths = _epilogue(W._fp8_ws_kernel, DEFAULT_EPILOGUE[gated])
    src = GluonASTSource(
        W._fp8_ws_kernel,
        dict(signature, **{c: "constexpr" for c in constexprs}),
        {**constexprs, **paths},
        _divisibility(signature),
    )
    options = dict(launch_pdl=True, num_warps=4, maxnreg=168)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    assert f"wgmma.mma_async.sync.aligned.m64n{block_m // 2}k32.f32.e4m3.e4m3" in ptx
    assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx)) == 2  # the loader's two boxes (a stage's, or the panel's)
    budgets = set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))
    assert {str(W.MMA_REGISTERS.value), str(W.LOADER_REGISTERS.value)} <= budgets
    info = _ptxas_info(ptx)
    assert "0 bytes spill stores" in info and "0 bytes spill loads" in info, info
    assert "C7514" not in info and "C7517" not in info, info  # no MMA serialized by a read of its sums in flight


@pytest.mark.slow
def test_accuracy_kernels_tool_under_the_interpreter() -> None:
    """tools/accuracy_kernels.py's measurement on a tiny layer (fp16: the interpreter's bf16 dot is wrong): every form
    runs and lands where its bound says (W4A16 2e-3 as tests/test_kernel_interpreter.py, W4A8 1e-1)."""
    code = textwrap.dedent(
        """
        import sys, json, torch
        sys.path.insert(0, "tools")
        import accuracy_kernels as a
        from moe_nvfp4.expert_activation import ExpertActivation
        rows = a.measure("tiny", 4, 2, 128, 64, ExpertActivation("silu"), 9, torch.float16, "cpu", 0)
        print(json.dumps(rows))
        """
    )
    env = dict(os.environ, TRITON_INTERPRET="1", MOE_NVFP4_BACKEND="triton")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(rows) == 2
    for row in rows:
        assert row["w4a16"] < 2e-3, row
        assert all(row[form] < 1e-1 for form in ("w4a8_triton", "w4a8_gluon")), row


def _api_layer(e: int, k: int, h: int, i: int, t: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    import moe_nvfp4 as m

    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w13[..., :16] = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6]) / 6  # every code
    q13, q2 = m.quantize_nvfp4(w13, segments=2), m.quantize_nvfp4(torch.randn(e, h, i, generator=g) / i**0.5)
    w = m.prepare_moe_weights(q13, q2)
    x = torch.randn(t, h, generator=g).to(dtype)
    tw, ti = m.topk_softmax(torch.randn(t, e, generator=g), k, renormalize=True)
    return w, (q13, q2), x, tw, ti


def test_fp8_pays_at_the_rows_an_expert_expects_and_eagerly_at_the_work() -> None:
    """Captured into a CUDA graph: from FP8_MIN_ROWS_PER_EXPERT rows an expert (global experts).  Eager: also from
    FP8_MIN_EAGER_FLOPS of the rank's expected work (its local share under an expert map), so a small layer stays
    W4A16 where a large one at the same rows runs W4A8.  Never with the router weight on the input."""
    from moe_nvfp4.dispatch import choose_as_captured, host_cost_counts
    from moe_nvfp4.shapes import LayerShape
    from moe_nvfp4.sm90.w4a8 import FP8_MIN_EAGER_FLOPS, FP8_MIN_ROWS_PER_EXPERT, expected_flops, fp8_pays

    rows = FP8_MIN_ROWS_PER_EXPERT
    small = LayerShape(8, 2, 256, 128)
    first = rows * 8 // 2
    assert fp8_pays(first, small, False, eager=False) and not fp8_pays(first - 1, small, False, eager=False)
    assert not fp8_pays(first, small, False, eager=True)  # 0.1 GFLOP: host-bound eagerly
    assert not fp8_pays(10**6, LayerShape(8, 1, 4096, 14336), True, eager=False)  # the router weight on the input
    assert not fp8_pays(rows, LayerShape(1, 1, 256, 128, global_experts=2), False, eager=False)  # global experts
    qwen3 = LayerShape(128, 8, 2048, 768)  # 75.5 MFLOP a token: 200 GFLOP at 2650 tokens
    assert expected_flops(1, qwen3) == 2 * 8 * 2048 * 768 * 3
    assert fp8_pays(1280, qwen3, False, eager=False) and not fp8_pays(2560, qwen3, False, eager=True)
    assert fp8_pays(2650, qwen3, False, eager=True)
    ep = LayerShape(32, 8, 2048, 768, global_experts=128)  # a quarter of the experts: a quarter of the work
    assert expected_flops(4096, ep) == expected_flops(1024, qwen3)
    assert not fp8_pays(8192, ep, False, eager=True) and fp8_pays(4 * 2650, ep, False, eager=True)
    gelu = LayerShape(128, 8, 2048, 768, gated=False)  # GEMM1 of I rows, not 2I
    assert expected_flops(3, gelu) == expected_flops(2, qwen3) and FP8_MIN_EAGER_FLOPS > 0
    x = torch.zeros(4, 8)
    with choose_as_captured():  # the warm-up's and the bench's forwards choose as a capture does
        assert not host_cost_counts(x)
    assert host_cost_counts(x)


@pytest.fixture
def eager_w4a8(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager forwards run W4A8 from the rows bound alone (the test layers are far under FP8_MIN_EAGER_FLOPS)."""
    from moe_nvfp4.sm90 import w4a8

    monkeypatch.setattr(w4a8, "FP8_MIN_EAGER_FLOPS", 0.0)


def test_fused_moe_with_fp8_weights_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """api.fused_moe(..., fp8_weights=) on CPU tensors (the torch backend), eager: this small layer stays W4A16 under
    the shipped work bound; with it at zero, the W4A8 twin where each expert expects FP8_MIN_ROWS_PER_EXPERT rows, bit
    for bit; the W4A16 forward below that and with the router weight on the input, bit for bit the forward without
    the copy; an expert map counts global experts."""
    import secrets

    import moe_nvfp4 as m
    from moe_nvfp4.sm90 import w4a8
    from moe_nvfp4.sm90.w4a8 import FP8_MIN_ROWS_PER_EXPERT

    e, k = 4, 2
    t = FP8_MIN_ROWS_PER_EXPERT * e // k
    w, checkpoint, x, tw, ti = _api_layer(e, k, 64, 64, t, secrets.randbits(31))
    f = m.prepare_fp8_weights(w, checkpoint)
    assert torch.equal(f.w13.view(torch.uint8), fold_to_fp8(w).w13.view(torch.uint8))
    assert torch.equal(m.fused_moe(x, w, tw, ti, fp8_weights=f), m.fused_moe(x, w, tw, ti))
    monkeypatch.setattr(w4a8, "FP8_MIN_EAGER_FLOPS", 0.0)
    out = m.fused_moe(x, w, tw, ti, fp8_weights=f)
    assert torch.equal(out, fused_moe_w4a8_torch(x, f, tw, ti))
    assert not torch.equal(out, m.fused_moe(x, w, tw, ti))  # the W4A8 roundings are there
    few = slice(0, t - 1)
    assert torch.equal(
        m.fused_moe(x[few], w, tw[few], ti[few], fp8_weights=f), m.fused_moe(x[few], w, tw[few], ti[few])
    )
    top1_w, top1_ids = tw[:, :1].contiguous(), ti[:, :1].contiguous()
    on_input = dict(apply_router_weight_on_input=True)
    assert torch.equal(
        m.fused_moe(x, w, top1_w, top1_ids, fp8_weights=f, **on_input), m.fused_moe(x, w, top1_w, top1_ids, **on_input)
    )
    emap = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1], dtype=torch.int32)  # 8 global experts: half the rows expected
    assert torch.equal(
        m.fused_moe(x, w, tw, ti, expert_map=emap, fp8_weights=f), m.fused_moe(x, w, tw, ti, expert_map=emap)
    )


def test_fused_moe_refuses_fp8_weights_of_other_weights() -> None:
    import moe_nvfp4 as m

    w, _, x, tw, ti = _api_layer(4, 2, 64, 64, 8, 0)
    other, *_ = _api_layer(4, 2, 64, 64, 8, 1)
    with pytest.raises(ValueError, match="fp8_weights were folded from other weights"):
        m.fused_moe(x, w, tw, ti, fp8_weights=m.prepare_fp8_weights(other))


API_SCRIPT = textwrap.dedent(
    """
    import sys, torch, moe_nvfp4 as m
    sys.path.insert(0, sys.argv[1])
    from test_w4a8 import _api_layer
    from moe_nvfp4.sm90 import w4a8
    from moe_nvfp4.sm90.w4a8 import FP8_MIN_ROWS_PER_EXPERT, fused_moe_w4a8_torch
    w4a8.FP8_MIN_EAGER_FLOPS = 0.0  # W4A8 from the rows bound alone: this layer is far under the eager work bound
    e, k = 4, 2
    t = FP8_MIN_ROWS_PER_EXPERT * e // k
    w, _, x, tw, ti = _api_layer(e, k, 128, 128, t, int(sys.argv[2]), torch.float16)
    f = m.prepare_fp8_weights(w)
    out = m.fused_moe(x, w, tw, ti, fp8_weights=f)
    twin = fused_moe_w4a8_torch(x, f, tw, ti)
    print(((out.double() - twin.double()).norm() / twin.double().norm()).item())
    """
)


@pytest.mark.slow
def test_fused_moe_with_fp8_weights_runs_the_triton_backend_entry() -> None:
    """The Triton backend's moe_w4a8 entry through api.fused_moe under the interpreter (its 128-token tiles run
    gemm_fp8's kernel there; the Gluon kernel needs a GPU): within 5e-3 of the twin in fp16, as the kernel tests
    above (in bf16 a last-bit difference of GEMM1's rounded output moves more e4m3 codes: 1.9e-2 seen)."""
    import secrets

    env = dict(os.environ, TRITON_INTERPRET="1", MOE_NVFP4_BACKEND="triton")
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run(
        [sys.executable, "-c", API_SCRIPT, here, str(secrets.randbits(31))],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(proc.stdout.split()[-1]) < 5e-3, proc.stdout


def test_custom_op_with_fp8_weights_passes_opcheck(eager_w4a8) -> None:
    """The op carrying the e4m3 copy's tensors: fake tensor, autograd-registration and AOT-dispatch checks of
    torch.library, and torch.compile traces api.fused_moe(..., fp8_weights=) as one op."""
    import moe_nvfp4 as m
    from moe_nvfp4.ops import fused_moe_op
    from moe_nvfp4.sm90.w4a8 import FP8_MIN_ROWS_PER_EXPERT

    e, k = 4, 2
    t = FP8_MIN_ROWS_PER_EXPERT * e // k
    w, checkpoint, x, tw, ti = _api_layer(e, k, 64, 64, t, 3)
    f = m.prepare_fp8_weights(w, checkpoint)
    args = (x, list(w.tensors), list(f.tensors), tw, ti, None, 64, 64, w.layout.name)
    # test_schema compares float8 inputs before and after by arithmetic CPU torch lacks for them
    checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    result = torch.library.opcheck(fused_moe_op, args, test_utils=checks)
    assert all(v == "SUCCESS" for v in result.values()), result

    @torch.compile(fullgraph=True, backend="eager")
    def layer(x, tw, ti):
        return m.fused_moe(x, w, tw, ti, fp8_weights=f) * 2

    assert torch.equal(layer(x, tw, ti), m.fused_moe(x, w, tw, ti, fp8_weights=f) * 2)


def test_token_panel_rule() -> None:
    """gemm_fp8_ws.token_panel: GEMM2 keeps a token tile's whole K in shared memory where it fits beside the ring
    and the weight tiles split into units of 4 (else 2); GEMM1, long K and odd tile counts stream as before."""
    from moe_nvfp4.sm90.gemm_fp8 import Fp8Tiles
    from moe_nvfp4.sm90.gemm_fp8_ws import token_panel

    tiles = Fp8Tiles(128, 128, 4)
    assert token_panel(False, 768, 2048, tiles) == (6, 4)  # Qwen3-30B-A3B GEMM2
    assert token_panel(False, 1024, 2048, tiles) == (8, 4)  # OLMoE: 192 KB with the ring
    assert token_panel(False, 256, 7168, tiles) == (2, 4)  # Kimi-K2 TP=8
    assert token_panel(False, 768, 768, tiles) == (6, 2)  # 6 weight tiles
    assert token_panel(False, 1152, 2048, tiles) == (0, 0)  # 9 steps: 208 KB
    assert token_panel(False, 14336, 4096, tiles) == (0, 0)  # Mixtral GEMM2
    assert token_panel(False, 768, 2880, tiles) == (0, 0)  # 23 weight tiles
    assert token_panel(True, 768, 2048, tiles) == (0, 0)  # GEMM1
