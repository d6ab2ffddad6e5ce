"""The torch reference MoE and grouped GEMM against independent computations written here.

``dense_moe_loop`` is a float64 loop over tokens and their top-k slots; it dequantizes the weights with
its own bit unpacking and code table, and quantizes W4A4 activations with its own rounding rule, so
nothing from moe_nvfp4 except the quantized inputs feeds the expected value.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from moe_nvfp4.formats import NVFP4Tensor, quantize_nvfp4
from moe_nvfp4.reference import fused_moe_torch, grouped_gemm_nvfp4_torch, moe_dense_torch
from moe_nvfp4.routing import topk_softmax

# Tolerance bounds of this file (relative to max |expected|, elementwise).
TOL = {
    # W4A16, arbitrary float32 global scales: the reference dequantizes in float32 (one rounding of
    # code * scale * global, 2^-24 relative) and accumulates in float64.
    "w4a16_f64": 1e-6,
    # W4A4 with power-of-two weight global scales (exact dequantization) and activations quantized with the
    # same float32 arithmetic on both sides: only float64 summation order differs.
    "w4a4_f64": 1e-9,
    # Output returned in bfloat16: one bf16 rounding (2^-9 relative) of each output element.
    "bf16_out": 2**-8,
    # Grouped GEMM with float32 accumulation and float32 / float16 output.
    "gemm_f32": 1e-5,
    "gemm_f16": 2e-3,
}

CODE_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def ref_dequantize(q: NVFP4Tensor) -> torch.Tensor:
    """Float64 [..., N, K] from linear scales: byte b holds K index 2i in b & 15 and 2i+1 in b >> 4."""
    packed = q.packed.long()
    codes = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.long)
    codes[..., 0::2] = packed & 15
    codes[..., 1::2] = packed >> 4
    values = torch.tensor(CODE_VALUES, dtype=torch.float64)[codes]
    scale = q.block_scale.double().repeat_interleave(16, dim=-1)
    gs = q.global_scale.double()
    n = packed.shape[-2]
    if gs.dim() == len(packed.shape) - 2:  # one scale per matrix
        gs = gs[..., None, None]
    else:  # [..., S]: S row segments
        gs = gs.repeat_interleave(n // gs.shape[-1], dim=-1)[..., None]
    return values * scale * gs


def ref_round_e2m1(x: torch.Tensor) -> torch.Tensor:
    m = x.double().abs()
    r = torch.where(m < 2, torch.round(m * 2) / 2, torch.where(m < 4, torch.round(m), torch.round(m / 2) * 2))
    r = r.clamp(max=6.0)
    return torch.where(torch.signbit(x), -r, r)


def ref_fake_quant(x: torch.Tensor, g: float) -> torch.Tensor:
    """Activation NVFP4 round trip of a float32 vector [K] with input scale g, in float32 arithmetic."""
    gt = torch.tensor(g, dtype=torch.float32)
    blocks = x.float().reshape(-1, 16)
    s = (blocks.abs().amax(-1) / (6.0 * gt)).clamp(max=448.0).to(torch.float8_e4m3fn).float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    v = ref_round_e2m1(blocks / (s * gt)[:, None]).float()
    return (v * s[:, None] * gt).double().reshape(x.shape)  # float32 product, as the format defines it


def dense_moe_loop(x, w13, w2, topk_weights, topk_ids, *, expert_map=None, s13=None, s2=None):
    """float64 [T, H]: out[t] = sum_j w[t,j] * W2_e (silu(x W1_e^T) * (x W3_e^T)), e = local expert."""
    t_count, hidden = x.shape
    inter = w2.shape[-1]
    out = torch.zeros(t_count, hidden, dtype=torch.float64)
    for t in range(t_count):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            xt = x[t].double()
            if s13 is not None:
                xt = ref_fake_quant(x[t].float(), float(s13[e]))
            h = w13[e] @ xt
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            if s2 is not None:
                act = ref_fake_quant(act.float(), float(s2[e]))
            out[t] += float(topk_weights[t, j]) * (w2[e] @ act)
    return out


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power-of-two ModelOpt scale >= amax / (6 * 448): exact in every product, no clipping."""
    return torch.exp2(torch.ceil(torch.log2(amax / (6 * 448))))


