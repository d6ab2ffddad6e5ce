"""The bench's vLLM baselines, on the same experts as ours: Marlin NVFP4 (what vLLM 0.26 runs ModelOpt NVFP4 MoE
with on Hopper), Humming NVFP4, and vLLM's Triton ``fused_experts`` on the dequantized BF16 weights.  vLLM and
humming are imported when a path is built, never at import."""

from __future__ import annotations

from .harness import MoEShape
from .path_base import Path, short_error

__all__ = ["BF16", "Humming", "Marlin", "vllm_activation"]


class _MarlinLayer:
    """The attributes prepare_nvfp4_moe_layer_for_marlin reads (num_experts, hidden_size,
    intermediate_size_per_partition, params_dtype) and writes (workspace); nothing else."""

    def __init__(self, num_experts: int, hidden: int, inter: int, params_dtype):
        import torch

        self.num_experts = num_experts
        self.hidden_size = hidden
        self.intermediate_size_per_partition = inter
        self.params_dtype = params_dtype
        self.workspace: torch.Tensor | None = None


class Marlin(Path):
    """vLLM 0.26 ModelOptNvFp4FusedMoE with the MARLIN backend (the one Hopper gets):
    process_weights_after_loading -> convert_to_nvfp4_moe_kernel_format -> prepare_nvfp4_moe_layer_for_marlin,
    then MarlinExperts.apply -> fused_marlin_moe with g1/g2_alphas = the processed weight_scale_2."""

    name, label, requires = "marlin", "Marlin", ("vllm",)

    def __init__(self, shape: MoEShape, w13_q, w2_q, copies: int):
        super().__init__(copies)
        import torch
        import vllm._custom_ops as ops
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
        from vllm.model_executor.layers.quantization.utils.marlin_utils import get_marlin_input_dtype
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
            prepare_nvfp4_moe_layer_for_marlin,
        )
        from vllm.scalar_type import scalar_types

        layer = _MarlinLayer(shape.experts, shape.hidden, shape.intermediate, torch.bfloat16)
        # ModelOpt: w13_weight_scale_2 is [E, 2]; vLLM keeps only [:, 0] (warns when gate != up).  Ours is
        # quantized with one scale per expert for w13, so [E] here is exactly what vLLM would keep.
        w13_gs = w13_q.global_scale.float()
        if w13_gs.dim() == 2:
            w13_gs = w13_gs[:, 0]
        out = prepare_nvfp4_moe_layer_for_marlin(
            layer=layer,
            w13=w13_q.packed,
            w13_scale=w13_q.block_scale,
            w13_scale_2=w13_gs.contiguous(),
            w2=w2_q.packed,
            w2_scale=w2_q.block_scale,
            w2_scale_2=w2_q.global_scale.float().contiguous(),
            is_act_and_mul=shape.expert_activation.gated,
        )
        self.add_copies(out)  # (w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
        self._call = fused_marlin_moe
        self._quant_type_id = scalar_types.float4_e2m1f.id
        self._activation = vllm_activation(shape)
        self._input_dtype = get_marlin_input_dtype()  # None unless VLLM_MARLIN_INPUT_DTYPE is set
        self._num_experts = shape.global_experts

        # MarlinExperts.moe_sum (no expert map): ops.moe_sum(input, output) sums in place; fused_marlin_moe
        # returns what moe_sum returns, so hand back the output tensor.  With an expert map, vLLM's own sum.
        def moe_sum(inp, outp, topk_ids, expert_map):
            ops.moe_sum(inp, outp)
            return outp

        self._moe_sum = moe_sum

    def fn(self, copy, x, topk_weights, topk_ids, expert_map=None):
        w13, w13_s, w13_gs, w2, w2_s, w2_gs = self.weights[copy]
        call = self._call

        def run():
            return call(
                hidden_states=x,
                w1=w13,
                w2=w2,
                bias1=None,
                bias2=None,
                w1_scale=w13_s,
                w2_scale=w2_s,
                topk_weights=topk_weights,
                topk_ids=topk_ids,
                quant_type_id=self._quant_type_id,
                apply_router_weight_on_input=False,
                global_num_experts=self._num_experts,
                activation=self._activation,
                moe_sum=self._moe_sum if expert_map is None else None,
                expert_map=expert_map,
                global_scale1=w13_gs,
                global_scale2=w2_gs,
                input_global_scale1=None,
                input_global_scale2=None,
                is_k_full=True,
                input_dtype=self._input_dtype,
            )

        return run


