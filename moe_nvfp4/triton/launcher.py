"""Kernel launches with less host time than ``kernel[grid](...)``: what every launch of the forward goes through.

An eager prefill forward (vLLM runs prefill past its CUDA-graph sizes eagerly) was host-bound on an H200 host:
Triton 3.6's ``JITFunction.run`` took 37-135 us a launch, and about a third of that was outside the specialization
binder and the driver launch: knob reads, a string of the options for its cache key, the kernel's globals checked,
launch metadata built, and two empty launch-hook chains called back from C (design 008 decision 12).  ``launch``
keeps Triton's binder, so the specialization, and so the compiled kernel, is Triton's own for these arguments; it
keys the compiled kernel by that specialization and launches it with no hooks.  What it cannot serve takes
``kernel[grid](...)``: the interpreter, a registered launch or pre-run hook, the first launch of each
specialization (which compiles, or finds the kernel in Triton's caches), and every Triton but the 3.6 it was measured
and tested on (the internals it calls are not Triton's public API).
"""

from __future__ import annotations

from typing import Any

import triton
from triton.runtime import driver

try:
    from triton import knobs
except ImportError:  # a Triton before knobs: the plain launch
    knobs = None

__all__ = ["launch"]

# JITFunction's device caches (the binder last), CompiledKernel.run's arguments and the launch-hook chains as in 3.6
INTERNALS_KNOWN = knobs is not None and triton.__version__.split(".")[:2] == ["3", "6"]

# (id(kernel), device, specialization, options, debug, instrumentation) -> (kernel, the CompiledKernel Triton launched
# for them): the id, not the kernel (whose hash is a Python property); the entry holds the kernel, so no other
# kernel can take its id
_COMPILED: dict[tuple, tuple[Any, Any]] = {}


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, the same compiled kernel on the same stream, with less host time."""
    caches = getattr(kernel, "device_caches", None)  # None: the interpreter's InterpretedFunction
    if not INTERNALS_KNOWN or caches is None or kernel.pre_run_hooks or _hooked():
        kernel[grid](*args, **kwargs)
        return
    runtime = knobs.runtime
    device = driver.active.get_current_device()
    binder = caches[device][-1]  # a defaultdict: the first launch on a device builds the binder, as JITFunction.run
    bound, specialization, options = binder(*args, **kwargs)
    key = (
        id(kernel),
        device,
        tuple(specialization),
        tuple(options.items()),
        runtime.debug,
        knobs.compilation.instrumentation_mode,
    )
    entry = _COMPILED.get(key)
    if entry is None:
        compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
        if compiled is not None:
            _COMPILED[key] = kernel, compiled
        return
    compiled = entry[1]
    stream = driver.active.get_current_stream(device)
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    compiled.run(
        grid[0], grid_1, grid_2, stream, compiled.function, compiled.packed_metadata, None, None, None, *bound.values()
    )


def _hooked() -> bool:
    """Whether a launch hook is registered (a profiler's): it must see the launch, through JITFunction.run."""
    return bool(knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls)
