"""NVFP4 MoE forward: ours vs vLLM 0.26 Marlin NVFP4 (and Humming NVFP4) vs vLLM Triton BF16, against measured floors.

    python benchmarks/bench_moe.py --out benchmarks/results            # full run (< 8 min on an H200)
    python benchmarks/bench_moe.py --quick --out /tmp/moe               # 3 token counts, fewer replays
    python benchmarks/bench_moe.py --paths ours,marlin,humming,bf16     # with vLLM's Humming (JIT: minutes)

One process, one GPU.  For each model and token count T: random bf16 x and router logits, softmax
top-k (renormalized), random bf16 expert weights quantized once to NVFP4 (one global scale per expert
and matrix, as vLLM's ModelOpt path uses for w13); all the paths compute the same function on the same
dequantized weights:

  ours     moe_nvfp4.prepare_moe_weights(w13_q, w2_q); moe_nvfp4.fused_moe(x, weights, topk_w, topk_ids)
  marlin   vLLM prepare_nvfp4_moe_layer_for_marlin(...) then fused_marlin_moe(...), W4A16 NVFP4
  humming  vLLM convert_to_humming_moe_kernel_format(...) then the HummingIndexedExperts kernel, W4A16 NVFP4
           (opt-in: --paths; its first forward JIT-compiles humming's kernels)
  bf16     vLLM fused_experts(x, w13_bf16, w2_bf16, topk_w, topk_ids) on the dequantized weights

Outputs are checked against each other (and a float32 torch reference) before timing; timing is CUDA
graph replay with rotating weight copies so L2 never holds the weights between calls (harness.py).
Writes moe.json, moe.md and moe.png (when matplotlib is importable) into --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # the repository's moe_nvfp4, even when not pip-installed
sys.path.insert(0, _HERE)  # harness.py, plot.py beside this file

from harness import (  # noqa: E402
    Ceilings,
    MoEShape,
    Timing,
    environment,
    floors,
    markdown_table,
    measure_ceilings,
    pct_of_floor,
    ratio,
    rotation_copies,
    sync,
    time_with_fallback,
    write_json,
    write_markdown,
)

# --models: zoo shape keys (moe_nvfp4.zoo), "zoo" (every shape), "zoo-models" (every model at TP=1), the two
# shapes the bench always had by their short names, and a smoke shape for checking the script itself
# (e.g. --device cpu --models tiny).
ALIASES = {"mixtral": "mixtral-8x7b", "qwen3": "qwen3-30b-a3b"}
TINY = MoEShape("tiny", num_experts=4, top_k=2, hidden=128, inter=64, renormalize=True)
DEFAULT_MODELS = ("mixtral", "qwen3")
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
QUICK_TOKENS = (1, 64, 1024)
PATHS = ("ours", "marlin", "humming", "bf16")
DEFAULT_PATHS = PATHS
BASELINES = ("marlin", "humming", "bf16")  # the paths ours is compared with, row by row
REL_TOL = 2e-2  # same dequantized weights everywhere; only bf16 rounding/accumulation order differ

COLUMNS = [
    ("model", "model", ""),
    ("config_source", "config", ""),
    ("tokens", "T", "d"),
    ("touched_experts", "touched", "d"),
    ("ours_us", "ours µs", ".1f"),
    ("marlin_us", "Marlin µs", ".1f"),
    ("humming_us", "Humming µs", ".1f"),
    ("bf16_us", "BF16 µs", ".1f"),
    ("floor_us", "floor µs", ".1f"),
    ("bound", "bound", ""),
    ("pct_of_floor", "ours % floor", ".0f"),
    ("marlin_pct_of_floor", "Marlin % floor", ".0f"),
    ("humming_pct_of_floor", "Humming % floor", ".0f"),
    ("speedup_vs_marlin", "× Marlin", ".2f"),
    ("speedup_vs_humming", "× Humming", ".2f"),
    ("speedup_vs_bf16", "× BF16", ".2f"),
    ("rel_err_ours", "err ours", ".1e"),
    ("rel_err_marlin", "err Marlin", ".1e"),
    ("rel_err_humming", "err Humming", ".1e"),
    ("status", "status", ""),
]


def columns(paths: list[str]) -> list[tuple[str, str, str]]:
    """COLUMNS less the time, % floor, speedup and error columns of the paths not run."""
    own = {p: {f"{p}_us", f"{p}_pct_of_floor", f"speedup_vs_{p}", f"rel_err_{p}"} for p in PATHS}
    dropped = set().union(*(own[p] for p in PATHS if p not in paths))
    return [c for c in COLUMNS if c[0] not in dropped]


def add_ratios(row: dict) -> None:
    """% of floor for every path and ours' speedup over each baseline, from the row's times (None where one is
    missing)."""
    ours = row.get("ours_us")
    row["pct_of_floor"] = pct_of_floor(row["floor_us"], ours)
    for name in BASELINES:
        row[f"{name}_pct_of_floor"] = pct_of_floor(row["floor_us"], row.get(f"{name}_us"))
        row[f"speedup_vs_{name}"] = ratio(row.get(f"{name}_us"), ours)


def log(msg: str) -> None:
    print(msg, flush=True)


def short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def rel_err(a, b) -> float:
    import torch

    a, b = a.float(), b.float()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def clone_tensors(obj: Any) -> Any:
    """A copy of a dataclass / tuple of tensors with every tensor cloned (new storage, same layout); of a torch
    Module, a shallow copy whose parameters and buffers are clones (its other attributes shared)."""
    import copy

    import torch

    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, torch.nn.Module):
        twin = copy.copy(obj)
        twin._parameters = {k: torch.nn.Parameter(v.detach().clone(), requires_grad=False)
                            for k, v in obj._parameters.items()}  # fmt: skip
        twin._buffers = {k: v.clone() for k, v in obj._buffers.items()}
        return twin
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: clone_tensors(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        )
    if isinstance(obj, (tuple, list)):
        return type(obj)(clone_tensors(x) for x in obj)
    return obj


# --------------------------------------------------------------------------------------------------
# The paths.  Each builder returns a callable make_fn(copy_index) -> (() -> out) and the number of
# weight copies it holds; copies beyond the first are clones made up front.
# --------------------------------------------------------------------------------------------------
class Path:
    name: str

    def __init__(self, copies: int):
        self.copies_wanted = copies
        self.weights: list[Any] = []

    def add_copies(self, first: Any) -> None:
        self.weights = [first] + [clone_tensors(first) for _ in range(self.copies_wanted - 1)]

    def fn(self, copy: int, x, topk_weights, topk_ids, expert_map=None) -> Callable[[], Any]:
        """One forward of copy ``copy`` (``expert_map``: int32 [global E], -1 for experts on other ranks)."""
        raise NotImplementedError


class Ours(Path):
    name = "ours"

    def __init__(self, w13_q, w2_q, copies: int):
        super().__init__(copies)
        import moe_nvfp4

        self._fused_moe = moe_nvfp4.fused_moe
        self.add_copies(moe_nvfp4.prepare_moe_weights(w13_q, w2_q))

    def fn(self, copy, x, topk_weights, topk_ids, expert_map=None):
        w, f = self.weights[copy], self._fused_moe
        return lambda: f(x, w, topk_weights, topk_ids, expert_map=expert_map)


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

    name = "marlin"

    def __init__(self, shape: MoEShape, w13_q, w2_q, copies: int):
        super().__init__(copies)
        import torch
        import vllm._custom_ops as ops
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
        from vllm.model_executor.layers.quantization.utils.marlin_utils import get_marlin_input_dtype
        from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import (
            prepare_nvfp4_moe_layer_for_marlin,
        )
        from vllm.scalar_type import scalar_types

        layer = _MarlinLayer(shape.num_experts, shape.hidden, shape.inter, torch.bfloat16)
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
            is_act_and_mul=True,
        )
        self.add_copies(out)  # (w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
        self._call = fused_marlin_moe
        self._quant_type_id = scalar_types.float4_e2m1f.id
        self._silu = MoEActivation.SILU
        self._input_dtype = get_marlin_input_dtype()  # None unless VLLM_MARLIN_INPUT_DTYPE is set
        self._num_experts = shape.routed_experts
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
                activation=self._silu,
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

    name = "humming"

    def __init__(self, shape: MoEShape, w13_q, w2_q, copies: int):
        super().__init__(copies)
        if shape.routed_experts != shape.num_experts:
            raise RuntimeError("the Humming path here has no expert map (expert-parallel shapes run without it)")
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
        from vllm.model_executor.layers.fused_moe.oracle.nvfp4 import (
            convert_to_nvfp4_moe_kernel_format,
            make_nvfp4_moe_kernel,
            select_nvfp4_moe_backend,
        )
        from vllm.model_executor.layers.quantization.utils.humming_utils import get_humming_moe_quant_config
        from vllm.model_executor.layers.quantization.utils.quant_utils import kNvfp4Dynamic, kNvfp4Static
        from vllm.v1.worker.workspace import init_workspace_manager, is_workspace_manager_initialized

        e, h, i, device = shape.num_experts, shape.hidden, shape.inter, w13_q.packed.device
        moe = FusedMoEConfig(
            num_experts=e, experts_per_token=shape.top_k, hidden_dim=h, intermediate_size=i, num_local_experts=e,
            num_logical_experts=e, activation=MoEActivation.SILU, device=device,
            routing_method=get_routing_method_type("softmax", shape.top_k, shape.renormalize, None, False),
            moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.bfloat16,
            moe_backend="humming",
        )  # fmt: skip
        try:
            backend, experts_cls = select_nvfp4_moe_backend(moe, kNvfp4Static, kNvfp4Dynamic)
        except ValueError as exc:  # "... does not support the deployment configuration since <reason>"
            raise RuntimeError(f"vLLM 0.26's oracle refuses HUMMING: {str(exc).rpartition(' since ')[2]}") from exc

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
            nvfp4_backend=backend, layer=layer, w13=layer.w13_weight, w13_scale=layer.w13_weight_scale,
            w13_scale_2=layer.w13_weight_scale_2[:, 0].contiguous(), a13_scale=layer.w13_input_scale,
            w2=layer.w2_weight, w2_scale=layer.w2_weight_scale, w2_scale_2=layer.w2_weight_scale_2,
            a2_scale=layer.w2_input_scale, is_act_and_mul=True,
        )  # fmt: skip
        self.add_copies(layer)

        def kernel(copy_layer):
            k = make_nvfp4_moe_kernel(get_humming_moe_quant_config(copy_layer), moe, experts_cls, backend,
                                      layer=copy_layer)  # fmt: skip
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
                    x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, activation=self._silu,
                    global_num_experts=self._num_experts, expert_map=None, apply_router_weight_on_input=False,
                )  # fmt: skip

        return run


class BF16(Path):
    """vLLM 0.26 Triton fused_experts on the dequantized bf16 weights (unquantized config)."""

    name = "bf16"

    def __init__(self, shape: MoEShape, w13_bf16, w2_bf16, copies: int):
        super().__init__(copies)
        from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

        if w13_bf16 is None:
            raise RuntimeError("no BF16 weights: the dequantized layer did not fit in GPU memory")
        self._call = fused_experts
        self._num_experts = shape.routed_experts
        self.add_copies((w13_bf16, w2_bf16))

    def fn(self, copy, x, topk_weights, topk_ids, expert_map=None):
        w13, w2 = self.weights[copy]
        call, n = self._call, self._num_experts
        return lambda: call(x, w13, w2, topk_weights, topk_ids, global_num_experts=n, expert_map=expert_map)


def build_path(name: str, shape: MoEShape, weights: tuple, copies: int) -> Path:
    """Path ``name`` on make_weights' (w13_q, w2_q, w13_deq, w2_deq), holding ``copies`` weight copies."""
    w13_q, w2_q, w13_deq, w2_deq = weights
    if name == "ours":
        return Ours(w13_q, w2_q, copies)
    if name == "marlin":
        return Marlin(shape, w13_q, w2_q, copies)
    if name == "humming":
        return Humming(shape, w13_q, w2_q, copies)
    return BF16(shape, w13_deq, w2_deq, copies)


