"""What every Triton kernel of the 16-bit-activation MoE forward shares (the routing kernels, the combine, the sm_90
GEMMs; the Blackwell host launches the first two too): the routing predicate, programmatic dependent launch and
the dtype map.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _routed(e, ok, expert_map_ptr, num_global, num_experts, HAS_MAP: tl.constexpr):
    """Global expert ids e (where ok) -> (local expert, routed), routing.routed_pairs' meaning: an id outside
    [0, num_global) or a map entry outside [0, num_experts) routes the pair nowhere, and nothing is read through
    it.  Without a map num_global is num_experts, and the ids are the local experts."""
    ok = ok & (e >= 0) & (e < num_global)
    if HAS_MAP:
        e = tl.load(expert_map_ptr + e, mask=ok, other=-1)
        ok = ok & (e >= 0) & (e < num_experts)
    return e, ok


@triton.jit
def _after_previous_kernel(PDL: tl.constexpr):
    """Programmatic dependent launch: wait until the previous kernel in the stream has finished and its
    writes are visible (every kernel here calls this before its first memory access), then let the next
    kernel launch now, so its CTAs become resident and start the moment this one ends instead of after a
    launch gap.  Decode forwards are three or four short dependent kernels; the gaps are a visible share of
    them."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@functools.lru_cache(maxsize=None)
def _dependent_launch(device: torch.device) -> dict:
    """Launch options of every sm_90 Triton kernel: programmatic dependent launch on sm_90+ (see
    _after_previous_kernel); the interpreter (CPU tensors) and older GPUs launch plainly.  Cached per
    device: three launches of every forward ask (callers only read the dict)."""
    pdl = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)
    return dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)


@contextlib.contextmanager
def plain_launches() -> Iterator[None]:
    """Inside, every sm_90 Triton kernel launches without programmatic dependent launch, so a profiler's time for a
    kernel is its own (with PDL it also holds the wait for the kernel before it)."""
    global _dependent_launch
    dependent_launch = _dependent_launch
    _dependent_launch = lambda device: dict(PDL=False)
    try:
        yield
    finally:
        _dependent_launch = dependent_launch
