"""``NVFP4GroupedMoEMethod``: vLLM ``FusedMoEMethodBase`` running routed experts on ``moe_nvfp4.fused_moe``.

Life of a layer (``RoutedExperts``, the same in vLLM 0.26 and 0.33; ``compat`` holds what differs):

1. ``create_weights``: checkpoint-shaped parameters, loaded by ``RoutedExperts.weight_loader`` (TP slicing of
   the intermediate dimension, global -> local expert ids for EP).  Each loader is wrapped (``loading``): it
   rejects a tensor of the wrong dtype or shape (``copy_`` would silently convert or broadcast it) and records what
   arrived, so a tensor the checkpoint lacks is reported instead of leaving uninitialised memory.
2. ``process_weights_after_loading``: every local expert's tensors are checked by ``moe_nvfp4.validate`` (the
   validator ``inspect`` and the converter run: never loaded, NaN/inf, negative, zero block scales over data,
   non-positive scales as multipliers, outlier W4A4 input scales; ``loading.validate_loaded_experts``), gate and up
   keep their own global scales, BF16 experts are quantized expert by expert, ``moe_nvfp4.prepare_moe_weights``
   packs for the kernel and the checkpoint parameters are freed.
   Then, once per process and layer shape, ``moe_nvfp4.load_moe_configs`` registers the configs
   ``moe-nvfp4 tune`` cached for this GPU and shape, if any (else the default serves; ``MOE_NVFP4_AUTOTUNE=1``
   times configs here first), and ``moe_nvfp4.warmup.compile_kernels`` compiles every kernel variant up to the
   scheduler's token budget, in threads, so no request ever waits on a Triton compile.
3. ``apply``: ``moe_nvfp4.fused_moe`` with the router's ``topk_weights`` / ``topk_ids`` (the MoE runner calls
   ``RoutedExperts.forward_modular`` -> ``apply`` after ``router.select_experts``) and the layer's expert map; under
   DP + EP, vLLM's all2all around our experts instead (``modular``, design 009).
   No host synchronisation, so vLLM's CUDA graphs capture it.  The output is always finalized (the top-k sum).

Activations stay in BF16/FP16 on Hopper: a W4A4 checkpoint's input scales are loaded and validated, not used.
On sm_100/sm_103 (``moe_nvfp4.dispatch.select_backends`` has a W4A4 MoE backend there: FlashInfer's fused MoE,
or our CuTe DSL kernels with ``MOE_NVFP4_BACKEND=cute``; ``MOE_NVFP4_BACKEND=triton`` keeps the 16-bit path) a
checkpoint with input scales runs W4A4: ``prepare_moe_weights_w4a4`` and ``fused_moe_w4a4``
with each GEMM's largest input scale over the local experts (one value per GEMM: the activations of all
experts are quantized in one launch, and the largest calibrated range saturates none of them).
"""

from __future__ import annotations

import time

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, FusedMoeWeightScaleSupported, MoEActivation
from vllm.model_executor.utils import set_weight_attrs

import moe_nvfp4
from moe_nvfp4.checkpoint import TENSOR_NAMES, CheckpointError, Convention
from moe_nvfp4.dispatch import select_backends
from moe_nvfp4.expert_activation import RELU2, SILU, ExpertActivation
from moe_nvfp4.formats import NVFP4, NVFP4Tensor, quantize_nvfp4
from moe_nvfp4.warmup import compile_kernels, warmup_threads

from .compat import MoEMethodCompat, keep_finalized
from .modular import apply_moe_kernel, make_moe_kernel
from .loading import (
    BIAS,
    BLOCK_SCALE,
    DENSE,
    GLOBAL_SCALE,
    INPUT_SCALE,
    PACKED,
    W13_NON_GATED,
    W13_SHARDS,
    CheckedLoader,
    ExpertParam,
    deinterleave_rows,
    validate_loaded_experts,
)

__all__ = ["NVFP4GroupedMoEMethod", "WEIGHTS_ATTR"]

WEIGHTS_ATTR = "moe_nvfp4_weights"  # the packed MoEWeights on the layer after loading
_WARMED: set[tuple] = set()  # (shape, dtype, top_k, expert map, tokens) already compiled in this process
logger = init_logger(f"vllm.{__name__}")  # under "vllm", whose handlers vLLM configures

