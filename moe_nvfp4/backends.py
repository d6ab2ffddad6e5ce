"""The backend registry: every kernel backend, the operations it implements, the architectures it supports and
those where it has run on hardware (this project's GPU tests passed there).  ``dispatch.select_backends`` picks
one backend per operation from this table, once per device; nothing else names a backend.  Callers ask the chosen
backend what to run (``Backend.entry``) instead of comparing backends.

Operations:
  moe_w4a16     ``api.fused_moe``: NVFP4 weights, 16-bit activations (with ``fp8_weights``: the W4A8 mode, design
                008, from the same backend's ``moe_w4a8`` entry)
  moe_w4a4      ``api.fused_moe_w4a4``: NVFP4 weights and activations (needs block-scaled FP4 tensor cores)
  grouped_gemm  ``api.grouped_gemm_nvfp4``: W4A4 grouped GEMM
  quantize      ``api.quantize_activations``: activations -> NVFP4 with 128x4-swizzled scales

Entries (``Backend.entries``: name -> "module:function", imported at the first call, so the registry imports no
kernel), one signature each:
  moe_w4a16           (x, weights: MoEWeights, topk_weights, topk_ids, expert_map, *, apply_router_weight_on_input)
                      -> [T, H]: the weights in ``w4a16_layout`` (their activation and biases with them), the
                      inputs as ``api.fused_moe`` checked and cast them
  moe_w4a16_batched   (out, x, weights: MoEWeights, expert_num_tokens, expected_rows) -> None, writing
                      ``api.fused_moe_batched``'s rows into out
  moe_w4a8            (x, weights: MoEWeights, fp8 tensors (w13, w13_scale, w2, w2_scale) folded from them,
                      topk_weights, topk_ids, expert_map, *, apply_router_weight_on_input) -> [T, H]: e4m3
                      activations on the folded copy where enough rows an expert pay for it, else moe_w4a16
                      (optional: ``api.fused_moe`` refuses ``fp8_weights`` without it)
  fold_fp8            (weights: MoEWeights, nvfp4: the checkpoint's (w13, w2) NVFP4Tensors or None) -> the
                      e4m3 copy ``api.prepare_fp8_weights`` returns (optional, with moe_w4a8)
  warmup_token_counts (weights: MoEWeights, top_k, dtype, max_tokens, expert_map, fp8: forwards get the W4A8
                      mode's copy) -> the token counts whose forwards compile every kernel variant (optional:
                      without it nothing compiles)
  load_configs        (weights: MoEWeights, top_k, dtype, max_tokens, *, expert_map) -> a report (``summary()``,
                      ``source``) of the kernel configs chosen at load for this layer shape (optional: without it
                      nothing is chosen; ``api.load_moe_configs``)
  pack_block          (device, the layout's fragments) -> a block packer for ``w4a16_layout``'s ``pack``, or None
                      for its torch twin (optional)
  quantize            (x, global_scale 0-dim) -> NVFP4Tensor with 128x4-swizzled scales
  moe_w4a4            (x, weights: MoEWeights, topk_weights, topk_ids, expert_map, (w13_input_scale, w2_input_scale))
  grouped_gemm        (a, b, *, alpha, out_dtype) -> list of outputs
  plan_grouped_gemm   (a, b, *, alpha, out_dtype) -> a plan for ``api.launch_grouped_gemm_nvfp4``
A new architecture's backend is one folder of its own (``sm90/`` holds the sm_90 one: layout choice, configs,
autotune space, warm-up and kernels) and one ``Backend`` here, added to REGISTRY and DEFAULT_ORDER
(docs/extending.md).

Architectures are CUDA capabilities written ``sm_<major><minor>`` (``sm_90``, ``sm_100``), or ``cpu``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["Backend", "OPERATIONS", "TORCH", "TRITON", "CUTE", "FLASHINFER", "REGISTRY", "DEFAULT_ORDER", "by_name"]

OPERATIONS = ("moe_w4a16", "moe_w4a4", "grouped_gemm", "quantize")


@dataclass(frozen=True)
class Backend:
    """One backend.  ``archs`` None: every CUDA GPU from sm_80 on.  ``ran_on``: the architectures where its GPU
    tests passed on hardware; elsewhere in ``archs`` it is compiled and checked only.  ``w4a4_layout``: the
    ``weight_layouts`` name its W4A4 MoE reads (and ``api.prepare_moe_weights_w4a4`` packs for it); ``w4a16_layout``:
    the one its 16-bit-activation MoE reads (and ``api.prepare_moe_weights`` packs for it).
    ``reference``: the pure-torch ops, which read weights in any layout (they unpack them).  ``interpreted_on_cpu``:
    CPU tensors run its kernels under TRITON_INTERPRET=1 (tests), so forcing it on a CPU is allowed."""

    name: str
    operations: frozenset[str]
    archs: frozenset[str] | None
    ran_on: frozenset[str]
    note: str
    entries: Mapping[str, str] = field(default_factory=dict, hash=False)
    w4a4_layout: str | None = None
    w4a16_layout: str | None = None
    reference: bool = False
    interpreted_on_cpu: bool = False

    def supports(self, arch: str) -> bool:
        if self.archs is None:
            return arch != "cpu" and int(arch[3:]) >= 80
        return arch in self.archs

    def status(self, arch: str) -> str:
        if not self.supports(arch):
            return "unsupported"
        return "verified on hardware" if arch in self.ran_on else "compiled and checked only (not run on hardware)"

    def entry(self, name: str) -> Callable:
        """The function this backend runs for entry ``name`` (module docstring)."""
        if name not in self.entries:
            raise ValueError(f"the {self.name} backend has no {name!r}; it runs {sorted(self.entries)}")
        module, _, function = self.entries[name].partition(":")
        return getattr(importlib.import_module(module), function)

    def optional_entry(self, name: str) -> Callable | None:
        """``entry(name)``, or None where this backend leaves that optional entry out (module docstring)."""
        return self.entry(name) if name in self.entries else None


_TRITON_PLAN = "moe_nvfp4.triton.grouped_w4a4:plan_grouped_nvfp4"
# A CPU plan launches the Triton kernel (TRITON_INTERPRET=1 in tests); the one-call grouped GEMM runs the reference.
TORCH = Backend(
    "torch",
    frozenset(OPERATIONS),
    frozenset({"cpu"}),
    frozenset({"cpu"}),
    "the reference ops (moe_nvfp4.reference); the default for CPU tensors",
    {
        "moe_w4a16": "moe_nvfp4.reference:fused_moe_packed_torch",
        "moe_w4a16_batched": "moe_nvfp4.reference:fused_moe_batched_packed_torch",
        "moe_w4a8": "moe_nvfp4.sm90.w4a8:fused_moe_w4a8_reference",
        "fold_fp8": "moe_nvfp4.sm90.w4a8:fold_to_fp8",
        "quantize": "moe_nvfp4.reference:quantize_activations_torch",
        "moe_w4a4": "moe_nvfp4.reference:fused_moe_w4a4_torch",
        "grouped_gemm": "moe_nvfp4.reference:grouped_gemm_nvfp4_torch",
        "plan_grouped_gemm": _TRITON_PLAN,
    },
    w4a4_layout="sm100_interleaved",
    w4a16_layout="sm90_fragments",  # what the Triton kernels read too, so CPU weights run them interpreted (tests)
    reference=True,
)
TRITON = Backend(
    "triton",
    frozenset({"moe_w4a16", "grouped_gemm", "quantize"}),
    None,
    frozenset({"sm_90"}),
    "Triton and Gluon kernels (moe_nvfp4/sm90/ for the MoE): weights decoded in registers; tuned on sm_90 (H100, H200)",
    {
        "moe_w4a16": "moe_nvfp4.sm90.host:fused_moe_sm90",
        "moe_w4a16_batched": "moe_nvfp4.sm90.host:run_batched",
        "moe_w4a8": "moe_nvfp4.sm90.w4a8:fused_moe_w4a8_entry",
        "fold_fp8": "moe_nvfp4.sm90.w4a8:fold_to_fp8",
        "warmup_token_counts": "moe_nvfp4.sm90.warmup:warmup_token_counts",
        "load_configs": "moe_nvfp4.sm90.autotune:load_configs",
        "pack_block": "moe_nvfp4.sm90.fragment_pack:block_packer",
        "quantize": "moe_nvfp4.triton.quant_act:quantize_activations_sm90",
        "grouped_gemm": "moe_nvfp4.triton.grouped_w4a4:grouped_gemm_nvfp4_triton",
        "plan_grouped_gemm": _TRITON_PLAN,
    },
    w4a16_layout="sm90_fragments",
    interpreted_on_cpu=True,
)
CUTE = Backend(
    "cute",
    frozenset({"moe_w4a4", "grouped_gemm"}),
    frozenset({"sm_100", "sm_103"}),
    frozenset(),
    "our CuTe DSL kernels (block-scaled tcgen05 MMA): compiled, PTX checked, never run on a GPU",
    {
        "moe_w4a4": "moe_nvfp4.cute.moe_host:fused_moe_w4a4_sm100",
        "grouped_gemm": "moe_nvfp4.cute.host:grouped_gemm_nvfp4_sm100",
        "plan_grouped_gemm": "moe_nvfp4.cute.host:plan_grouped_nvfp4_sm100",
    },
    w4a4_layout="sm100_interleaved",
)
FLASHINFER = Backend(
    "flashinfer",
    frozenset({"moe_w4a4"}),
    frozenset({"sm_100", "sm_103"}),
    frozenset(),
    "FlashInfer's TRT-LLM-gen NVFP4 fused MoE (trtllm_fp4_block_scale_routed_moe), the kernel vLLM "
    "0.26 runs for modelopt_fp4 on Blackwell; our layouts and arguments checked on CPU only",
    {"moe_w4a4": "moe_nvfp4.flashinfer_moe:fused_moe_w4a4_flashinfer"},
    w4a4_layout="flashinfer_trtllm",
)

REGISTRY = (TORCH, TRITON, CUTE, FLASHINFER)

# Per operation, the backends tried in order on a CUDA device; the first that supports the architecture wins.
DEFAULT_ORDER = {
    "moe_w4a16": (TRITON,),
    "moe_w4a4": (FLASHINFER, CUTE),
    "grouped_gemm": (CUTE, TRITON),
    "quantize": (TRITON,),
}


def by_name(name: str) -> Backend:
    for backend in REGISTRY:
        if backend.name == name:
            return backend
    raise ValueError(f"unknown backend {name!r}; choose one of {[b.name for b in REGISTRY]}")
