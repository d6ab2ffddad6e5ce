"""The threaded warm-up (moe_nvfp4.warmup) on the CPU: it runs exactly the forwards api.warmup_fused_moe runs (same
token counts, same arguments), each once, never more tokens in flight than the budget, serially where asked, and a
failing forward fails it.  Forwards are stand-ins that record their arguments (on the CPU nothing compiles); the
GPU test is tests/gpu/test_tune_cli_gpu.py's warm-up case.

No tolerances: token counts, arguments and call counts are exact.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

import moe_nvfp4
import moe_nvfp4.api as api
from moe_nvfp4.backends import TRITON
import moe_nvfp4.warmup as warmup
from moe_nvfp4.warmup import THREADS_ENV, compile_kernels, run_bounded, warmup_threads

KERNELS = SimpleNamespace(moe_w4a16=TRITON)  # a backend that compiles, on CPU tensors


def _weights(experts: int = 8, hidden: int = 128, inter: int = 64) -> moe_nvfp4.MoEWeights:
    q13 = moe_nvfp4.quantize_nvfp4(torch.randn(experts, 2 * inter, hidden), segments=2)
    return moe_nvfp4.prepare_moe_weights(q13, moe_nvfp4.quantize_nvfp4(torch.randn(experts, hidden, inter)))


def _recorder(calls: list, lock: threading.Lock):
    def forward(x, weights, topk_weights, topk_ids, *, expert_map=None, apply_router_weight_on_input=False):
        with lock:
            calls.append(
                (
                    tuple(x.shape),
                    x.dtype,
                    bool((x == 0).all()),
                    topk_weights.dtype,
                    topk_weights.tolist(),
                    topk_ids.dtype,
                    topk_ids.tolist(),
                    expert_map,
                    apply_router_weight_on_input,
                )
            )
        return torch.empty_like(x)

    return forward


@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("ep,on_input", [(False, False), (True, False), (False, True)])
def test_the_same_forwards_as_the_apis_warmup(monkeypatch, threads: int, ep: bool, on_input: bool) -> None:
    weights = _weights()
    expert_map = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7] + [-1] * 24, dtype=torch.int32) if ep else None
    for module in (api, warmup):
        monkeypatch.setattr(module, "select_backends", lambda device: KERNELS)
    lock = threading.Lock()
    theirs: list = []  # the API's warm-up, serially: the order the forwards were always run in
    monkeypatch.setattr(api, "fused_moe", _recorder(theirs, lock))
    monkeypatch.setenv("MOE_NVFP4_WARMUP_THREADS", "1")
    counts = api.warmup_fused_moe(
        weights, 4, torch.bfloat16, 4096, expert_map=expert_map, apply_router_weight_on_input=on_input
    )
    ours: list = []
    got = compile_kernels(
        weights,
        4,
        torch.bfloat16,
        4096,
        forward=_recorder(ours, lock),
        expert_map=expert_map,
        apply_router_weight_on_input=on_input,
        threads=threads,
    )
    assert got == counts and len(counts) > 3
    assert sorted(ours, key=lambda c: c[0]) == theirs  # every forward once, argument for argument
    if threads == 1:
        assert ours == theirs  # serially: the API's order too


@pytest.mark.parametrize("ep", [False, True])
def test_the_w4a8_copy_reaches_every_forward_from_its_first_count(monkeypatch, ep: bool) -> None:
    """With the W4A8 mode's copy each count runs without it and with it (serving calls both: eager forwards under the
    work bound run W4A16, captured ones W4A8), and the fewest tokens at which the mode runs (w4a8.fp8_first_tokens:
    80 rows an expert, over the global experts under an expert map) is one of the counts, so its kernels compile at
    load, not in the first prefill (a 1.7x TTFT hit in vLLM's serving bench when they did)."""
    from moe_nvfp4.dispatch import host_cost_counts
    from moe_nvfp4.sm90.w4a8 import fp8_first_tokens, fp8_pays

    weights = _weights()
    expert_map = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7] + [-1] * 24, dtype=torch.int32) if ep else None
    fp8 = moe_nvfp4.prepare_fp8_weights(weights)
    monkeypatch.setattr(warmup, "select_backends", lambda device: KERNELS)
    seen: list = []

    def forward(x, w, topk_weights, topk_ids, *, expert_map=None, apply_router_weight_on_input=False, **fp8_kw):
        seen.append((x.shape[0], fp8_kw.get("fp8_weights"), host_cost_counts(x)))
        return torch.empty_like(x)

    plain = compile_kernels(weights, 4, torch.bfloat16, 4096, forward=forward, expert_map=expert_map, threads=1)
    assert all(f is None for _, f, _ in seen)
    seen.clear()
    counts = compile_kernels(
        weights, 4, torch.bfloat16, 4096, forward=forward, expert_map=expert_map, fp8_weights=fp8, threads=1
    )
    first = fp8_first_tokens(4, 32 if ep else 8)
    assert first == (640 if ep else 160) and first not in plain
    # the warm-up's forwards choose as a CUDA-graph capture does (the rows bound alone), not as an eager one (the
    # host's cost weighed: this small layer would stay W4A16), so the mode's kernels compile here
    shape = weights.layer_shape(4, torch.bfloat16, expert_map)
    assert fp8_pays(first, shape, False, eager=False) and not fp8_pays(first - 1, shape, False, eager=False)
    assert not fp8_pays(first, shape, False, eager=True) and host_cost_counts(torch.zeros(1))
    assert counts == sorted({*plain, first})
    assert seen == [(t, f, False) for t in counts for f in (None, fp8)]
    # past max_tokens the mode never runs: nothing more to compile
    under = dict(forward=forward, expert_map=expert_map, threads=1)
    assert compile_kernels(weights, 4, torch.bfloat16, first - 1, fp8_weights=fp8, **under) == (
        compile_kernels(weights, 4, torch.bfloat16, first - 1, **under)
    )


