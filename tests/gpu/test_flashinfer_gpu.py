"""FlashInfer on the GPU (docs/design/005-backends.md).

Any CUDA GPU (sm_90 included; FlashInfer 0.6.14 of the vLLM 0.26 bundle, whose FP4 utilities JIT-compile an
sm_90 module with the host's nvcc): our activation quantizer and our 128x4 swizzle give the same bytes as
``flashinfer.fp4_quantize`` and ``flashinfer.block_scale_interleave``, and our FlashInfer weight layout equals
what vLLM 0.26's own ``prepare_static_weights_for_trtllm_fp4_moe`` builds with FlashInfer's CUDA helpers.
sm_100/sm_103: the default W4A4 MoE (FlashInfer's fused MoE) against the reference.
"""

from __future__ import annotations


import pytest
import torch

import moe_nvfp4 as m
from moe_nvfp4.prepare_weights import _packed
from moe_nvfp4.weight_layouts import FlashInferLayout


pytestmark = pytest.mark.gpu

# ||out - ref|| / ||ref||: both sides quantize the activations to NVFP4 with the same scales; FlashInfer's
# kernel rounds the GEMM1 output to NVFP4 in its own order and carries routing weights in bf16.
MOE_REL_TOL = 3e-2


def _flashinfer():
    return pytest.importorskip("flashinfer", reason="FlashInfer is part of the vLLM 0.26 bundle")


# FlashInfer's quantizer scales by a reciprocal where ours divides exactly (the reference's rounding), so on
# typical activations bytes may differ only at rounding ties: at most this fraction, by one step each.
TIE_FRACTION = 1e-3