class Humming(Path):
    """vLLM 0.26 ModelOptNvFp4FusedMoE with the HUMMING backend (``--moe-backend humming``; 0.26 picks Marlin on
    Hopper by default, its oracle trying MARLIN before HUMMING).  As __init__ and process_weights_after_loading do:
    select_nvfp4_moe_backend(moe_backend="humming", kNvfp4Static, kNvfp4Dynamic), then on a layer holding the
    ModelOpt parameters convert_to_nvfp4_moe_kernel_format -> convert_to_humming_moe_kernel_format(quant_config
    {"quant_method": "modelopt", "quant_algo": "nvfp4"}), get_humming_moe_quant_config (what
    make_nvfp4_moe_quant_config returns for HUMMING; it asserts a RoutedExperts) and make_nvfp4_moe_kernel (the
    replace_parameter calls between them only re-register the converted tensors under ModelOpt's names); each
    forward is FusedMoEKernel.apply as ModelOptNvFp4FusedMoE.apply calls it (no-EP prepare/finalize: no all2all).

    vLLM accepts NVFP4 on sm_90: HummingExpertsBase wants has_humming(), CUDA and sm >= 7.5, and lists
    (kNvfp4Static, kNvfp4Dynamic).  Of BatchedHummingGrouped- (batched activation format only), HummingGrouped- and
    HummingIndexedExperts, the last two must match VLLM_HUMMING_MOE_GEMM_TYPE (unset: indexed), so this is
    HummingIndexedExperts: moe_align_block_size, a w13 GEMM gathering x per (token, k), SiLU-and-mul, a w2 GEMM,
    moe_fused_mul_sum.  Activations stay bf16 (W4A16) whatever the checkpoint's input scales say: Humming's input
    schema comes from VLLM_HUMMING_INPUT_QUANT_CONFIG (unset: none).  A one-scale w13 (as here) keeps fp8 block
    scales with a per-expert global scale; gate != up scales would be folded into bf16 block scales.  A refusal
    (humming-kernels missing or not importing, no CUDA) raises RuntimeError with the reason.

    Context: the experts read get_forward_context().dp_metadata (estimate_local_valid_shape_m) and the modular
    kernel takes its workspaces from vLLM's WorkspaceManager; an empty ForwardContext (no DP) wraps each call and
    the manager is initialized once on this device, as a model runner does.  No VllmConfig is involved.

    JIT: the first forward of a layer shape compiles (NVRTC, 16 threads) one kernel per distinct entry of
    humming's sm_90 tuning table, every token count at once (humming-kernels 0.1.10: 22 for each of w13 and w2, of
    Mixtral and of Qwen3 alike); ``import humming`` starts building its C++ launcher (torch cpp_extension) in the
    background.  Cubins are cached on disk in ~/.humming/cache (HUMMING_CACHE_DIR), which a fresh machine lacks: on
    a fresh H200 (2026-11-26) the warm-up forward here took 17-30 s per shape, in the setup time, not in the first
    row.  Weight copies clone the converted layer (the kernels see the same metadata)."""

    name, label, requires = "humming", "Humming", ("vllm", "humming")

    def __init__(self, shape: MoEShape, w13_q, w2_q, copies: int):
        super().__init__(copies)
        if shape.global_experts != shape.experts:
            raise RuntimeError("the Humming path here has no expert map (expert-parallel shapes run without it)")
        if shape.activation != "silu":
            raise RuntimeError(f"the Humming path here runs SiLU-and-mul experts only, not {shape.activation}")
        try:  # vLLM's has_humming() swallows this error, and its oracle then blames the device
            import humming  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - e.g. a missing cuda-bindings
            raise RuntimeError(f"humming-kernels does not import: {short_error(exc)}") from exc
        import torch
        from vllm.forward_context import ForwardContext, override_forward_context
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.config import (
            FusedMoEConfig,
            FusedMoEParallelConfig,
            get_routing_method_type,
        )
        from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import make_nvfp4_moe_kernel, select_nvfp4_moe_backend
        from vllm.model_executor.layers.quantization.utils.humming_utils import get_humming_moe_quant_config
        from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Dynamic, kNvfp4Static
        from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

        e, h, i, device = shape.experts, shape.hidden, shape.intermediate, w13_q.packed.device
        moe = FusedMoEConfig(
            num_experts=e,
            experts_per_token=shape.top_k,
            hidden_dim=h,
            intermediate_size=i,
            num_local_experts=e,
            num_logical_experts=e,
            activation=MoEActivation.SILU,
            device=device,
            routing_method=get_routing_method_type("softmax", shape.top_k, shape.renormalize, None, False),
            moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
            in_dtype=torch.bfloat16,
            moe_backend="humming",
        )
        try:
            backend, experts_cls = select_nvfp4_moe_backend(moe, kNvfp4Static, kNvfp4Dynamic)
        except ValueError as exc:  # "... does not support the deployment configuration since <reason>"
            raise RuntimeError(f"vLLM 0.26's oracle refuses HUMMING: {str(exc).rpartition(' since ')[2]}") from exc

        self.add_copies(_humming_layer(moe, backend, w13_q, w2_q, i))

        def kernel(copy_layer):
            k = make_nvfp4_moe_kernel(
                get_humming_moe_quant_config(copy_layer), moe, experts_cls, backend, layer=copy_layer
            )
            k.fused_experts.process_weights_after_loading(copy_layer)
            return k

        self._kernels = [kernel(copy_layer) for copy_layer in self.weights]
        if not is_workspace_manager_initialized():
            init_workspace_manager(device)
        self._context = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={})
        self._override = override_forward_context
        self._silu = MoEActivation.SILU
        self._num_experts = e
        x = torch.zeros(1, h, device=device, dtype=torch.bfloat16)
        topk_ids = torch.arange(shape.top_k, device=device, dtype=torch.int32)[None]
        self.fn(0, x, torch.full(topk_ids.shape, 1 / shape.top_k, device=device), topk_ids)()  # the JIT, here

    def fn(self, copy, x, topk_weights, topk_ids, expert_map=None):
        layer, kernel, context, override = self.weights[copy], self._kernels[copy], self._context, self._override

        def run():
            with override(context):
                return kernel.apply(
                    x,
                    layer.w13_weight,
                    layer.w2_weight,
                    topk_weights,
                    topk_ids,
                    activation=self._silu,
                    global_num_experts=self._num_experts,
                    expert_map=None,
                    apply_router_weight_on_input=False,
                )

        return run