def test_nothing_to_compile_on_the_reference_backend() -> None:
    calls: list = []
    assert compile_kernels(_weights(), 4, torch.bfloat16, 4096, forward=_recorder(calls, threading.Lock())) == []
    assert calls == []


def test_at_most_the_budget_in_flight_and_every_count_once() -> None:
    """Each run sleeps so that runs overlap; the tokens in flight never pass the budget, a count over the budget
    runs alone, and with room for all of them several run at once."""
    in_flight, seen, ran = [0], [], []
    lock = threading.Lock()

    def run(t: int) -> None:
        with lock:
            in_flight[0] += t
            seen.append(in_flight[0])
            ran.append(t)
        time.sleep(0.02)
        with lock:
            in_flight[0] -= t

    counts = [1, 3, 17, 65, 129, 257, 1025, 1921, 2817, 9000]
    run_bounded(counts, run, threads=4, budget=3000)
    assert sorted(ran) == counts and max(seen) == 9000  # over the budget: alone
    assert all(s <= 3000 for s in seen if s != 9000)
    seen.clear()
    run_bounded(counts[:6], run, threads=4, budget=3000)
    assert max(seen) > 257  # several at once


def test_serial_runs_in_the_calling_thread_fewest_tokens_first() -> None:
    order = []
    run_bounded([40, 1, 3], lambda t: order.append((t, threading.current_thread())), threads=1, budget=10)
    assert order == [(1, threading.current_thread()), (3, threading.current_thread()), (40, threading.current_thread())]


def test_a_failing_forward_fails_the_warmup_after_the_others_ended() -> None:
    ran = []

    def run(t: int) -> None:
        if t == 17:
            raise RuntimeError("compile failed at 17")
        time.sleep(0.01)
        ran.append(t)

    with pytest.raises(RuntimeError, match="compile failed at 17"):
        run_bounded([1, 3, 17, 65], run, threads=2, budget=100)
    assert sorted(ran) == [1, 3, 65]


@pytest.mark.parametrize("value,threads", [("1", 1), ("16", 16), (" 4 ", 4)])
def test_the_thread_count_from_the_environment(monkeypatch, value: str, threads: int) -> None:
    monkeypatch.setenv(THREADS_ENV, value)
    assert warmup_threads() == threads


def test_the_default_thread_count_is_bounded_by_the_cpus(monkeypatch) -> None:
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setattr(warmup.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert warmup_threads() == 2
    monkeypatch.setattr(warmup.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert warmup_threads() == warmup.MAX_THREADS


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_a_bad_thread_count_is_refused(monkeypatch, value: str) -> None:
    monkeypatch.setenv(THREADS_ENV, value)
    with pytest.raises(ValueError, match="MOE_NVFP4_WARMUP_THREADS"):
        warmup_threads()