def assert_close_rel(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    assert got.shape == want.shape
    if want.numel() == 0:
        return
    scale = want.abs().max().item() or 1.0
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3e} > {rel:.1e} * {scale:.3e}"


@dataclass(frozen=True)
class Case:
    why: str
    tokens: int = 13
    experts: int = 8
    top_k: int = 2
    hidden: int = 64
    inter: int = 32
    w4a4: bool = False
    segments: int = 1  # 2: gate and up with their own global scales ([E, 2])
    local_experts: int = 0  # > 0: expert map onto this many local experts, the rest -1
    used_experts: int = 0  # > 0: route only to the first this-many experts (others empty)
    scalar_input_scale: bool = False


CASES = [
    Case("W4A16"),
    Case("W4A16, gate/up global scales [E, 2]", segments=2),
    Case("W4A4, per-expert input scales", w4a4=True),
    Case("W4A4, [E, 2] global scales", w4a4=True, segments=2),
    Case("W4A4, one input scale for all experts", w4a4=True, scalar_input_scale=True),
    Case("expert map with -1 entries", experts=10, local_experts=4),
    Case("expert map, W4A4", experts=10, local_experts=4, w4a4=True, segments=2),
    Case("no tokens", tokens=0),
    Case("no tokens, W4A4", tokens=0, w4a4=True),
    Case("empty experts", experts=8, used_experts=3),
    Case("top-1, odd E", experts=7, top_k=1),
    Case("top-8, E not a power of two", experts=12, top_k=8, tokens=5),
]


def build(gen: torch.Generator, case: Case):
    e_local = case.local_experts or case.experts
    h, i = case.hidden, case.inter
    w13 = torch.randn(e_local, 2 * i, h, generator=gen) / h**0.5
    w13[:, i:] *= 20.0  # up much larger than gate: segments matter
    w2 = torch.randn(e_local, h, i, generator=gen) / i**0.5
    x = torch.randn(case.tokens, h, generator=gen)
    logits = torch.randn(case.tokens, case.used_experts or case.experts, generator=gen)
    weights, ids = topk_softmax(logits, case.top_k, renormalize=True)
    expert_map = None
    if case.local_experts:
        expert_map = torch.full((case.experts,), -1, dtype=torch.int32)
        owned = torch.randperm(case.experts, generator=gen)[: case.local_experts]
        expert_map[owned] = torch.arange(case.local_experts, dtype=torch.int32)
    if case.w4a4:
        # Exact float32 dequantization: power-of-two global scales.
        seg = w13.reshape(e_local, case.segments, -1).abs().amax(-1)
        gs13 = pow2_scale(seg).squeeze(-1) if case.segments == 1 else pow2_scale(seg)
        q13 = quantize_nvfp4(w13, gs13, segments=case.segments)
        q2 = quantize_nvfp4(w2, pow2_scale(w2.abs().amax(dim=(1, 2))))
        # Calibrated input scales, different per expert by factors that are not powers of two (a power of
        # two would only shift every block scale's exponent and leave the quantized values unchanged).
        amax = x.abs().amax() if x.numel() else torch.tensor(1.0)
        s13 = amax / (6 * 448) * (1 + 2 * torch.rand(e_local, generator=gen))
        s2 = 100.0 / (6 * 448) * (1 + 2 * torch.rand(e_local, generator=gen))
        if case.scalar_input_scale:
            s13, s2 = s13[0].clone(), s2[0].reshape(1)
    else:
        q13 = quantize_nvfp4(w13, segments=case.segments)
        q2 = quantize_nvfp4(w2)
        s13 = s2 = None
    return x, q13, q2, weights, ids, expert_map, s13, s2