# gpt-oss's defaults for vLLM's swigluoai_and_mul (vllm.model_executor.layers.activation.SwigluOAIAndMul)
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0


def expert_activation(moe) -> ExpertActivation | str:
    """The ``moe_nvfp4`` activation computing the layer's ``FusedMoEConfig`` activation, or why there is none.

    vLLM's ``swigluoai`` takes gate/up interleaved in w13 (gpt-oss); the method de-interleaves at load, so the
    kernel's ``swiglu_oai`` sees gate rows then up rows like every other gated activation."""
    act = moe.activation
    clamped = moe.swiglu_limit is not None or moe.swiglu_alpha is not None or moe.swiglu_beta is not None
    if act is MoEActivation.SILU and not clamped:
        return SILU
    if act is MoEActivation.RELU2_NO_MUL and not clamped:
        return RELU2
    if act is MoEActivation.SWIGLUOAI and moe.swiglu_beta is None:
        alpha = SWIGLU_OAI_ALPHA if moe.swiglu_alpha is None else moe.swiglu_alpha
        limit = SWIGLU_OAI_LIMIT if moe.swiglu_limit is None else moe.swiglu_limit
        return ExpertActivation("swiglu_oai", alpha=alpha, limit=limit)
    if clamped:
        return (
            f"activation {act.value} with swiglu limit/alpha/beta {moe.swiglu_limit}/{moe.swiglu_alpha}/"
            f"{moe.swiglu_beta} (implemented: gated silu, swigluoai with limit and alpha, relu2_no_mul)"
        )
    return f"activation {act.value} (implemented: gated silu, swigluoai, relu2_no_mul)"