# --------------------------------------------------------------------------------------------------
# One model
# --------------------------------------------------------------------------------------------------
WEIGHT_CHUNK_BYTES = 2 << 30  # bf16 experts drawn and quantized this many bytes at a time (Kimi-K2: 34 GB in all)


def make_weights(shape: MoEShape, seed: int, device: str):
    """Random bf16 experts (std 1/sqrt(K)), NVFP4-quantized a few experts at a time; returns (w13_q, w2_q,
    w13_deq, w2_deq), the last two None where the dequantized BF16 layer does not fit in half the free memory
    (the BF16 path and the float reference then drop out of that model's rows)."""
    import torch

    from moe_nvfp4 import NVFP4Tensor, dequantize_nvfp4, quantize_nvfp4

    gen = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden, shape.inter
    step = max(1, WEIGHT_CHUNK_BYTES // shape.expert_bf16_bytes())

    def draw(n: int, k: int) -> NVFP4Tensor:
        parts = []
        for first in range(0, e, step):
            w = torch.randn(min(step, e - first), n, k, device=device, dtype=torch.bfloat16, generator=gen) * (k**-0.5)
            parts.append(quantize_nvfp4(w))  # one global scale per expert and matrix: vLLM's Marlin path keeps one
            del w
        return NVFP4Tensor(*(torch.cat([getattr(p, f) for p in parts]) for f in ("packed", "block_scale", "global_scale")))

    w13_q, w2_q = draw(2 * i, h), draw(h, i)
    empty_cache()
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else 1 << 40
    if e * shape.expert_bf16_bytes() > free // 2:
        return w13_q, w2_q, None, None

    def dequantized(q: NVFP4Tensor) -> torch.Tensor:  # the same experts at a time: its float32 temporaries too
        return torch.cat([dequantize_nvfp4(NVFP4Tensor(q.packed[a : a + step], q.block_scale[a : a + step],
                                                       q.global_scale[a : a + step]), torch.bfloat16)
                          for a in range(0, e, step)])  # fmt: skip

    w13_deq, w2_deq = dequantized(w13_q), dequantized(w2_q)
    empty_cache()
    return w13_q, w2_q, w13_deq, w2_deq


def make_inputs(shape: MoEShape, tokens: int, seed: int, device: str):
    """x, softmax top-k routing over the routing's experts, and under expert parallelism the expert map of the
    rank that holds the first num_experts of them (None without)."""
    import torch

    from moe_nvfp4 import topk_softmax

    gen = torch.Generator(device=device).manual_seed(seed * 1000003 + tokens)
    x = torch.randn(tokens, shape.hidden, device=device, dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, shape.routed_experts, device=device, dtype=torch.float32, generator=gen)
    topk_weights, topk_ids = topk_softmax(logits, shape.top_k, renormalize=shape.renormalize)
    expert_map = None
    if shape.routed_experts != shape.num_experts:
        expert_map = torch.full((shape.routed_experts,), -1, dtype=torch.int32, device=device)
        expert_map[: shape.num_experts] = torch.arange(shape.num_experts, dtype=torch.int32, device=device)
    return x, topk_weights.contiguous(), topk_ids.contiguous(), expert_map


def expert_bytes(shape: MoEShape, path: str) -> int:
    """One expert's weight bytes as ``path`` holds them: bf16 for the BF16 path, NVFP4 for ours and Marlin."""
    return shape.expert_bf16_bytes() if path == "bf16" else shape.expert_nvfp4_bytes()


def copies_for(shape: MoEShape, tokens: list[int], path: str, args, l2: int) -> int:
    """Copies of ``path``'s weights needed at the smallest T (the fewest touched experts), capped by max and by
    memory."""
    import torch

    if args.no_rotate:
        return 1
    per_expert = expert_bytes(shape, path)
    touched = shape.max_touched(min(tokens))
    want = rotation_copies(touched * per_expert, l2, factor=args.l2_factor, max_copies=args.max_copies)
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 8 << 30
    by_memory = max(1, int(0.15 * free // max(per_expert * shape.num_experts, 1)))
    return max(1, min(want, by_memory))


def run_model(
    key: str, shape: MoEShape, tokens: list[int], args, ceilings: Ceilings, l2: int, deadline: float
) -> list[dict]:
    import torch

    from moe_nvfp4 import moe_dense_torch
    from moe_nvfp4.configs import LayerShape, device_traits, entries_for, measured_entries, select_config

    rows: list[dict] = []
    t0 = time.time()
    ep = f" of {shape.routed_experts} (expert parallel)" if shape.routed_experts != shape.num_experts else ""
    log(f"\n== {shape.name}: E={shape.num_experts}{ep} top-{shape.top_k} H={shape.hidden} I={shape.inter}")
    w13_q, w2_q, w13_deq, w2_deq = make_weights(shape, args.seed, args.device)
    log(f"   weights quantized in {time.time() - t0:.1f} s")

    fp4_expert = shape.expert_nvfp4_bytes()
    paths: dict[str, Path | None] = {}
    errors: dict[str, str] = {}
    for name in args.paths:
        n = copies_for(shape, tokens, name, args, l2)
        t1 = time.time()
        try:
            paths[name] = build_path(name, shape, (w13_q, w2_q, w13_deq, w2_deq), n)
            copies = len(paths[name].weights)
            log(f"   {name:7s} ready: {copies} weight cop{'y' if copies == 1 else 'ies'} ({time.time() - t1:.1f} s)")
        except Exception as exc:  # noqa: BLE001 - one path failing must not stop the others
            paths[name] = None
            errors[name] = f"setup: {short_error(exc)}"
            log(f"   {name:7s} SETUP FAILED: {short_error(exc)}")
            if args.verbose:
                traceback.print_exc()
        sync()
    layer = LayerShape(shape.num_experts, shape.top_k, shape.hidden, shape.inter, "bfloat16", shape.routed_experts)
    autotuned = None
    if args.autotune and paths.get("ours") is not None and args.device == "cuda":
        from moe_nvfp4.autotune import autotune_fused_moe

        _, _, _, emap = make_inputs(shape, 1, args.seed, args.device)
        report = autotune_fused_moe(paths["ours"].weights[0], shape.top_k, torch.bfloat16, max(tokens), expert_map=emap,
                                    budget_s=args.autotune_budget_s)  # fmt: skip
        autotuned = dict(seconds=round(report.seconds, 1), source=report.source, summary=report.summary())
        log(f"   autotune: {report.summary()}")

    for t in tokens:
        row: dict[str, Any] = {
            "model": shape.name,
            "tokens": t,
            "num_experts": shape.num_experts,
            "global_experts": shape.routed_experts,
            "top_k": shape.top_k,
            "hidden": shape.hidden,
            "inter": shape.inter,
            "repro": f"python benchmarks/bench_moe.py --models {key} --tokens {t}",
        }
        if autotuned is not None:
            row["autotune"] = autotuned
        notes: list[str] = []
        if time.time() > deadline:
            row["status"] = "skipped (time budget)"
            rows.append(row)
            log(f"   T={t:5d} skipped: time budget reached")
            continue
        x, topk_weights, topk_ids, expert_map = make_inputs(shape, t, args.seed, args.device)
        local = topk_ids if expert_map is None else expert_map[topk_ids.long()]
        touched = int(torch.unique(local[local >= 0]).numel())
        nbytes = shape.hbm_bytes(t, touched)
        flops = shape.flops(t)
        row.update(touched_experts=touched, hbm_bytes=nbytes, weight_bytes=touched * fp4_expert, flops=flops)
        row.update(floors(nbytes, flops, ceilings))
        if x.is_cuda:  # the config ours runs at this T and where it came from, so a row can be traced to it
            traits = device_traits(x.device)
            row["ours_config"] = select_config(t, layer, traits).to_dict()
            row["config_source"] = ("autotuned" if measured_entries(layer, traits) else
                                    "tuned" if entries_for(layer, traits) else "default")  # fmt: skip

        # Correctness: every path once, eagerly, against the float32 torch reference on the same weights.
        outs: dict[str, torch.Tensor] = {}
        ref = None
        if not args.no_ref and w13_deq is not None:
            try:
                ref = moe_dense_torch(x.float(), w13_deq, w2_deq, topk_weights, topk_ids, expert_map=expert_map,
                                      compute_dtype=torch.float32)  # fmt: skip
            except Exception as exc:  # noqa: BLE001
                notes.append(f"ref: {short_error(exc)}")
        for name in args.paths:
            p = paths.get(name)
            if p is None:
                notes.append(f"{name} {errors.get(name, 'unavailable')}")
                continue
            try:
                outs[name] = p.fn(0, x, topk_weights, topk_ids, expert_map)().float()
                sync()
            except Exception as exc:  # noqa: BLE001
                notes.append(f"{name} run: {short_error(exc)}")
                if args.verbose:
                    traceback.print_exc()
        # rel_err_<path>: vs the BF16 path, else the reference, else (no BF16 weights) vs Marlin
        base, basis = next(((out, name) for out, name in ((outs.get("bf16"), "bf16"), (ref, "ref"),
                                                          (outs.get("marlin"), "marlin")) if out is not None), (None, None))
        row["err_basis"] = basis
        for name in ("ours", "marlin", "humming"):
            if name in outs and name != basis:
                row[f"rel_err_{name}"] = rel_err(outs[name], base) if base is not None else None
        for name, out in outs.items():
            row[f"rel_err_{name}_vs_ref"] = rel_err(out, ref) if ref is not None else None
        for name in ("marlin", "humming"):
            if "ours" in outs and name in outs:
                row[f"rel_err_ours_vs_{name}"] = rel_err(outs["ours"], outs[name])
        mismatches = []
        for name in outs:
            err = row.get(f"rel_err_{name}") if name != "bf16" else None
            if err is None:
                err = row.get(f"rel_err_{name}_vs_ref")
            if err is not None and not err <= args.tol:  # also catches NaN
                mismatches.append(f"{name}={err:.1e}")
        if mismatches:
            notes.append("MISMATCH " + ",".join(mismatches))
        del outs, ref

        # Timing: graph replay over rotating weight copies; eager (marked) when capture fails.  The paths take turns
        # for args.rounds rounds, each path's time its median round: the SM clock moves with the GPU's
        # power state (a sustained forward may sit at the power cap), and in turns every path sees the same mix.
        fns_of: dict[str, list] = {}
        for name in args.paths:
            p = paths.get(name)
            if p is None or any(n.startswith(f"{name} run") for n in notes):
                row[f"{name}_us"] = None
                continue
            per_expert = expert_bytes(shape, name)
            n_rot = 1 if args.no_rotate else rotation_copies(touched * per_expert, l2, factor=args.l2_factor,
                                                           max_copies=len(p.weights))
            fns_of[name] = [p.fn(c, x, topk_weights, topk_ids, expert_map) for c in range(n_rot)]
            needed = rotation_copies(touched * per_expert, l2, factor=args.l2_factor, max_copies=10**6)
            if not args.no_rotate and n_rot < needed:
                notes.append(f"{name} rotates {n_rot}/{needed} copies (L2 may be warm)")
        rounds: dict[str, list[Timing]] = {name: [] for name in fns_of}
        for _ in range(args.rounds):
            for name in [n for n in fns_of if n in rounds]:
                try:
                    rounds[name].append(time_with_fallback(
                        fns_of[name], target_graph_ms=args.target_graph_ms, replays=args.replays,
                        max_calls=args.max_calls))  # fmt: skip
                except Exception as exc:  # noqa: BLE001
                    del rounds[name]
                    row[f"{name}_us"] = None
                    notes.append(f"{name} timing: {short_error(exc)}")
                    if args.verbose:
                        traceback.print_exc()
                finally:
                    sync()
        for name, timings in rounds.items():
            middle = sorted(timings, key=lambda t: t.median_us)[len(timings) // 2]  # of two, the slower
            row[f"{name}_us"] = middle.median_us
            row[f"{name}_timing"] = dict(middle.as_dict(), rounds_us=[t.median_us for t in timings])
            if middle.method != "graph":
                notes.append(f"{name} eager ({middle.note})")
        del fns_of
        add_ratios(row)
        row["status"] = "ok" if not notes else "; ".join(notes)
        row["notes"] = notes
        rows.append(row)
        times = " ".join(f"{name}={_f(row.get(f'{name}_us'))}" for name in args.paths)
        errs = " ".join(f"{name}={_f(row.get(f'rel_err_{name}'), '.1e')}" for name in args.paths if name != "bf16")
        log(
            f"   T={t:5d} touched={touched:3d} {times} "
            f"floor={row['floor_us']:.1f}us ({row['bound']}) ours%floor={_f(row['pct_of_floor'], '.0f')} "
            f"err {errs}" + (f"  [{_clip(row['status'], 300)}]" if notes else "")
        )
        del x, topk_weights, topk_ids, expert_map

    del paths, w13_q, w2_q, w13_deq, w2_deq
    empty_cache()
    log(f"   {shape.name} done in {time.time() - t0:.1f} s")
    return rows


def _clip(text: Any, n: int) -> Any:
    return text if not isinstance(text, str) or len(text) <= n else text[: n - 3] + "..."


def _f(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="NVFP4 MoE: moe_nvfp4.fused_moe vs vLLM Marlin (and Humming) NVFP4 vs vLLM Triton BF16, with "
                    "HBM/compute floors.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--out", default="benchmarks/results", help="directory for moe.json, moe.md, moe.png")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma list of zoo shape keys (e.g. qwen3-235b-a22b, kimi-k2-ep8, glm-4.5-tp4), 'zoo' (every "
                        "shape), 'zoo-models' (each model at TP=1), or mixtral, qwen3, tiny")
    p.add_argument("--tokens", default=None,
                   help=f"comma list of token counts (default {TOKENS}; --quick {QUICK_TOKENS})")
    p.add_argument("--autotune", action="store_true",
                   help="autotune each shape's configs first (moe_nvfp4.autotune, its on-disk cache included)")
    p.add_argument("--autotune-budget-s", type=float, default=50.0, help="the autotuner's search budget per shape")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                   help=f"comma list of {list(PATHS)} (humming: its first forward per shape JIT-compiles, ~20-30 s)")
    p.add_argument("--quick", action="store_true", help="fewer token counts, replays and ceiling iterations")
    p.add_argument("--replays", type=int, default=None, help="graph replays per measurement (default 10; quick 5)")
    p.add_argument("--rounds", type=int, default=None,
                   help="measurements per path, the paths in turn; the row takes their median (default 3; quick 1)")
    p.add_argument("--target-graph-ms", type=float, default=None,
                   help="calls per graph sized to this (default 20; quick 10)")
    p.add_argument("--max-calls", type=int, default=400, help="upper bound on calls captured per graph")
    p.add_argument("--l2-factor", type=float, default=4.0,
                   help="rotate weight copies until this many L2 sizes stream between reuses")
    p.add_argument("--max-copies", type=int, default=16, help="most weight copies per path (memory)")
    p.add_argument("--no-rotate", action="store_true", help="one weight copy (L2 may stay warm for tiny T)")
    p.add_argument("--no-ref", action="store_true", help="skip the float32 torch reference check")
    p.add_argument("--tol", type=float, default=REL_TOL, help="relative-error bound vs the BF16 path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget-s", type=float, default=420.0, help="skip remaining rows after this many seconds")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: smoke-test the script (torch reference for ours, host clock, no graphs)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing paths")
    return p


def resolve_models(spec: str) -> dict[str, MoEShape]:
    """--models -> {key: shape}, in the order given (see --help)."""
    from moe_nvfp4.zoo import zoo_shapes

    zoo = {s.key: s for s in zoo_shapes()}
    out: dict[str, MoEShape] = {}
    for name in (m.strip().lower() for m in spec.split(",") if m.strip()):
        keys = (list(zoo) if name == "zoo" else [k for k, s in zoo.items() if s.tp == s.ep == 1]
                if name == "zoo-models" else [ALIASES.get(name, name)])  # fmt: skip
        for key in keys:
            if key == "tiny":
                out[key] = TINY
            elif key in zoo:
                out[key] = MoEShape.from_zoo(zoo[key])
            else:
                raise SystemExit(f"unknown model {name!r}; choose from zoo, zoo-models, tiny, {sorted(ALIASES)} "
                                 f"or {sorted(zoo)}")  # fmt: skip
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.models = resolve_models(args.models)
    args.paths = [p.strip().lower() for p in args.paths.split(",") if p.strip()]
    if [p for p in args.paths if p not in PATHS]:
        raise SystemExit(f"unknown path(s) in {args.paths}; choose from {list(PATHS)}")
    if args.tokens:
        args.tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    else:
        args.tokens = list(QUICK_TOKENS if args.quick else TOKENS)
    if any(t < 1 for t in args.tokens):
        raise SystemExit("token counts must be >= 1")
    args.replays = args.replays or (5 if args.quick else 10)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.target_graph_ms = args.target_graph_ms or (10.0 if args.quick else 20.0)
    return args


def model_summaries(rows: list[dict]) -> list[str]:
    """One line per model: min / median speedup vs each baseline and % of floor over its timed rows."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        parts = []
        for col, label in (("speedup_vs_marlin", "x Marlin"), ("speedup_vs_humming", "x Humming"),
                           ("speedup_vs_bf16", "x BF16"), ("pct_of_floor", "% floor")):
            values = sorted(r[col] for r in mine if r.get(col) is not None)
            if values:
                parts.append(f"{label} min {values[0]:.2f} median {statistics.median(values):.2f}")
        sources = sorted({r["config_source"] for r in mine if r.get("config_source")})
        out.append(f"{model} ({'/'.join(sources) or 'no config'}): " + ("; ".join(parts) or "no timed rows"))
    return out


def summary_lines(meta: dict, rows: list[dict]) -> list[str]:
    c = meta["ceilings"]
    return [
        f"device: {meta.get('device')} (sm_{str(meta.get('capability', '')).replace('.', '')}), "
        f"torch {meta.get('torch')}, triton {meta.get('triton')}, vllm {meta.get('vllm')}",
        f"copy bandwidth {c['copy_GBps']:.0f} GB/s (read+write), bf16 matmul {c['bf16_TFLOPs']:.0f} TFLOP/s "
        f"({c['matmul'].get('n')}^3, cuBLAS)",
        f"command: `{meta['command']}`; {meta['date']}; commit {meta.get('git_commit')}"
        + (" (dirty)" if meta.get("git_dirty") else ""),
        f"timing: CUDA graph replay, median per call; {meta.get('rounds', 1)} rounds, the paths in turn, each row the "
        f"median round; L2: {meta['l2_policy']}",
        f"configs: tuned entries {'used where a file serves this GPU' if meta.get('tuned_entries') else 'none'} "
        f"(MOE_NVFP4_CONFIG_DIR={meta.get('config_dir')}); autotuning {'ran' if meta.get('autotune') else 'off'}",
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep vLLM's INFO lines out of the output tail
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        log("bench_moe: needs a CUDA GPU (--device cpu runs a host-clock smoke test of the script itself)")
        return 2
    start = time.time()
    deadline = start + args.time_budget_s
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = environment(extra_modules=("vllm",))
    l2 = meta.get("l2_bytes") or 50 * 2**20
    log(f"bench_moe on {meta.get('device')}: torch {meta['torch']} triton {meta['triton']} vllm {meta['vllm']}; "
        f"L2 {l2 / 2**20:.0f} MiB")

    ceilings = measure_ceilings(quick=args.quick, device=args.device)
    meta["ceilings"] = {
        "copy_GBps": ceilings.copy_bytes_per_s / 1e9,
        "bf16_TFLOPs": ceilings.bf16_flops_per_s / 1e12,
        "copy": ceilings.copy_detail,
        "matmul": ceilings.matmul_detail,
    }
    log(f"ceilings: copy {meta['ceilings']['copy_GBps']:.0f} GB/s, "
        f"bf16 mm {meta['ceilings']['bf16_TFLOPs']:.0f} TFLOP/s "
        f"({time.time() - start:.1f} s)")
    meta["l2_policy"] = (
        "one weight copy (--no-rotate)" if args.no_rotate else
        f"rotating weight copies: each captured call uses the next copy, n = ceil({args.l2_factor:g} x L2 / touched "
        f"weight bytes) (max {args.max_copies}), so >= {args.l2_factor:g} x L2 of other weights stream between reuses"
    )
    meta["rounds"] = args.rounds
    meta["floor"] = (
        "floor_us = max(hbm_floor_us, compute_floor_us); hbm = (touched experts' NVFP4 weights + e4m3 scales "
        "+ fp32 global scales + x read + out write) / copy bandwidth; compute = 2*T*k*3*I*H / bf16 rate"
    )
    meta["rel_tol"] = args.tol
    meta["args"] = {k: v for k, v in vars(args).items() if k != "models"} | {"models": list(args.models)}
    from moe_nvfp4 import configs

    meta["config_dir"] = str(configs.CONFIG_DIR)
    meta["tuned_entries"] = args.device == "cuda" and configs.tuned_file_for(configs.device_traits(
        torch.device("cuda"))) is not None  # fmt: skip
    meta["autotune"] = args.autotune

    rows: list[dict] = []
    for key, shape in args.models.items():
        try:
            rows += run_model(key, shape, args.tokens, args, ceilings, l2, deadline)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory while building weights
            log(f"   {shape.name} FAILED: {short_error(exc)}")
            traceback.print_exc()
            rows.append({"model": shape.name, "status": f"failed: {short_error(exc)}"})
            empty_cache()
    meta["wall_s"] = time.time() - start

    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "moe.json")
    md_path = os.path.join(args.out, "moe.md")
    write_json(json_path, meta, rows)
    table = markdown_table(rows, columns(args.paths))
    notes = [
        "Columns: times are µs per MoE forward (see timing above); floor = max(HBM, compute) floor; "
        "% floor = floor / time (100 = at the floor); × = baseline time / our time; err = ||a - b|| / ||b|| vs the "
        "vLLM BF16 path on the same dequantized weights. See benchmarks/README.md.",
        "",
        "Repro: `python benchmarks/bench_moe.py --models <shape key> --tokens <T>` "
        "(each row's `repro` in moe.json).",
        "",
        "Per model (config: where ours' configs came from):",
        "",
        *[f"- {line}" for line in model_summaries(rows)],
    ]
    write_markdown(md_path, "NVFP4 MoE forward", summary_lines(meta, rows), table, notes)
    png = os.path.join(args.out, "moe.png")
    try:
        from plot import plot_rows

        plot_rows(rows, png, title=f"NVFP4 MoE forward on {meta.get('device')}")
    except Exception as exc:  # noqa: BLE001 - matplotlib may be absent on the GPU machine
        png = f"(no plot: {short_error(exc)}; run `python benchmarks/plot.py {json_path}` where matplotlib exists)"

    log("\n" + "\n".join(summary_lines(meta, rows) + model_summaries(rows)))
    short = [dict(r, status=_clip(r.get("status"), 60)) for r in rows]
    log(markdown_table(short, [c for c in columns(args.paths) if c[0] != "touched_experts"]))
    log(f"wrote {json_path}, {md_path}, {png}; total {meta['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
