"""The ``flashinfer`` backend of the W4A4 MoE (sm_100/sm_103): FlashInfer's TRT-LLM-gen NVFP4 fused MoE,
``flashinfer.fused_moe.trtllm_fp4_block_scale_routed_moe`` with pre-computed routing, the kernel vLLM 0.26 runs for
``modelopt_fp4`` on Blackwell, on weights in ``weight_layouts.FlashInferLayout`` (packed once, anywhere, CPU
included); this module marshals each forward's arguments (``fused_moe_w4a4_flashinfer``).  FlashInfer is imported
at the first forward only.

In the kernel's SwiGLU, ``out1 = scale_c * up_acc * silu(scale_gate * gate_acc)`` (FlashInfer's
``trtllm/batched_gemm/KernelRunner.h``), so gate and up keep their own global scales exactly: scale_gate =
a13 * gs_gate, scale_c = a13 * gs_up / a2 (the second GEMM's input is quantized with 1 / a2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .formats import NVFP4

if TYPE_CHECKING:
    from .weights import MoEWeights

__all__ = ["fused_moe_w4a4_flashinfer"]

SWIGLU = 3  # flashinfer.ActivationType.Swiglu
ROUTING_PRECOMPUTED = 1  # routing_method_type: unused with pre-computed routing (vLLM passes 1)


def fused_moe_w4a4_flashinfer(
    x: torch.Tensor,
    weights: MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    input_scales: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """W4A4 MoE forward on FlashInfer's kernel -> [T, H] in x's dtype (inputs checked by ``api.fused_moe_w4a4``).

    topk_ids are global expert ids (as many as ``expert_map`` has entries; E without one); this rank holds experts
    ``weights.layout.expert_offset`` .. ``expert_offset + E - 1`` (the kernel reads that range, not the map).
    ``input_scales``: GEMM1's and GEMM2's ModelOpt ``input_scale`` (multipliers).
    Launches: FlashInfer's quantizer (linear scales, as the kernel reads them), then its fused MoE."""
    import flashinfer
    from flashinfer.fused_moe import trtllm_fp4_block_scale_routed_moe

    a13, a2 = (s.reshape(1).float() for s in input_scales)
    t, h = x.shape
    h_pad = weights.w13_packed.shape[2] * 2
    global_experts = weights.num_experts if expert_map is None else expert_map.numel()
    if t == 0:
        return torch.empty_like(x)
    x_in = torch.nn.functional.pad(x.to(torch.bfloat16), (0, h_pad - h))
    x_fp4, x_scale = flashinfer.fp4_quantize(
        x_in, 1.0 / a13, sf_vec_size=NVFP4.block_size, sf_use_ue8m0=False, is_sf_swizzled_layout=False
    )
    out = torch.empty(t, h_pad, dtype=torch.bfloat16, device=x.device)
    gs = weights.w13_global
    trtllm_fp4_block_scale_routed_moe(
        topk_ids=(topk_ids.to(torch.int32), topk_weights.to(torch.bfloat16)),
        routing_bias=None,
        hidden_states=x_fp4,
        hidden_states_scale=x_scale.view(NVFP4.scale_dtype).reshape(t, h_pad // NVFP4.block_size),
        gemm1_weights=weights.w13_packed,
        gemm1_weights_scale=weights.w13_scale,
        gemm1_bias=None,
        gemm1_alpha=None,
        gemm1_beta=None,
        gemm1_clamp_limit=None,
        gemm2_weights=weights.w2_packed,
        gemm2_weights_scale=weights.w2_scale,
        gemm2_bias=None,
        output1_scale_scalar=(a13 * gs[:, 1] / a2).contiguous(),
        output1_scale_gate_scalar=(a13 * gs[:, 0]).contiguous(),
        output2_scale_scalar=(a2 * weights.w2_global).contiguous(),
        num_experts=global_experts,
        top_k=topk_ids.shape[1],
        n_group=0,
        topk_group=0,
        intermediate_size=weights.w2_packed.shape[2] * 2,
        local_expert_offset=weights.layout.expert_offset,
        local_num_experts=weights.num_experts,
        routed_scaling_factor=None,
        routing_method_type=ROUTING_PRECOMPUTED,
        do_finalize=True,
        activation_type=SWIGLU,
        output=out,
    )
    return out[:, :h].to(x.dtype)
