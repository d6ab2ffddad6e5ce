"""The forward paths ``moe-nvfp4 bench`` (``moe_nvfp4.bench.moe``) times, each on the same NVFP4 experts:

  ours     moe_nvfp4.prepare_moe_weights(w13_q, w2_q, activation=); moe_nvfp4.fused_moe(x, weights, topk_w, topk_ids)
  marlin   vLLM prepare_nvfp4_moe_layer_for_marlin(...) then fused_marlin_moe(...), W4A16 NVFP4
  humming  vLLM convert_to_humming_moe_kernel_format(...) then the HummingIndexedExperts kernel, W4A16 NVFP4
           (its first forward per shape JIT-compiles humming's kernels)
  bf16     vLLM fused_experts(x, w13_bf16, w2_bf16, topk_w, topk_ids) on the dequantized weights
  torch    moe_nvfp4.moe_dense_torch in bf16 on the dequantized weights (a per-expert loop: the baseline without vLLM)
  ours_w4a8       moe_nvfp4.fused_moe(..., fp8_weights=prepare_fp8_weights(weights)): the W4A8 mode (opt-in:
                  --paths ours,ours_w4a8; checked against the reference up to its own e4m3 error)
  ours_batched    moe_nvfp4.fused_moe_batched on vLLM's batched format (DeepEP low-latency's [E, T, H] and counts)
  marlin_batched  vLLM batched_fused_marlin_moe (BatchedMarlinExperts' kernel) on the same batched inputs
                  (the two batched paths are opt-in: --paths ours_batched,marlin_batched; their time is the experts
                  stage alone, the layout built before timing as a dispatch would; their output is weighted and summed
                  back per token before the checks)

vLLM and humming are imported inside the paths that need them, when they are built: importing this module needs
neither.  A non-gated shape (MoEShape.activation relu2) runs vLLM's paths with MoEActivation.RELU2_NO_MUL (Marlin's
weights prepared with is_act_and_mul=False), what vLLM 0.26 serves Nemotron-H with; Humming refuses it.

A path is one ``Path`` subclass (``path_base``) listed in REGISTRY: its class attributes (label, the weights it
reads, the packages it needs) give the bench its columns, its error checks and ``--paths auto``, so adding one is
that class and its line in REGISTRY.  Here: ours, torch and the registry; vLLM's baselines in ``vllm_paths``, the
batched format's paths in ``batched_paths``.
"""

from __future__ import annotations

from .batched_paths import MarlinBatched, OursBatched
from .harness import MoEShape
from .path_base import Path, clone_tensors, short_error
from .vllm_paths import BF16, Humming, Marlin

__all__ = ["BASELINES", "NVFP4_PATHS", "PATHS", "REGISTRY", "Path", "build_path", "clone_tensors", "short_error"]


class Ours(Path):
    name, label = "ours", "ours"

    def __init__(self, shape: MoEShape, w13_q, w2_q, copies: int):
        super().__init__(copies)
        from ..api import fused_moe, prepare_moe_weights

        self._fused_moe = fused_moe
        self.add_copies(prepare_moe_weights(w13_q, w2_q, activation=shape.expert_activation))

    def fn(self, copy, x, topk_weights, topk_ids, expert_map=None):
        w, f = self.weights[copy], self._fused_moe
        return lambda: f(x, w, topk_weights, topk_ids, expert_map=expert_map)


class OursW4A8(Path):
    """moe_nvfp4.fused_moe with prepare_fp8_weights' e4m3 copy (the opt-in W4A8 mode, design 008): W4A8 where each
    expert expects enough rows, the W4A16 forward elsewhere."""

    name, label = "ours_w4a8", "ours W4A8"
    requires = auto_unless = ("triton",)  # opt-in: never in --paths auto
    error_floor = 0.1  # its e4m3 roundings: 5-7e-2 from float64 on every zoo layer (design 008 decision 7)
    weight_bytes_factor = 2.8  # the NVFP4 experts and their e4m3 copy (about 1.8x their bytes)

    def __init__(self, shape: MoEShape, w13_q, w2_q, copies: int):
        super().__init__(copies)
        from ..api import fused_moe, prepare_fp8_weights, prepare_moe_weights

        def packed_and_folded():  # each copy's fold from its own packed weights (fused_moe checks the pairing)
            w = prepare_moe_weights(w13_q, w2_q, activation=shape.expert_activation)
            return w, prepare_fp8_weights(w, (w13_q, w2_q))

        self._fused_moe = fused_moe
        self.weights = [packed_and_folded() for _ in range(copies)]

    def fn(self, copy, x, topk_weights, topk_ids, expert_map=None):
        (w, fp8), run = self.weights[copy], self._fused_moe
        from ..dispatch import choose_as_captured

        def forward():
            # timed in CUDA graphs, where the mode's choice weighs no host time: checked (eagerly) on that choice
            with choose_as_captured():
                return run(x, w, topk_weights, topk_ids, expert_map=expert_map, fp8_weights=fp8)

        return forward


class Torch(Path):
    """moe_nvfp4.moe_dense_torch in bf16 on the dequantized weights: a loop over the experts, the forward a user
    without vLLM would write.  It reads which experts are routed on the host, so it runs eagerly (no CUDA graph)."""

    name, label, weights, auto_unless = "torch", "torch", "bf16", ("vllm",)  # the baseline without vLLM
    graphable = False

    def __init__(self, shape: MoEShape, w13_bf16, w2_bf16, copies: int):
        super().__init__(copies)
        import torch

        from ..reference import moe_dense_torch

        if w13_bf16 is None:
            raise RuntimeError("no BF16 weights: the dequantized layer did not fit in GPU memory")
        self._call, self._dtype, self._activation = moe_dense_torch, torch.bfloat16, shape.expert_activation
        self.add_copies((w13_bf16, w2_bf16))

    def fn(self, copy, x, topk_weights, topk_ids, expert_map=None):
        w13, w2 = self.weights[copy]
        call, dtype, act = self._call, self._dtype, self._activation
        return lambda: call(
            x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, activation=act, compute_dtype=dtype
        )


# Every path, in the order of the table's columns; ours first, the others its baselines.
REGISTRY: dict[str, type[Path]] = {
    cls.name: cls for cls in (Ours, Marlin, Humming, BF16, Torch, OursBatched, MarlinBatched, OursW4A8)
}
PATHS = tuple(REGISTRY)
BASELINES = PATHS[1:]
NVFP4_PATHS = tuple(name for name, cls in REGISTRY.items() if cls.weights == "nvfp4")


def build_path(name: str, shape: MoEShape, weights: tuple, copies: int) -> Path:
    """Path ``name`` on make_weights' (w13_q, w2_q, w13_deq, w2_deq), holding ``copies`` weight copies; a path
    (not a kernel backend: those live in moe_nvfp4.backends)."""
    if name not in REGISTRY:
        raise ValueError(f"unknown path {name!r}; choose from {list(PATHS)}")
    cls = REGISTRY[name]
    w13, w2 = weights[:2] if cls.weights == "nvfp4" else weights[2:]
    return cls(shape, w13, w2, copies)
