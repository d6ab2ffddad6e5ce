"""The backend registry and the per-device selection (``backends.py``, ``dispatch.py``): defaults per architecture,
the MOE_NVFP4_BACKEND override, refusals, and that no module outside them compares backend names."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from moe_nvfp4.backends import CUTE, FLASHINFER, OPERATIONS, REGISTRY, TORCH, TRITON, by_name
from moe_nvfp4.dispatch import select_backends

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _on(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], forced: str | None = None):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    if forced is None:
        monkeypatch.delenv("MOE_NVFP4_BACKEND", raising=False)
    else:
        monkeypatch.setenv("MOE_NVFP4_BACKEND", forced)
    return select_backends(torch.device("cuda", 0))


@pytest.mark.parametrize(
    ("capability", "w4a4", "grouped"),
    [
        ((9, 0), None, TRITON),  # Hopper: ours; no FP4 tensor cores, so no W4A4 MoE
        ((8, 0), None, TRITON),
        ((12, 0), None, TRITON),  # consumer Blackwell: its FP4 MMA is another instruction
        ((10, 0), FLASHINFER, CUTE),  # B200: FlashInfer's fused MoE by default
        ((10, 3), FLASHINFER, CUTE),  # B300
    ],
)
def test_defaults_per_architecture(monkeypatch, capability, w4a4, grouped) -> None:
    s = _on(monkeypatch, capability)
    assert s.arch == f"sm_{capability[0]}{capability[1]}"
    assert (s.moe_w4a16, s.moe_w4a4, s.grouped_gemm, s.quantize) == (TRITON, w4a4, grouped, TRITON)


def test_cpu_runs_the_reference(monkeypatch) -> None:
    monkeypatch.delenv("MOE_NVFP4_BACKEND", raising=False)
    s = select_backends(torch.device("cpu"))
    assert (s.arch, s.moe_w4a16, s.moe_w4a4, s.grouped_gemm, s.quantize) == ("cpu", TORCH, TORCH, TORCH, TORCH)


def test_overrides(monkeypatch) -> None:
    """Forcing a backend moves every operation it implements; the W4A4 MoE runs on it or not at all."""
    cute = _on(monkeypatch, (10, 0), "cute")
    assert (cute.moe_w4a4, cute.grouped_gemm, cute.moe_w4a16) == (CUTE, CUTE, TRITON)
    triton = _on(monkeypatch, (10, 0), "triton")  # keeps 16-bit activations on Blackwell
    assert (triton.moe_w4a4, triton.grouped_gemm, triton.quantize) == (None, TRITON, TRITON)
    flashinfer = _on(monkeypatch, (10, 3), "flashinfer")
    assert (flashinfer.moe_w4a4, flashinfer.grouped_gemm) == (FLASHINFER, CUTE)
    monkeypatch.setenv("MOE_NVFP4_BACKEND", "triton")  # the interpreter runs Triton kernels on CPU tensors
    cpu = select_backends(torch.device("cpu"))
    assert (cpu.moe_w4a16, cpu.moe_w4a4, cpu.grouped_gemm, cpu.quantize) == (TRITON, None, TRITON, TRITON)


@pytest.mark.parametrize(
    ("capability", "forced", "match"),
    [
        ((9, 0), "cute", r"cute runs on \['sm_100', 'sm_103'\], not on sm_90"),
        ((9, 0), "flashinfer", "flashinfer runs on .* not on sm_90"),
        ((10, 0), "cuda", "unknown backend 'cuda'"),
    ],
)
def test_override_refused_where_it_cannot_run(monkeypatch, capability, forced, match) -> None:
    with pytest.raises(ValueError, match=match):
        _on(monkeypatch, capability, forced)
    monkeypatch.setenv("MOE_NVFP4_BACKEND", "cute")
    with pytest.raises(ValueError, match="not on cpu"):
        select_backends(torch.device("cpu"))


def test_unknown_architecture_is_an_error(monkeypatch) -> None:
    with pytest.raises(RuntimeError, match="no NVFP4 MoE backend for sm_75"):
        _on(monkeypatch, (7, 5))
    with pytest.raises(RuntimeError, match="no NVFP4 MoE backend for device meta"):
        select_backends(torch.device("meta"))


def test_registry_states_what_ran_on_hardware() -> None:
    """Only what passed the GPU tests on hardware is marked so; Blackwell has no such run yet."""
    assert {b.name for b in REGISTRY} == {"torch", "triton", "cute", "flashinfer"}
    assert all(b.operations <= set(OPERATIONS) for b in REGISTRY)
    assert all(b.ran_on <= (b.archs or b.ran_on) for b in REGISTRY)
    assert TRITON.status("sm_90") == "verified on hardware"
    for backend in (CUTE, FLASHINFER, TRITON):
        assert backend.status("sm_100") == "compiled and checked only (not run on hardware)"
    assert CUTE.status("sm_90") == FLASHINFER.status("sm_90") == "unsupported"
    assert by_name("flashinfer") is FLASHINFER


def test_backend_names_are_compared_nowhere_else() -> None:
    """The failure this prevents: a call site comparing a backend string that the registry no longer returns."""
    pattern = re.compile(r"""[=!]=\s*["'](torch|triton|cute|flashinfer)["']""")
    offenders = [
        str(p.relative_to(ROOT))
        for base in ("moe_nvfp4", "integrations")
        for p in (ROOT / base).rglob("*.py")
        if pattern.search(p.read_text())
    ]
    assert offenders == []


def test_each_backend_names_what_it_runs() -> None:
    """Every operation a backend implements has its entries (a MoE also the weight layout it reads; the
    16-bit-activation MoE may add its warm-up, packer and configs at load, and the W4A8 mode with its fold), and
    every entry imports: the op layer and the API run
    ``Backend.entry`` instead of comparing backends or naming a kernel module."""
    from moe_nvfp4.weight_layouts import weight_layout

    wanted = {
        "quantize": {"quantize"},
        "moe_w4a16": {"moe_w4a16", "moe_w4a16_batched"},
        "moe_w4a4": {"moe_w4a4"},
        "grouped_gemm": {"grouped_gemm", "plan_grouped_gemm"},
    }
    for backend in REGISTRY:
        required = set().union(*(wanted.get(op, set()) for op in backend.operations))
        extra = set()
        if "moe_w4a16" in backend.operations:
            extra = {"warmup_token_counts", "pack_block", "load_configs", "moe_w4a8", "fold_fp8"}
        assert required <= set(backend.entries) <= required | extra, backend.name
        assert ("moe_w4a8" in backend.entries) == ("fold_fp8" in backend.entries), backend.name  # one with the other
        assert all(callable(backend.entry(name)) for name in backend.entries)
        assert ("moe_w4a4" in backend.operations) == (backend.w4a4_layout is not None)
        assert ("moe_w4a16" in backend.operations) == (backend.w4a16_layout is not None)
        for layout in (backend.w4a4_layout, backend.w4a16_layout):
            assert layout is None or weight_layout(layout).name == layout
    with pytest.raises(ValueError, match="the flashinfer backend has no 'quantize'"):
        FLASHINFER.entry("quantize")


def test_backend_objects_are_named_only_by_the_registry_and_dispatch() -> None:
    """Call sites ask the selected backend (``entry``, ``w4a4_layout``, ``reference``): none imports a backend
    object to compare it with ``is``."""
    pattern = re.compile(r"\b(TORCH|TRITON|CUTE|FLASHINFER)\b(?!_)")
    allowed = {"moe_nvfp4/backends.py", "moe_nvfp4/dispatch.py"}
    offenders = [
        rel
        for base in ("moe_nvfp4", "integrations")
        for p in (ROOT / base).rglob("*.py")
        if (rel := str(p.relative_to(ROOT))) not in allowed and pattern.search(p.read_text())
    ]
    assert offenders == []


def test_backends_and_selections_hash() -> None:
    """Backends and selections stay usable as cache keys and set members (``entries`` is a dict, left out)."""
    assert len(set(REGISTRY)) == len(REGISTRY)
    assert hash(select_backends(torch.device("cpu"))) == hash(select_backends(torch.device("cpu")))
