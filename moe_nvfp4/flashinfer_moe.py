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

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .formats import NVFP4, NVFP4Tensor

if TYPE_CHECKING:
    from .weights import MoEWeights

__all__ = ["fused_moe_w4a4_flashinfer", "flashinfer_moe_path"]

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
    x_fp4, x_scale = flashinfer.fp4_quantize(x_in, 1.0 / a13, sf_vec_size=NVFP4.block_size, sf_use_ue8m0=False,
                                             is_sf_swizzled_layout=False)  # fmt: skip
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


def flashinfer_moe_path(
    w13: NVFP4Tensor, w2: NVFP4Tensor, *, top_k: int, max_tokens: int
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """FlashInfer's NVFP4 MoE for Hopper, as a benchmark path: the cuTile NVFP4-weight x BF16-activation backend
    (``CuTileNvfp4Bf16Config``, FlashInfer >= 0.7.1, which lists sm_89/sm_90/sm_120/sm_121 for it; not the vLLM
    0.26 bundle's 0.6.14, docs/design/005-backends.md says how to install it beside the bundle).

    w13 [E, 2I, H] (gate rows then up rows, global [E] or [E, 2] multipliers), w2 [E, H, I], CUDA tensors with
    linear scales; H and I multiples of 64.  Weights are prepared once here; returns ``run(x bf16 [T, H],
    topk_weights [T, k], topk_ids [T, k]) -> bf16 [T, H]`` for any T <= max_tokens (the first call of each
    token-count bucket autotunes and compiles)."""
    from flashinfer.fused_moe import (
        BackendOptions, CuTileNvfp4Bf16Config, ExecutionConfig, ExpertConfig, MoEActivationPack, MoEConfig, MoELayer,
        MoEWeightPack, QuantConfig, QuantFormat, RoutingConfig,
    )  # fmt: skip
    from flashinfer.fused_moe.runners import CuTileNvfp4Bf16Runner

    w13, w2 = w13.linear_scales(), w2.linear_scales()
    e, h, i = w13.packed.shape[0], w13.k, w2.k
    gs13 = w13.global_scale.float()
    gs13 = (gs13[:, None].expand(e, 2) if gs13.dim() == 1 else gs13)[:, [1, 0]]  # FlashInfer's order: up, gate

    def up_gate(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t[:, i:], t[:, :i]), 1).contiguous()

    view = CuTileNvfp4Bf16Config.prepare_weights(
        up_gate(w13.packed), up_gate(w13.block_scale), gs13.contiguous(), w2.packed.contiguous(),
        w2.block_scale.contiguous(), w2.global_scale.float().contiguous(), num_local_experts=e, hidden_size=h,
        intermediate_size=i, source_format="modelopt",
    )  # fmt: skip
    weights = MoEWeightPack()
    weights.prepare_for(CuTileNvfp4Bf16Runner.backend_key, view)
    layer = MoELayer(MoEConfig(
        routing=RoutingConfig(num_experts=e, top_k=top_k),
        quant=QuantConfig(weight=QuantFormat.NVFP4, activation=QuantFormat.BF16),
        experts=ExpertConfig(intermediate_size=i),
        backend=BackendOptions(candidates=(CuTileNvfp4Bf16Config(),)),
        execution=ExecutionConfig(tune_max_num_tokens=max_tokens),
    ), device=w13.packed.device)  # fmt: skip

    def run(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        pack = MoEActivationPack(x, None, topk_ids.to(torch.int32), topk_weights.float())
        return layer(pack, weights)

    return run