def per_expert(scale, e_local):
    return None if scale is None else scale.reshape(-1).expand(e_local) if scale.numel() == 1 else scale


@pytest.mark.parametrize("case", CASES, ids=[c.why for c in CASES])
def test_fused_moe_torch_against_dense_loop(gen, case):
    x, q13, q2, weights, ids, emap, s13, s2 = build(gen, case)
    got = fused_moe_torch(
        x.double(),
        q13,
        q2,
        weights,
        ids,
        expert_map=emap,
        w13_input_scale=s13,
        w2_input_scale=s2,
        compute_dtype=torch.float64,
    )
    e_local = q13.packed.shape[0]
    want = dense_moe_loop(
        x,
        ref_dequantize(q13),
        ref_dequantize(q2),
        weights,
        ids,
        expert_map=emap,
        s13=per_expert(s13, e_local),
        s2=per_expert(s2, e_local),
    )
    assert got.dtype == torch.float64 and got.shape == (case.tokens, case.hidden)
    assert_close_rel(got, want, TOL["w4a4_f64"] if case.w4a4 else TOL["w4a16_f64"])
    if case.local_experts and case.tokens:
        off_rank = (emap[ids.long()] < 0).all(dim=1)
        assert bool((got[off_rank] == 0).all())  # tokens routed only to other ranks get nothing here


def test_fused_moe_torch_float32_and_bf16_outputs(gen):
    x, q13, q2, weights, ids, _, _, _ = build(gen, Case("dtypes"))
    want = dense_moe_loop(x, ref_dequantize(q13), ref_dequantize(q2), weights, ids)
    out32 = fused_moe_torch(x, q13, q2, weights, ids)
    assert out32.dtype == torch.float32
    assert_close_rel(out32, want, TOL["w4a16_f64"])
    xb = x.to(torch.bfloat16)
    want_b = dense_moe_loop(xb, ref_dequantize(q13), ref_dequantize(q2), weights, ids)
    out16 = fused_moe_torch(xb, q13, q2, weights, ids)
    assert out16.dtype == torch.bfloat16
    assert_close_rel(out16, want_b, TOL["bf16_out"])


def test_w4a4_differs_from_w4a16(gen):
    """The input scales are applied: quantized activations change the result measurably."""
    x, q13, q2, weights, ids, _, s13, s2 = build(gen, Case("w4a4", w4a4=True))
    a16 = fused_moe_torch(x, q13, q2, weights, ids, compute_dtype=torch.float64)
    a4 = fused_moe_torch(x, q13, q2, weights, ids, w13_input_scale=s13, w2_input_scale=s2, compute_dtype=torch.float64)
    rel = ((a4 - a16).norm() / a16.norm()).item()
    assert 1e-3 < rel < 0.3, rel  # measured 0.13-0.17: two 4-bit activation roundings


def test_moe_dense_torch_against_dense_loop(gen):
    x, q13, q2, weights, ids, _, _, _ = build(gen, Case("float weights"))
    w13, w2 = ref_dequantize(q13) * 1.01, ref_dequantize(q2) * 0.99  # any float weights
    got = moe_dense_torch(x.double(), w13, w2, weights, ids, compute_dtype=torch.float64)
    assert_close_rel(got, dense_moe_loop(x, w13, w2, weights, ids), TOL["w4a4_f64"])


# ----------------------------------------------------------------------------------------------------
# grouped GEMM


