"""Pure-torch twins of the public ops, float32 math (or float64 when asked): the ground truth for tests.

Shapes: x [T, H]; w13 NVFP4Tensor [E, 2I, H] (gate rows first, then up; global scale [E] or [E, 2]), or
[E, I, H] with a non-gated activation (``expert_activation``); w2 NVFP4Tensor [E, H, I]; topk_weights [T, k];
topk_ids [T, k] (global expert ids); biases float [E, 2I] (or [E, I]) and [E, H].  A pair whose id is
outside [0, E_global) or whose expert-map entry is outside [0, E) contributes nothing (``routing.routed_pairs``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .expert_activation import SILU, ExpertActivation
from .formats import NVFP4Tensor, dequantize_nvfp4, quantize_activations_nvfp4
from .routing import routed_pairs
from .weights import MoEWeights

__all__ = [
    "moe_dense_torch",
    "fused_moe_torch",
    "fused_moe_batched_torch",
    "fused_moe_packed_torch",
    "fused_moe_batched_packed_torch",
    "grouped_gemm_nvfp4_torch",
    "fake_quantize_activations",
]


def fake_quantize_activations(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x -> NVFP4 (per-16 e4m3 scales, fixed global input scale) -> float32: the W4A4 activation path."""
    return dequantize_nvfp4(quantize_activations_nvfp4(x.float(), input_scale))


def _per_expert(scale: torch.Tensor | None, e: int) -> torch.Tensor | None:
    if scale is None:
        return None
    scale = scale.float().reshape(-1)
    return scale[0] if scale.numel() == 1 else scale[e]


