"""Backend choice in one place: ``select_backends(device)`` picks one backend per operation from the registry
(``backends.py``), from the device's architecture, once; MOE_NVFP4_BACKEND overrides it.

  cpu                       -> torch everywhere (the reference ops)
  CUDA sm_100 / sm_103      -> W4A4 MoE: flashinfer (FlashInfer's NVFP4 fused MoE); grouped GEMM: cute;
                               16-bit-activation MoE and the quantizer: triton
  other CUDA, sm_80 and up  -> triton (sm_90 is the tuned target); no W4A4 MoE (no FP4 tensor cores)

MOE_NVFP4_BACKEND=<name>: every operation that backend implements runs on it (it must support the device's
architecture; triton also runs CPU tensors under TRITON_INTERPRET=1).  The W4A4 MoE runs on that backend or not
at all, so ``triton`` keeps 16-bit activations on Blackwell and ``cute`` picks our CuTe DSL MoE over FlashInfer's.
Other operations keep the device default.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from . import backends
from .backends import TORCH, Backend, by_name

__all__ = [
    "AS_CAPTURED",
    "Selection",
    "arch_of",
    "choose_as_captured",
    "host_cost_counts",
    "select_backends",
    "sm_count",
]

OVERRIDE_ENV = "MOE_NVFP4_BACKEND"

# True where forwards run eagerly but must choose as a CUDA-graph capture does (choose_as_captured): the warm-up
# (warmup.compile_kernels: it compiles what captures and later eager forwards launch; a kernel first compiled
# mid-serving cost a 1.7x TTFT, design 008 decision 11) and the bench's W4A8 path (it checks eagerly the output it
# times in graphs).  What such a choice weighs: the host's launch time (sm90.w4a8.fp8_pays).
AS_CAPTURED: ContextVar[bool] = ContextVar("moe_nvfp4_as_captured", default=False)


@contextlib.contextmanager
def choose_as_captured() -> Iterator[None]:
    """Inside (this thread or task), forwards choose as if captured into a CUDA graph (host_cost_counts false)."""
    token = AS_CAPTURED.set(True)
    try:
        yield
    finally:
        AS_CAPTURED.reset(token)


def host_cost_counts(x: torch.Tensor) -> bool:
    """Whether the forward on ``x`` pays its launches' host time each call: not being captured into a CUDA graph
    (a replay launches nothing from Python) and not inside choose_as_captured."""
    return not AS_CAPTURED.get() and not (x.is_cuda and torch.cuda.is_current_stream_capturing())


@dataclass(frozen=True)
class Selection:
    """The backend of each operation on one device; ``moe_w4a4`` is None where no backend can run it."""

    arch: str
    moe_w4a16: Backend
    moe_w4a4: Backend | None
    grouped_gemm: Backend
    quantize: Backend


def arch_of(device: torch.device) -> str:
    """``cpu`` or ``sm_<major><minor>`` of a CUDA device."""
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise RuntimeError(f"no NVFP4 MoE backend for device {device}; supported: CPU (reference), CUDA sm_80+")
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def sm_count(device: torch.device, *, off_gpu: int) -> int:
    """Streaming multiprocessors of a CUDA device (persistent grids are sized from it); ``off_gpu`` stands in
    where kernels run under the Triton interpreter or plans are only inspected (CPU tensors)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else off_gpu


def select_backends(device: torch.device) -> Selection:
    """The backends for ``device`` (see the module docstring)."""
    return _select(arch_of(device), os.environ.get(OVERRIDE_ENV) or None)


@functools.cache
def _select(arch: str, forced_name: str | None) -> Selection:
    order_of = backends.DEFAULT_ORDER  # read at the call: the registry is the one place a backend is added
    if arch == "cpu":
        default = {op: TORCH for op in order_of}
    else:
        default = {op: next((b for b in order if b.supports(arch)), None) for op, order in order_of.items()}
        if default["moe_w4a16"] is None:
            raise RuntimeError(f"no NVFP4 MoE backend for {arch}; supported: CPU (reference), CUDA sm_80+")
    if forced_name is not None:
        forced = by_name(forced_name)
        if not (forced.supports(arch) or (forced.interpreted_on_cpu and arch == "cpu")):
            raise ValueError(
                f"{OVERRIDE_ENV}={forced_name}: {forced.name} runs on "
                f"{sorted(forced.archs or ['sm_80+'])}, not on {arch}"
            )
        default = {op: forced if op in forced.operations else default[op] for op in default}
        default["moe_w4a4"] = forced if "moe_w4a4" in forced.operations else None
    return Selection(arch, **default)