@pytest.mark.parametrize(("rows", "k"), [(8, 64), (300, 2048), (129, 7168)])
def test_quantizer_bytes_match_flashinfer(rows: int, k: int, gen) -> None:
    """Normal activations with per-row magnitudes 2^-8..2^4 and a calibrated global scale (amax / (6 * 448)):
    the same block-scale and code bytes as ``flashinfer.fp4_quantize``, but for rounding ties (TIE_FRACTION), each
    one e4m3 step or one e2m1 code away.  sm_100+ only: FlashInfer 0.6.14 builds its quantizer for sm_90 but
    compiles the conversion out below sm_100 (quantization_utils.cuh, ``#if __CUDA_ARCH__ >= 1000``), and on an
    H200 it returned its output buffers unwritten (design 005)."""
    flashinfer = _flashinfer()
    x = torch.randn(rows, k, generator=gen) * torch.exp2(torch.randint(-8, 5, (rows, 1), generator=gen).float())
    x = x.bfloat16().cuda()
    gs = (x.float().abs().amax() / (6 * 448)).reshape(1)
    if torch.cuda.get_device_capability(x.device) < (10, 0):
        pytest.skip("FlashInfer 0.6.14's fp4_quantize computes nothing below sm_100 (design 005): no bytes to compare")
    packed, scales = flashinfer.fp4_quantize(
        x, 1.0 / gs, sf_vec_size=16, sf_use_ue8m0=False, is_sf_swizzled_layout=True
    )
    ours = m.quantize_activations(x, gs)
    theirs_scales, ours_scales = scales.view(torch.uint8).reshape(-1), ours.block_scale.view(torch.uint8).reshape(-1)
    assert theirs_scales.numel() == ours_scales.numel()
    # the swizzled positions of real rows and scale columns (FlashInfer leaves the padding unwritten)
    real = m.swizzle_scales_128x4(torch.ones(1, rows, k // 16, dtype=torch.uint8, device=x.device)).reshape(-1).bool()
    scale_steps = (theirs_scales.int() - ours_scales.int()).abs()[real]  # positive e4m3 bytes order as their values
    theirs_codes = torch.stack((packed.view(torch.uint8) & 15, packed.view(torch.uint8) >> 4), -1).int()
    ours_codes = torch.stack((ours.packed & 15, ours.packed >> 4), -1).int()
    mag_t, mag_o = theirs_codes & 7, ours_codes & 7
    sign_flip = (((theirs_codes ^ ours_codes) & 8) > 0) & ((mag_t + mag_o) > 0)  # -0 against +0 is no difference
    code_steps = (mag_t - mag_o).abs() + sign_flip.int() * 8
    assert int(scale_steps.max()) <= 1 and (scale_steps > 0).float().mean() <= TIE_FRACTION
    assert int(code_steps.max()) <= 1 and (code_steps > 0).float().mean() <= TIE_FRACTION


@pytest.mark.parametrize(("experts", "rows", "cols"), [(1, 128, 4), (3, 200, 7), (2, 384, 448)])
def test_swizzle_bytes_match_flashinfer(experts: int, rows: int, cols: int, gen) -> None:
    flashinfer = _flashinfer()
    scales = torch.randint(0, 256, (experts, rows, cols), generator=gen, dtype=torch.uint8)
    theirs = flashinfer.block_scale_interleave(scales.cuda()).cpu().reshape(-1)
    assert torch.equal(theirs, m.swizzle_scales_128x4(scales).reshape(-1))


@pytest.mark.vllm
@pytest.mark.parametrize(("e", "h", "i"), [(4, 1024, 512), (3, 2048, 192)])
def test_weight_layout_matches_vllm(e: int, h: int, i: int, gen) -> None:
    """vLLM 0.26's TRT-LLM FP4 weight preparation, FlashInfer's CUDA swizzle included, on [w3, w1] ordered
    tensors (vLLM swaps them first), gives our bytes."""
    import vllm.model_executor.layers.fused_moe  # noqa: F401  (first: imported alone, flashinfer_utils is circular)
    from vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe import (
        prepare_static_weights_for_trtllm_fp4_moe,
    )

    w13 = m.NVFP4Tensor(
        torch.randint(0, 256, (e, 2 * i, h // 2), generator=gen, dtype=torch.uint8),
        (torch.rand(e, 2 * i, h // 16, generator=gen) * 4 + 0.25).to(torch.float8_e4m3fn),
        torch.rand(e, 2, generator=gen) + 0.5,
    )
    w2 = m.NVFP4Tensor(
        torch.randint(0, 256, (e, h, i // 2), generator=gen, dtype=torch.uint8),
        (torch.rand(e, h, i // 16, generator=gen) * 4 + 0.25).to(torch.float8_e4m3fn),
        torch.rand(e, generator=gen) + 0.5,
    )
    ours = _packed(w13, w2, FlashInferLayout())
    swap = lambda t: torch.cat((t[:, i:], t[:, :i]), 1).contiguous().cuda()  # noqa: E731
    v13, s13, v2, s2 = prepare_static_weights_for_trtllm_fp4_moe(
        swap(w13.packed),
        w2.packed.cuda(),
        swap(w13.block_scale),
        w2.block_scale.cuda(),
        hidden_size=h,
        intermediate_size=i,
        num_experts=e,
        is_gated_activation=True,
    )
    for name, got, want in (
        ("w13", ours.w13_packed, v13),
        ("w13_scale", ours.w13_scale, s13),
        ("w2", ours.w2_packed, v2),
        ("w2_scale", ours.w2_scale, s2),
    ):
        assert torch.equal(got.view(torch.uint8), want.cpu().view(torch.uint8).reshape(got.shape)), name


def _moe_inputs(gen, e: int, h: int, i: int, t: int, top_k: int):
    w13 = m.quantize_nvfp4(torch.randn(e, 2 * i, h, generator=gen) * 0.05, segments=2)
    w2 = m.quantize_nvfp4(torch.randn(e, h, i, generator=gen) * 0.05)
    x = torch.randn(t, h, generator=gen).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(t, e, generator=gen), top_k)
    return w13, w2, x, tw, ti


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10),
    reason="FlashInfer's TRT-LLM-gen MoE needs sm_100/sm_103",
)
@pytest.mark.parametrize(
    ("e", "h", "i", "t", "top_k"),
    [(8, 1024, 512, 1, 2), (16, 2048, 768, 300, 4), (8, 4096, 1536, 4096, 8), (4, 960, 208, 17, 2)],
)
def test_default_w4a4_moe_on_blackwell(e, h, i, t, top_k, gen) -> None:
    """Shapes: one token, a ragged batch, a prefill, and H, I off the 256/64 alignment (padded)."""
    w13, w2, x, tw, ti = _moe_inputs(gen, e, h, i, t, top_k)
    s13, s2 = torch.tensor([x.abs().max().item() / 2688]), torch.tensor([0.01])
    ref = m.fused_moe_torch(x, w13, w2, tw, ti, w13_input_scale=s13, w2_input_scale=s2)
    weights = m.prepare_moe_weights_w4a4(w13.to("cuda"), w2.to("cuda"))
    assert weights.layout == FlashInferLayout()
    out = m.fused_moe_w4a4(
        x.cuda(), weights, tw.cuda(), ti.cuda(), w13_input_scale=s13.cuda(), w2_input_scale=s2.cuda()
    )
    assert _rel(out.cpu(), ref) < MOE_REL_TOL