def moe_dense_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
    activation: ExpertActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The MoE forward on float weights w13 [E, 2I, H] ([E, I, H] non-gated), w2 [E, H, I]; returns x.dtype [T, H].

    out[t] = sum_j w[t, j] * (W2_e act(x W13_e^T + b13_e) + b2_e), e = topk_ids[t, j], act the ``activation``
    (SiLU(gate) * up by default).  With ``apply_router_weight_on_input`` each pair's GEMM1 input is
    x[t] * w[t, j], rounded to x.dtype (vLLM's prepare step: ``a1 * topk_weights.to(a1.dtype)``), and the sum is
    unweighted.  W4A16 by default; W4A4 when input scales ([E] or scalar multipliers) are given: the activations
    entering each GEMM are quantized to NVFP4 with that scale first.  With an expert map, pairs whose expert maps
    to -1 contribute nothing (another rank owns them); so do pairs with an id or map entry out of range.
    """
    t, hidden = x.shape
    out = torch.zeros(t, hidden, dtype=compute_dtype, device=x.device)
    local, routed = routed_pairs(topk_ids, w13.shape[0], expert_map)
    ids = torch.where(routed, local, -1).view(topk_ids.shape)
    xf = x.to(compute_dtype)
    for e in range(w13.shape[0]):
        token, slot = torch.nonzero(ids == e, as_tuple=True)
        if token.numel() == 0:
            continue
        if apply_router_weight_on_input:
            xe = (x[token] * topk_weights[token, slot].to(x.dtype)[:, None]).to(compute_dtype)
        else:
            xe = xf[token]
        s13 = _per_expert(w13_input_scale, e)
        if s13 is not None:
            xe = fake_quantize_activations(xe, s13).to(compute_dtype)
        h = xe @ w13[e].to(compute_dtype).T
        if w13_bias is not None:
            h = h + w13_bias[e].to(compute_dtype)
        act = activation.torch_twin(h)
        s2 = _per_expert(w2_input_scale, e)
        if s2 is not None:
            act = fake_quantize_activations(act, s2).to(compute_dtype)
        y = act @ w2[e].to(compute_dtype).T
        if w2_bias is not None:
            y = y + w2_bias[e].to(compute_dtype)
        if not apply_router_weight_on_input:
            y = y * topk_weights[token, slot].to(compute_dtype)[:, None]
        out.index_add_(0, token, y)
    return out.to(x.dtype)


def fused_moe_torch(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    w13_input_scale: torch.Tensor | None = None,
    w2_input_scale: torch.Tensor | None = None,
    activation: ExpertActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The NVFP4 MoE forward: dequantize (exact) then ``moe_dense_torch``; same arguments as fused_moe (the
    weights' activation and biases spelled out)."""
    return moe_dense_torch(
        x,
        dequantize_nvfp4(w13, compute_dtype),
        dequantize_nvfp4(w2, compute_dtype),
        topk_weights,
        topk_ids,
        expert_map=expert_map,
        w13_input_scale=w13_input_scale,
        w2_input_scale=w2_input_scale,
        activation=activation,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        apply_router_weight_on_input=apply_router_weight_on_input,
        compute_dtype=compute_dtype,
    )


def fused_moe_batched_torch(
    x: torch.Tensor,
    w13: NVFP4Tensor,
    w2: NVFP4Tensor,
    expert_num_tokens: torch.Tensor,
    *,
    activation: ExpertActivation = SILU,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """vLLM's batched format: x [E, M, H], expert e's tokens in its first count_e rows (expert_num_tokens [E],
    clamped to [0, M]) -> [E, M, H] in x.dtype, out[e, r] = W2_e act(W13_e x[e, r] + b13_e) + b2_e for r < count_e,
    unweighted (vLLM's finalize or combine weights and sums), and 0 past count_e.  Reads the counts on the host."""
    e, m, _ = x.shape
    w13f, w2f = dequantize_nvfp4(w13, compute_dtype), dequantize_nvfp4(w2, compute_dtype)
    out = torch.zeros(x.shape, dtype=compute_dtype, device=x.device)
    for expert, count in enumerate(expert_num_tokens.clamp(0, m).tolist()):
        if count == 0:
            continue
        h = x[expert, :count].to(compute_dtype) @ w13f[expert].T
        if w13_bias is not None:
            h = h + w13_bias[expert].to(compute_dtype)
        y = activation.torch_twin(h) @ w2f[expert].T
        if w2_bias is not None:
            y = y + w2_bias[expert].to(compute_dtype)
        out[expert, :count] = y
    return out.to(x.dtype)


def grouped_gemm_nvfp4_torch(
    a: Sequence[NVFP4Tensor],
    b: Sequence[NVFP4Tensor],
    *,
    alpha: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float16,
) -> list[torch.Tensor]:
    """W4A4 NVFP4 grouped GEMM: per group g, ``alpha[g] * A_g @ B_g^T`` -> out_dtype [M_g, N_g].

    A_g [M_g, K_g] and B_g [N_g, K_g] are packed FP4 (K-major) with e4m3 scales in either layout (the
    128x4 swizzled one in the benchmark problem) and their global scales; alpha [G] float32 is an extra
    per-group multiplier (1 when omitted).  Accumulation in float32.
    """
    if len(a) != len(b):
        raise ValueError(f"{len(a)} A groups but {len(b)} B groups")
    out = []
    for g, (ag, bg) in enumerate(zip(a, b)):
        if ag.k != bg.k:
            raise ValueError(f"group {g}: A has K={ag.k}, B has K={bg.k}")
        acc = dequantize_nvfp4(ag) @ dequantize_nvfp4(bg).T
        if alpha is not None:
            acc = acc * alpha[g].float()
        out.append(acc.to(out_dtype))
    return out


def quantize_activations_torch(x: torch.Tensor, input_global_scale: torch.Tensor) -> NVFP4Tensor:
    """``api.quantize_activations`` in torch: the same bytes as the Triton quantizer (128x4-swizzled scales)."""
    return quantize_activations_nvfp4(x, input_global_scale).swizzled_scales()


def fused_moe_w4a4_torch(x, weights, topk_weights, topk_ids, expert_map, input_scales) -> torch.Tensor:
    """``api.fused_moe_w4a4`` on packed ``MoEWeights`` of any layout: unpacked, then ``fused_moe_torch`` with the
    input scales (GEMM1's, GEMM2's), routed as the layout's kernel routes them."""
    w13, w2 = weights.to_nvfp4()
    return fused_moe_torch(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        expert_map=weights.layout.expert_map_for(expert_map, weights.num_experts),
        w13_input_scale=input_scales[0],
        w2_input_scale=input_scales[1],
    )


def fused_moe_packed_torch(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    *,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """The torch backend's ``moe_w4a16`` entry (backends.py): ``fused_moe_torch`` on the packed weights, unpacked
    from their layout first."""
    w13, w2 = weights.to_nvfp4()
    return fused_moe_torch(
        x,
        w13,
        w2,
        topk_weights,
        topk_ids,
        expert_map=expert_map,
        activation=weights.activation,
        w13_bias=weights.w13_bias,
        w2_bias=weights.w2_bias,
        apply_router_weight_on_input=apply_router_weight_on_input,
    )


def fused_moe_batched_packed_torch(
    out: torch.Tensor, x: torch.Tensor, weights: MoEWeights, expert_num_tokens: torch.Tensor, expected_rows: float
) -> None:
    """The torch backend's ``moe_w4a16_batched`` entry: ``fused_moe_batched_torch`` on the packed weights, written
    into all of ``out`` (0 past each count); ``expected_rows`` picks no config here."""
    w13, w2 = weights.to_nvfp4()
    batched = fused_moe_batched_torch(
        x,
        w13,
        w2,
        expert_num_tokens,
        activation=weights.activation,
        w13_bias=weights.w13_bias,
        w2_bias=weights.w2_bias,
    )
    out.copy_(batched)