def _humming_layer(moe, backend, w13_q, w2_q, intermediate: int):
    """A RoutedExperts stand-in holding ModelOptNvFp4FusedMoE's parameters as loaded, converted by vLLM 0.26's
    NVFP4 oracle into ``backend``'s format (Humming's)."""
    import torch
    from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import convert_to_nvfp4_moe_kernel_format

    e, h, i, device = moe.num_experts, moe.hidden_dim, intermediate, w13_q.packed.device
    # What the Humming code reads of a RoutedExperts, and ModelOptNvFp4FusedMoE.create_weights' parameters as
    # loaded: clones, since the conversion may take views of them.  w13_weight_scale_2 is [E, 2] (gate, up);
    # the activation scales are there but unused (bf16 activations).
    layer = torch.nn.Module()
    layer.layer_name, layer.moe_config, layer.params_dtype = "model.layers.0.mlp.experts", moe, torch.bfloat16
    layer.hidden_size, layer.intermediate_size_per_partition = h, i
    layer.global_num_experts = layer.local_num_experts = e
    checkpoint = {
        "w13_weight": w13_q.packed,
        "w13_weight_scale": w13_q.block_scale,
        "w13_weight_scale_2": w13_q.global_scale.float().reshape(e, -1).expand(e, 2),
        "w13_input_scale": torch.ones(e, 2, device=device),
        "w2_weight": w2_q.packed,
        "w2_weight_scale": w2_q.block_scale,
        "w2_weight_scale_2": w2_q.global_scale.float(),
        "w2_input_scale": torch.ones(e, device=device),
    }
    for name, t in checkpoint.items():
        layer.register_parameter(name, torch.nn.Parameter(t.contiguous().clone(), requires_grad=False))
    convert_to_nvfp4_moe_kernel_format(
        nvfp4_backend=backend,
        layer=layer,
        w13=layer.w13_weight,
        w13_scale=layer.w13_weight_scale,
        w13_scale_2=layer.w13_weight_scale_2[:, 0].contiguous(),
        a13_scale=layer.w13_input_scale,
        w2=layer.w2_weight,
        w2_scale=layer.w2_weight_scale,
        w2_scale_2=layer.w2_weight_scale_2,
        a2_scale=layer.w2_input_scale,
        is_act_and_mul=True,
    )
    return layer


class BF16(Path):
    """vLLM 0.26 Triton fused_experts on the dequantized bf16 weights (unquantized config)."""

    name, label, weights, requires = "bf16", "BF16", "bf16", ("vllm",)

    def __init__(self, shape: MoEShape, w13_bf16, w2_bf16, copies: int):
        super().__init__(copies)
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

        if w13_bf16 is None:
            raise RuntimeError("no BF16 weights: the dequantized layer did not fit in GPU memory")
        self._call = fused_experts
        self._num_experts = shape.global_experts
        self._activation = vllm_activation(shape)
        self.add_copies((w13_bf16, w2_bf16))

    def fn(self, copy, x, topk_weights, topk_ids, expert_map=None):
        w13, w2 = self.weights[copy]
        call, n, act = self._call, self._num_experts, self._activation
        return lambda: call(
            x, w13, w2, topk_weights, topk_ids, activation=act, global_num_experts=n, expert_map=expert_map
        )


def vllm_activation(shape: MoEShape):
    """vLLM's MoEActivation for the shape's experts (silu, or relu2_no_mul: not gated)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    names = {"silu": MoEActivation.SILU, "relu2": MoEActivation.RELU2_NO_MUL}
    if shape.activation not in names:
        raise RuntimeError(f"no vLLM activation here for {shape.activation} experts")
    return names[shape.activation]
