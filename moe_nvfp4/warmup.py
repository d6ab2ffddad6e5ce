"""The warm-up: compile every kernel variant a layer can launch up to ``max_tokens`` tokens before serving, one
forward on zeros at the fewest tokens of each, in threads (Triton compiles in its C++ passes and ptxas, outside
the GIL) or serially.

    counts = compile_kernels(weights, top_k, torch.bfloat16, 8192, forward=moe_nvfp4.fused_moe)

The forwards are those ``api.warmup_fused_moe`` runs, with the same arguments; only their order and threads
differ, so the same variants compile (a variant is keyed by the arguments' dtypes, alignment and constexprs,
never by the stream or thread) and every later forward finds them compiled.  MOE_NVFP4_WARMUP_THREADS: how
many threads (1: serially, in the calling thread, fewest tokens first; unset: ``min(8, CPUs)``).  At most
``max_tokens`` tokens are in flight at once: no more activation memory than one forward at the scheduler's token
budget, which vLLM's own profiling run needs anyway.  The forward is passed in (``api.fused_moe``) so that the
API can delegate its warm-up here without an import cycle.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from .dispatch import choose_as_captured, select_backends

if TYPE_CHECKING:
    from .weights import Fp8ExpertWeights, MoEWeights

__all__ = ["THREADS_ENV", "compile_kernels", "run_bounded", "warmup_threads", "warmup_token_counts"]

THREADS_ENV = "MOE_NVFP4_WARMUP_THREADS"
MAX_THREADS = 8  # more threads gained nothing measurable (design 004 decision 10)


def warmup_threads() -> int:
    """MOE_NVFP4_WARMUP_THREADS as a count >= 1 (1: serial); unset or empty: min(MAX_THREADS, this process's CPUs)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, min(MAX_THREADS, cpus))
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV}={value!r}: give a thread count >= 1 (1 compiles serially)")
    return int(value)


def warmup_token_counts(
    weights: MoEWeights,
    top_k: int,
    dtype: torch.dtype,
    max_tokens: int,
    expert_map: torch.Tensor | None = None,
    fp8: bool = False,
) -> list[int]:
    """The token counts whose forwards compile every variant up to ``max_tokens``: the device's ``moe_w4a16``
    backend's ``warmup_token_counts`` entry (the sm_90 one: the fewest tokens of each config it serves and of each
    routing variant, and with ``fp8`` of the W4A8 mode); empty where the backend compiles nothing (the CPU's torch
    reference) or ``max_tokens`` < 1."""
    counts = select_backends(weights.w13_packed.device).moe_w4a16.optional_entry("warmup_token_counts")
    if counts is None or max_tokens < 1:
        return []
    return counts(weights, top_k, dtype, max_tokens, expert_map, fp8)


def run_bounded(counts: Sequence[int], run: Callable[[int], object], *, threads: int, budget: int) -> None:
    """``run(t)`` once for each t of ``counts``: with one thread in ascending order in the calling thread, else in
    ``threads`` threads, the most tokens first, never more than ``budget`` tokens in flight (a count over the
    budget runs alone).  The first exception raised by a run is raised here once all have ended."""
    if threads <= 1:
        for t in sorted(counts):
            run(t)
        return
    in_flight = [0]
    changed = threading.Condition()

    def bounded(t: int) -> None:
        with changed:
            changed.wait_for(lambda: in_flight[0] == 0 or in_flight[0] + t <= budget)
            in_flight[0] += t
        try:
            run(t)
        finally:
            with changed:
                in_flight[0] -= t
                changed.notify_all()

    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moe_nvfp4-warmup") as pool:
        futures = [pool.submit(bounded, t) for t in sorted(counts, reverse=True)]
    for f in futures:
        f.result()


def compile_kernels(
    weights: MoEWeights,
    top_k: int,
    dtype: torch.dtype,
    max_tokens: int,
    *,
    forward: Callable[..., torch.Tensor],
    expert_map: torch.Tensor | None = None,
    apply_router_weight_on_input: bool = False,
    fp8_weights: Fp8ExpertWeights | None = None,
    threads: int | None = None,
) -> list[int]:
    """``api.warmup_fused_moe`` in ``threads`` threads (None: ``warmup_threads()``), each forward on a stream of
    its own: ``forward(x, weights, topk_weights, topk_ids, expert_map=, apply_router_weight_on_input=)`` (the
    signature of ``api.fused_moe``) on zeros at each of ``warmup_token_counts``, which it returns.  With
    ``fp8_weights`` (the W4A8 mode's copy) each count runs twice, without it and with it choosing as a CUDA-graph
    capture does (dispatch.choose_as_captured): an eager forward with the copy runs W4A16 where the layer's work is under
    w4a8.FP8_MIN_EAGER_FLOPS, a captured one W4A8 from its rows bound, and both kinds must find their kernels
    compiled."""
    threads = warmup_threads() if threads is None else threads
    counts = warmup_token_counts(weights, top_k, dtype, max_tokens, expert_map, fp8_weights is not None)
    modes = [{}] if fp8_weights is None else [{}, {"fp8_weights": fp8_weights}]
    device = weights.w13_packed.device
    n_global = weights.num_experts if expert_map is None else expert_map.numel()
    cuda = device.type == "cuda"
    # the Triton interpreter (CPU tensors) compiles nothing and is not thread-safe (its grid index is global)
    serial = threads <= 1 or len(counts) <= 1 or not cuda

    def run(t: int) -> None:
        with contextlib.ExitStack() as stack:
            stack.enter_context(choose_as_captured())
            if cuda and not serial:  # CUDA's current device is per thread: this one's, and a stream of its own
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(torch.cuda.Stream(device)))
            x = torch.zeros(t, weights.hidden, dtype=dtype, device=device)
            ids = (torch.arange(t * top_k, device=device, dtype=torch.int32) % n_global).view(t, top_k)
            topk_weights = torch.full((t, top_k), 1.0 / top_k, device=device)
            for mode in modes:
                forward(
                    x,
                    weights,
                    topk_weights,
                    ids,
                    expert_map=expert_map,
                    apply_router_weight_on_input=apply_router_weight_on_input,
                    **mode,
                )
            if cuda and not serial:
                torch.cuda.current_stream(device).synchronize()  # its memory is free again when it leaves the budget

    run_bounded(counts, run, threads=1 if serial else threads, budget=max_tokens)
    return counts