GEMM_GROUPS = {  # (M_g, N_g, K_g) and why
    "odd_m_and_n": (5, 40, 64),
    "empty_group": (0, 16, 32),
    "m_over_128": (130, 24, 80),
    "k_with_5_scale_columns": (17, 129, 80),
}


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_alpha", [False, True])
def test_grouped_gemm_swizzled_against_dequantize_matmul(gen, out_dtype, with_alpha):
    a, b, want = [], [], []
    alpha = torch.rand(len(GEMM_GROUPS), generator=gen) + 0.5 if with_alpha else None
    for g, (m, n, k) in enumerate(GEMM_GROUPS.values()):
        qa = quantize_nvfp4(torch.randn(m, k, generator=gen) * 3)
        qb = quantize_nvfp4(torch.randn(n, k, generator=gen) * 0.05)
        ref = ref_dequantize(qa) @ ref_dequantize(qb).T
        want.append(ref * (alpha[g].item() if with_alpha else 1.0))
        a.append(qa.swizzled_scales())
        b.append(qb.swizzled_scales())
    got = grouped_gemm_nvfp4_torch(a, b, alpha=alpha, out_dtype=out_dtype)
    assert len(got) == len(GEMM_GROUPS)
    for out, ref, (m, n, _) in zip(got, want, GEMM_GROUPS.values()):
        assert out.dtype == out_dtype and out.shape == (m, n)
        assert_close_rel(out, ref, TOL["gemm_f32"] if out_dtype == torch.float32 else TOL["gemm_f16"])


def test_grouped_gemm_layouts_agree(gen):
    qa = quantize_nvfp4(torch.randn(33, 48, generator=gen))
    qb = quantize_nvfp4(torch.randn(20, 48, generator=gen))
    lin = grouped_gemm_nvfp4_torch([qa], [qb], out_dtype=torch.float32)[0]
    swz = grouped_gemm_nvfp4_torch([qa.swizzled_scales()], [qb.swizzled_scales()], out_dtype=torch.float32)[0]
    assert torch.equal(lin, swz)


def test_grouped_gemm_bad_arguments(gen):
    qa = quantize_nvfp4(torch.randn(4, 32, generator=gen))
    qb = quantize_nvfp4(torch.randn(4, 48, generator=gen))
    with pytest.raises(ValueError, match="groups"):
        grouped_gemm_nvfp4_torch([qa, qa], [qa])
    with pytest.raises(ValueError, match="K="):
        grouped_gemm_nvfp4_torch([qa], [qb])


@pytest.mark.parametrize("with_map", [False, True])
def test_out_of_range_routing_contributes_nothing(gen, with_map):
    """The reference's meaning of bad routing data (routing.routed_pairs), which the kernels are compared with: a
    pair whose id is outside [0, E_global) or whose map entry is outside [0, E) adds nothing, exactly as if its
    weight were 0 on a valid expert (float64: the sums are the same up to the order of exact zeros)."""
    case = Case("poisoned", tokens=9, experts=12 if with_map else 4, top_k=3, local_experts=4 if with_map else 0)
    x, q13, q2, weights, ids, emap, _, _ = build(gen, case)
    n_global = case.experts
    if with_map:
        emap[torch.nonzero(emap < 0)[0]] = 4  # one entry past the local experts (a corrupt map)
    ids[0] = torch.tensor([-1, n_global, 1000], dtype=ids.dtype)
    ids[1, 0] = -(2**31)
    local = ids.clamp(0, n_global - 1).long()
    routed = (ids >= 0) & (ids < n_global)
    if with_map:
        routed &= (emap[local] >= 0) & (emap[local] < case.local_experts)
        valid_id = int(torch.nonzero((emap >= 0) & (emap < case.local_experts))[0])
    else:
        valid_id = 0
    got = fused_moe_torch(x.double(), q13, q2, weights, ids, expert_map=emap, compute_dtype=torch.float64)
    want = fused_moe_torch(
        x.double(),
        q13,
        q2,
        torch.where(routed, weights, 0.0),
        torch.where(routed, ids, valid_id),
        expert_map=emap,
        compute_dtype=torch.float64,
    )
    assert_close_rel(got, want, 1e-12)
    assert bool((got[0] == 0).all())