class NVFP4GroupedMoEMethod(MoEMethodCompat, FusedMoEMethodBase):
    """Routed experts as NVFP4 (ModelOpt or compressed-tensors tensors, or BF16 quantized on load).

    quant_config: the ``NVFP4GroupedConfig`` (convention None = BF16 checkpoint); moe: the layer's
    ``FusedMoEConfig``.  Gated SiLU, gpt-oss's swigluoai with expert biases, and Nemotron-H's non-gated
    relu2_no_mul (w13 then holds one projection of I rows); the router weight on the input where the layer asks
    (Llama-4).
    """

    def __init__(self, quant_config, moe) -> None:
        super().__init__(moe)
        keep_finalized(moe)
        self.quant_config = quant_config
        self.convention: Convention | None = quant_config.convention
        self.params: list[ExpertParam] = []
        self.activation = expert_activation(moe)  # a str says why the layer is refused (in create_weights)
        self.w13_shards = W13_SHARDS if moe.is_act_and_mul else W13_NON_GATED
        self.loaded: set[tuple[str, int, str]] = set()  # (param name, local expert, shard id)
        self.w13_input_scale: torch.Tensor | None = None  # validated multipliers [E, 2], unused on Hopper
        self.w2_input_scale: torch.Tensor | None = None
        self.w4a4_input_scales: tuple[torch.Tensor, torch.Tensor] | None = None  # set where W4A4 runs (sm_100)
        self.fp8_weights = None  # moe_nvfp4.prepare_fp8_weights' copy, where the W4A8 mode is on
        vllm_config = get_current_vllm_config_or_none()
        # The most tokens one forward can see: the scheduler's budget, gathered over data-parallel ranks.
        self.max_tokens = vllm_config.scheduler_config.max_num_batched_tokens * moe.dp_size if vllm_config else 0

    # ---- parameters ----

    def uses_weight_scale_2_pattern(self) -> bool:
        return self.convention is Convention.MODELOPT

    def _layout(self) -> list[ExpertParam]:
        bias = [ExpertParam("w13_bias", BIAS, self.w13_shards, "bias"), ExpertParam("w2_bias", BIAS, ("w2",), "bias")]
        out = bias if self.moe.has_bias else []
        if self.convention is None:
            return out + [
                ExpertParam("w13_weight", DENSE, self.w13_shards, "weight"),
                ExpertParam("w2_weight", DENSE, ("w2",), "weight"),
            ]
        packed, scale, global_, input_, _ = TENSOR_NAMES[self.convention]
        for kind, suffix in ((PACKED, packed), (BLOCK_SCALE, scale), (GLOBAL_SCALE, global_), (INPUT_SCALE, input_)):
            out.append(ExpertParam(f"w13_{suffix}", kind, self.w13_shards, suffix))
            out.append(ExpertParam(f"w2_{suffix}", kind, ("w2",), suffix))
        return out

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        name = getattr(layer, "layer_name", "moe")
        self._check_supported(layer, name, hidden_size, intermediate_size_per_partition)
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        s = len(self.w13_shards)  # w13 projections: gate and up, or one for a non-gated layer
        block = NVFP4.block_size
        shapes = {
            ("w13", PACKED): ((e, s * i, h // 2), torch.uint8, 0),
            ("w2", PACKED): ((e, h, i // 2), torch.uint8, 0),
            ("w13", BLOCK_SCALE): ((e, s * i, h // block), NVFP4.scale_dtype, float("nan")),
            ("w2", BLOCK_SCALE): ((e, h, i // block), NVFP4.scale_dtype, float("nan")),
            ("w13", GLOBAL_SCALE): ((e, s), torch.float32, float("nan")),
            ("w2", GLOBAL_SCALE): ((e,), torch.float32, float("nan")),
            ("w13", INPUT_SCALE): ((e, s), torch.float32, float("nan")),
            ("w2", INPUT_SCALE): ((e,), torch.float32, float("nan")),
            ("w13", DENSE): ((e, s * i, h), params_dtype, float("nan")),
            ("w2", DENSE): ((e, h, i), params_dtype, float("nan")),
            ("w13", BIAS): ((e, s * i), params_dtype, float("nan")),
            ("w2", BIAS): ((e, h), params_dtype, float("nan")),
        }
        scale_kind = {
            BLOCK_SCALE: FusedMoeWeightScaleSupported.BLOCK.value,
            GLOBAL_SCALE: FusedMoeWeightScaleSupported.TENSOR.value,
            INPUT_SCALE: FusedMoeWeightScaleSupported.TENSOR.value,
        }
        vllm_loader = extra_weight_attrs["weight_loader"]
        self.params = self._layout()
        for p in self.params:
            shape, dtype, fill = shapes[(p.name[: p.name.index("_")], p.kind)]
            if dtype == NVFP4.scale_dtype:  # e4m3 NaN is byte 0x7F; fill the bytes (no fp8 fill kernel needed)
                data = torch.full(shape, 0x7F, dtype=torch.uint8).view(dtype)
            else:
                data = torch.full(shape, fill, dtype=dtype)
            param = torch.nn.Parameter(data, requires_grad=False)
            layer.register_parameter(p.name, param)
            attrs = {k: v for k, v in extra_weight_attrs.items() if k != "weight_loader"}
            if p.kind in scale_kind:
                attrs["quant_method"] = scale_kind[p.kind]
            # Biases keep vLLM's loader, as its unquantized method does: gpt-oss's model copies them (and its BF16
            # w13/w2) into the parameters itself, stacked; the NaN fill tells what it never wrote.
            attrs["weight_loader"] = vllm_loader if p.kind == BIAS else CheckedLoader(self, layer, p, vllm_loader)
            set_weight_attrs(param, attrs)

    def _check_supported(self, layer: torch.nn.Module, name: str, hidden: int, inter: int) -> None:
        moe = self.moe
        if isinstance(self.activation, str):
            raise NotImplementedError(f"{name}: nvfp4_grouped does not support {self.activation}")
        block = NVFP4.block_size
        if inter % block or inter % 2:
            tp = moe.tp_size
            raise ValueError(
                f"{name}: the expert intermediate size {moe.intermediate_size} split over tensor parallel size {tp} "
                f"gives {inter} per rank, which is not a multiple of {block}: TP would split an NVFP4 scale block. "
                f"Use a TP size that divides {moe.intermediate_size // block} or expert parallelism "
                f"(--enable-expert-parallel)."
            )
        if hidden % block:
            raise ValueError(f"{name}: hidden size {hidden} is not a multiple of the NVFP4 block size {block}")

    # ---- after loading ----

    def _global_ids(self, layer: torch.nn.Module, n_local: int) -> list[int]:
        expert_map = getattr(layer, "expert_map", None)
        if expert_map is None:
            return list(range(n_local))
        out = [-1] * n_local
        for g, local in enumerate(expert_map.tolist()):
            if 0 <= local < n_local:
                out[local] = g
        return out

    def proj_name(self, layer: torch.nn.Module, shard: str) -> str:
        names = {
            "w1": getattr(layer, "ckpt_gate_proj_name", "gate_proj"),
            "w3": getattr(layer, "ckpt_up_proj_name", "up_proj"),
            "w2": getattr(layer, "ckpt_down_proj_name", "down_proj"),
        }
        return names[shard]

    def _written(self, layer: torch.nn.Module, p: ExpertParam, expert: int, shard: str) -> bool:
        """Whether a float parameter's rows of one expert and shard lost their NaN fill: gpt-oss's model loader
        copies its stacked BF16 experts and biases into the parameters itself, past every weight loader."""
        if p.kind not in (DENSE, BIAS):
            return False
        rows = getattr(layer, p.name).data[expert]
        rows = rows.chunk(len(p.shards), dim=0)[p.shards.index(shard)]
        return not bool(torch.isnan(rows).any())

    def _check_loaded(self, layer: torch.nn.Module, n_local: int, global_ids: list[int]) -> bool:
        """Raise for any expert tensor that never arrived (NVFP4 checkpoints: biases only, the validator checks the
        rest); return whether input scales were loaded."""
        name = getattr(layer, "layer_name", "moe")
        has_input = any(p == inp.name for p, _, _ in self.loaded for inp in self.params if inp.kind == INPUT_SCALE)
        need_input = self.quant_config.input_scales or has_input
        for p in self.params:
            if (p.kind == INPUT_SCALE and not need_input) or (self.convention is not None and p.kind != BIAS):
                continue
            for e in range(n_local):
                for shard in p.shards:
                    if (p.name, e, shard) not in self.loaded and not self._written(layer, p, e, shard):
                        why = (
                            " (a W4A4 checkpoint needs input scales for every expert)" if p.kind == INPUT_SCALE else ""
                        )
                        tensor = f"{self.proj_name(layer, shard)}.{p.suffix}"
                        raise CheckpointError(
                            f"{name}: expert {global_ids[e]} {tensor} was never loaded: "
                            f"the checkpoint has no {name}.{global_ids[e]}.{tensor}{why}"
                        )
        return need_input

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        name = getattr(layer, "layer_name", "moe")
        n_local = getattr(layer, self.params[0].name).shape[0]
        global_ids = self._global_ids(layer, n_local)
        # vLLM's swigluoai takes w13 rows interleaved, as gpt-oss's model copies its stacked BF16 tensors in; rows
        # that came through the weight loader as w1/w3 shards (every NVFP4 checkpoint's) are gate then up already.
        interleaved = self.activation.name == "swiglu_oai" and not any(p.startswith("w13_") for p, _, _ in self.loaded)
        self._check_loaded(layer, n_local, global_ids)
        biases = {p.name: getattr(layer, p.name).data for p in self.params if p.kind == BIAS}
        if self.convention is None:
            w13, w2 = self._quantize_dense(layer, name, global_ids, interleaved)
        else:
            params = {p.name: getattr(layer, p.name).data for p in self.params if p.kind != BIAS}
            projections = tuple(self.proj_name(layer, shard) for shard in (*self.w13_shards, "w2"))
            has_input = validate_loaded_experts(
                name,
                params,
                self.loaded,
                global_ids,
                self.convention,
                projections,
                require_input_scales=self.quant_config.input_scales,
            )
            w13, w2 = self._checkpoint_tensors(layer, has_input)
        w13_bias, w2_bias = biases.get("w13_bias"), biases.get("w2_bias")
        if w13_bias is not None and interleaved:
            w13_bias = deinterleave_rows(w13_bias)
        for p in self.params:
            delattr(layer, p.name)  # the checkpoint copies; prepare_moe_weights makes the kernel's own
        self.loaded.clear()
        plain = self.activation == SILU and not self.moe.has_bias and not layer.apply_router_weight_on_input
        w4a4 = select_backends(w13.packed.device).moe_w4a4
        if plain and self.w13_input_scale is not None and w4a4 is not None and not w4a4.reference:
            if global_ids != list(range(global_ids[0], global_ids[0] + n_local)):
                raise ValueError(
                    f"{name}: the W4A4 MoE takes this rank's experts as one contiguous range of global "
                    f"ids, got {global_ids}; use the linear expert placement"
                )
            self.w4a4_input_scales = (
                self.w13_input_scale.max().reshape(1).float(),
                self.w2_input_scale.max().reshape(1).float(),
            )
            setattr(layer, WEIGHTS_ATTR, moe_nvfp4.prepare_moe_weights_w4a4(w13, w2, expert_offset=global_ids[0]))
            return
        # packed into the checkpoint tensors' own memory (their parameters are gone): one expert's block extra;
        # the W4A8 mode folds its e4m3 copy from them after packing (no layout to unpack), so they are kept then
        fp8 = self.quant_config.fp8_activations
        weights = moe_nvfp4.prepare_moe_weights(
            w13, w2, activation=self.activation, w13_bias=w13_bias, w2_bias=w2_bias, reuse_input_memory=not fp8
        )
        if fp8:
            self.fp8_weights = moe_nvfp4.prepare_fp8_weights(weights, (w13, w2))
            logger.info_once(
                "nvfp4_grouped: W4A8 mode on: an e4m3 copy of the experts, %.1f MB a layer beside %.1f MB of NVFP4, "
                "for prefill-sized forwards (design 008)",
                self.fp8_weights.nbytes() / 1e6,
                weights.nbytes() / 1e6,
            )
        del w13, w2, w13_bias, w2_bias
        setattr(layer, WEIGHTS_ATTR, weights)
        # under DP + EP vLLM's all2all dispatches to our experts (design 009); elsewhere None: apply() calls fused_moe
        self.moe_kernel = make_moe_kernel(self.moe, weights, layer._expert_routing_tables())
        self._warmup(layer, weights)

    def _warmup(self, layer: torch.nn.Module, weights: moe_nvfp4.MoEWeights) -> None:
        """Take the configs cached for this shape (MOE_NVFP4_AUTOTUNE=1: tune them here first), then compile the
        kernels for every token count now (Triton compiles lazily, per config), in threads."""
        dtype, top_k, expert_map = self.moe.in_dtype, self.moe.experts_per_token, layer.expert_map
        on_input = layer.apply_router_weight_on_input  # its own GEMM1 gather and combine: compiled apart
        key = (
            weights.w13_packed.shape,
            weights.w2_packed.shape,
            weights.w13_packed.device,
            dtype,
            top_k,
            None if expert_map is None else expert_map.numel(),
            self.max_tokens,
            self.activation,
            self.moe.has_bias,
            on_input,
            self.fp8_weights is not None,
        )
        if key in _WARMED or dtype not in (torch.bfloat16, torch.float16):
            return
        report = moe_nvfp4.load_moe_configs(weights, top_k, dtype, self.max_tokens, expert_map=expert_map)
        if report is not None and report.source != "cpu":  # the CPU's torch reference: nothing to choose
            logger.info("nvfp4_grouped: autotune %s", report.summary())
        start, threads = time.perf_counter(), warmup_threads()
        counts = compile_kernels(
            weights,
            top_k,
            dtype,
            self.max_tokens,
            forward=moe_nvfp4.fused_moe,
            expert_map=expert_map,
            apply_router_weight_on_input=on_input,
            fp8_weights=self.fp8_weights,
            threads=threads,
        )
        _WARMED.add(key)
        if counts:
            torch.cuda.empty_cache()  # the warm-up's temporaries are not the model's memory
            logger.info(
                "nvfp4_grouped: compiled MoE kernels for token counts %s (up to %d) in %.1f s, %d threads",
                counts,
                self.max_tokens,
                time.perf_counter() - start,
                threads,
            )

    def _by_kind(self, layer: torch.nn.Module, prefix: str, kind: str) -> torch.Tensor:
        p = next(p for p in self.params if p.kind == kind and p.name.startswith(prefix + "_"))
        return getattr(layer, p.name).data

    def _checkpoint_tensors(self, layer: torch.nn.Module, has_input: bool) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        reciprocal = TENSOR_NAMES[self.convention][4]
        get = lambda prefix, kind: self._by_kind(layer, prefix, kind)  # noqa: E731
        if has_input:
            a13, a2 = get("w13", INPUT_SCALE).clone(), get("w2", INPUT_SCALE).clone()
            self.w13_input_scale, self.w2_input_scale = (1.0 / a13, 1.0 / a2) if reciprocal else (a13, a2)
        g13, g2 = get("w13", GLOBAL_SCALE), get("w2", GLOBAL_SCALE)
        if reciprocal:  # compressed-tensors stores 1 / multiplier
            g13, g2 = 1.0 / g13, 1.0 / g2
        if len(self.w13_shards) == 1:
            g13 = g13.reshape(-1)  # one projection: one scale per expert
        w13 = NVFP4Tensor(get("w13", PACKED), get("w13", BLOCK_SCALE), g13.contiguous())  # [E, 2]: gate, up exact
        w2 = NVFP4Tensor(get("w2", PACKED), get("w2", BLOCK_SCALE), g2.contiguous())
        return w13, w2

    def _quantize_dense(
        self, layer: torch.nn.Module, name: str, global_ids: list[int], interleaved: bool
    ) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        """BF16 experts -> NVFP4, one expert at a time (gate and up get separate global scales)."""
        dense = {"w13": layer.w13_weight.data, "w2": layer.w2_weight.data}
        out = {}
        for prefix, w in dense.items():
            e, n, k = w.shape
            packed = torch.empty(e, n, k // 2, dtype=torch.uint8, device=w.device)
            scale = torch.empty(e, n, k // NVFP4.block_size, dtype=NVFP4.scale_dtype, device=w.device)
            segments = len(self.w13_shards) if prefix == "w13" else 1
            gs = torch.empty((e, segments) if segments > 1 else (e,), dtype=torch.float32, device=w.device)
            for expert in range(e):
                dense_expert = w[expert]
                if prefix == "w13" and interleaved:  # one expert at a time: a copy of the layer is its BF16 size again
                    dense_expert = deinterleave_rows(w[expert : expert + 1])[0]
                if not bool(torch.isfinite(dense_expert).all()):
                    rows = n // segments
                    bad_row = int((~torch.isfinite(dense_expert)).any(-1).nonzero()[0, 0])
                    shard = self.w13_shards[bad_row // rows] if prefix == "w13" else "w2"
                    raise CheckpointError(
                        f"{name}: expert {global_ids[expert]} {self.proj_name(layer, shard)}.weight holds NaN or inf"
                    )
                q = quantize_nvfp4(dense_expert, segments=segments)
                packed[expert], scale[expert], gs[expert] = q.packed, q.block_scale, q.global_scale
            out[prefix] = NVFP4Tensor(packed, scale, gs)
        return out["w13"], out["w2"]

    # ---- forward ----

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # vLLM builds no kernel of its own for us: make_moe_kernel builds ours where an all2all runs

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts=None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Shared experts are run by the MoE runner itself (mk_can_overlap_shared_experts is False here).
        if self.w4a4_input_scales is not None:
            w13_scale, w2_scale = self.w4a4_input_scales
            return moe_nvfp4.fused_moe_w4a4(
                x,
                getattr(layer, WEIGHTS_ATTR),
                topk_weights,
                topk_ids,
                w13_input_scale=w13_scale,
                w2_input_scale=w2_scale,
                expert_map=layer.expert_map,
            )
        if self.moe_kernel is not None:
            return apply_moe_kernel(
                self.moe_kernel, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input
            )
        # the router's weights and ids as they come: the API casts them once (ids past int32 saturate out of range
        # instead of wrapping onto an expert, as a plain .to(int32) here did first)
        return moe_nvfp4.fused_moe(
            x,
            getattr(layer, WEIGHTS_ATTR),
            topk_weights,
            topk_ids,
            expert_map=layer.expert_map,
            apply_router_weight_on_input=layer.apply_router_weight_on_input,
            fp8_weights=self.fp8_weights,
        )
