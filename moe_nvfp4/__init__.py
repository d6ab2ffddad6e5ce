"""moe-nvfp4: NVFP4 Mixture-of-Experts kernels and formats.  Public names only; no import-time side effects."""

from .api import (
    MoEWeights,
    fused_moe,
    prepare_fp8_weights,
    fused_moe_batched,
    fused_moe_w4a4,
    grouped_gemm_nvfp4,
    launch_grouped_gemm_nvfp4,
    load_moe_configs,
    plan_grouped_gemm_nvfp4,
    prepare_moe_weights,
    prepare_moe_weights_w4a4,
    quantize_activations,
    warmup_fused_moe,
)
from .expert_activation import RELU2, SILU, SWIGLU_OAI, ExpertActivation
from .checkpoint import CheckpointError, Convention, NVFP4Linear, from_checkpoint, to_checkpoint, validate_nvfp4
from .formats import (
    NVFP4,
    NVFP4Format,
    NVFP4Tensor,
    ScaleLayout,
    dequantize_nvfp4,
    quantize_activations_nvfp4,
    quantize_nvfp4,
)
from .layouts import swizzle_scales_128x4, unswizzle_scales_128x4
from .reference import fused_moe_batched_torch, fused_moe_torch, grouped_gemm_nvfp4_torch, moe_dense_torch
from .routing import RoutingPlan, plan_batched_routing, plan_routing, topk_sigmoid_grouped, topk_softmax

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ExpertActivation",
    "RELU2",
    "SILU",
    "SWIGLU_OAI",
    "MoEWeights",
    "fused_moe",
    "prepare_fp8_weights",
    "fused_moe_batched",
    "fused_moe_batched_torch",
    "fused_moe_w4a4",
    "prepare_moe_weights",
    "prepare_moe_weights_w4a4",
    "Convention",
    "NVFP4",
    "NVFP4Format",
    "NVFP4Linear",
    "NVFP4Tensor",
    "RoutingPlan",
    "ScaleLayout",
    "dequantize_nvfp4",
    "from_checkpoint",
    "fused_moe_torch",
    "grouped_gemm_nvfp4",
    "launch_grouped_gemm_nvfp4",
    "load_moe_configs",
    "plan_grouped_gemm_nvfp4",
    "grouped_gemm_nvfp4_torch",
    "moe_dense_torch",
    "plan_batched_routing",
    "plan_routing",
    "quantize_activations",
    "quantize_activations_nvfp4",
    "quantize_nvfp4",
    "swizzle_scales_128x4",
    "to_checkpoint",
    "topk_sigmoid_grouped",
    "topk_softmax",
    "unswizzle_scales_128x4",
    "validate_nvfp4",
    "warmup_fused_moe",
]
