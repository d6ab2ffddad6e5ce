"""The backend registry: every kernel backend, the operations it implements, the architectures it supports and
those where it has run on hardware (this project's GPU tests passed there).  ``dispatch.select_backends`` picks
one backend per operation from this table, once per device; nothing else names a backend.

Operations:
  moe_w4a16     ``api.fused_moe``: NVFP4 weights, 16-bit activations
  moe_w4a4      ``api.fused_moe_w4a4``: NVFP4 weights and activations (needs block-scaled FP4 tensor cores)
  grouped_gemm  ``api.grouped_gemm_nvfp4``: W4A4 grouped GEMM
  quantize      ``api.quantize_activations``: activations -> NVFP4 with 128x4-swizzled scales

Architectures are CUDA capabilities written ``sm_<major><minor>`` (``sm_90``, ``sm_100``), or ``cpu``.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Backend", "OPERATIONS", "TORCH", "TRITON", "CUTE", "FLASHINFER", "REGISTRY", "DEFAULT_ORDER", "by_name"]

OPERATIONS = ("moe_w4a16", "moe_w4a4", "grouped_gemm", "quantize")


@dataclass(frozen=True)
class Backend:
    """One backend.  ``archs`` None: every CUDA GPU from sm_80 on.  ``ran_on``: the architectures where its GPU
    tests passed on hardware; elsewhere in ``archs`` it is compiled and checked only."""

    name: str
    operations: frozenset[str]
    archs: frozenset[str] | None
    ran_on: frozenset[str]
    note: str

    def supports(self, arch: str) -> bool:
        if self.archs is None:
            return arch != "cpu" and int(arch[3:]) >= 80
        return arch in self.archs

    def status(self, arch: str) -> str:
        if not self.supports(arch):
            return "unsupported"
        return "verified on hardware" if arch in self.ran_on else "compiled and checked only (not run on hardware)"


TORCH = Backend("torch", frozenset(OPERATIONS), frozenset({"cpu"}), frozenset({"cpu"}),
                "the reference ops (moe_nvfp4.reference); the default for CPU tensors")  # fmt: skip
# TRITON_INTERPRET=1 runs the Triton kernels on CPU tensors (tests), so "cpu" is in reach when forced.
TRITON = Backend("triton", frozenset({"moe_w4a16", "grouped_gemm", "quantize"}), None, frozenset({"sm_90"}),
                 "Triton kernels: weights decoded in registers; tuned on sm_90 (H100, H200)")  # fmt: skip
CUTE = Backend("cute", frozenset({"moe_w4a4", "grouped_gemm"}), frozenset({"sm_100", "sm_103"}), frozenset(),
               "our CuTe DSL kernels (block-scaled tcgen05 MMA): compiled, PTX checked, never run on a GPU")  # fmt: skip
FLASHINFER = Backend("flashinfer", frozenset({"moe_w4a4"}), frozenset({"sm_100", "sm_103"}), frozenset(),
                     "FlashInfer's TRT-LLM-gen NVFP4 fused MoE (trtllm_fp4_block_scale_routed_moe), the kernel vLLM "
                     "0.26 runs for modelopt_fp4 on Blackwell; our layouts and arguments checked on CPU only")  # fmt: skip

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
