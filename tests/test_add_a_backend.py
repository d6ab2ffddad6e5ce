"""Adding a backend is one registry line (docs/extending.md, design 005): a stub backend for a new architecture,
registered in ``backends.REGISTRY`` / ``DEFAULT_ORDER`` only, is what ``dispatch.select_backends`` picks for it,
and ``moe_nvfp4.fused_moe`` (and its warm-up and packing) run through its entries without any other file naming it.
The stub wraps the torch reference and doubles its output, so the result shows which backend ran.

Tolerances (relative L2 error against the reference on the same packed weights):
| what                       | tol   | why                                                           |
|----------------------------|-------|---------------------------------------------------------------|
| stub forward vs 2 x torch  | 1e-6  | the same float32 math, both rounded to bf16 alike             |
"""

from __future__ import annotations

import pytest
import torch

import moe_nvfp4 as m
from moe_nvfp4 import backends, dispatch
from moe_nvfp4.backends import TRITON, Backend
from moe_nvfp4.reference import fused_moe_packed_torch

TOL = 1e-6
CALLS: list[tuple[int, ...]] = []  # the stub's forwards (x's shape each)


def stub_fused_moe(x: torch.Tensor, *weights_and_routing, **keywords) -> torch.Tensor:
    """The stub's ``moe_w4a16`` entry: the torch reference, counted and doubled."""
    CALLS.append(tuple(x.shape))
    return 2 * fused_moe_packed_torch(x, *weights_and_routing, **keywords)


STUB = Backend(
    "stub",
    frozenset({"moe_w4a16"}),
    frozenset({"cpu", "sm_120"}),
    frozenset(),
    "a test backend: the torch reference under another name",
    {
        "moe_w4a16": "test_add_a_backend:stub_fused_moe",
        "moe_w4a16_batched": "moe_nvfp4.reference:fused_moe_batched_packed_torch",
    },
    w4a16_layout="sm90_fragments",
)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch):
    """STUB in the registry and first for the 16-bit-activation MoE: the one line a new backend adds."""
    monkeypatch.setattr(backends, "REGISTRY", (*backends.REGISTRY, STUB))
    monkeypatch.setattr(backends, "DEFAULT_ORDER", dict(backends.DEFAULT_ORDER, moe_w4a16=(STUB, TRITON)))
    dispatch._select.cache_clear()  # the selection is cached per architecture
    CALLS.clear()
    yield
    dispatch._select.cache_clear()


def test_the_registry_line_makes_it_the_default_of_its_architecture(registered, monkeypatch) -> None:
    monkeypatch.delenv("MOE_NVFP4_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    assert dispatch.select_backends(torch.device("cuda", 0)).moe_w4a16 is STUB
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert dispatch.select_backends(torch.device("cuda", 0)).moe_w4a16 is TRITON  # other architectures keep theirs


@pytest.mark.parametrize("on_input", [False, True])
def test_fused_moe_runs_through_the_registered_backend(registered, monkeypatch, on_input: bool) -> None:
    monkeypatch.setenv("MOE_NVFP4_BACKEND", "stub")  # the CPU's default is the torch reference
    assert dispatch.select_backends(torch.device("cpu")).moe_w4a16 is STUB
    e, h, i, t, k = 4, 64, 32, 5, 2
    weights = m.prepare_moe_weights(
        m.quantize_nvfp4(torch.randn(e, 2 * i, h), segments=2), m.quantize_nvfp4(torch.randn(e, h, i) / 4)
    )
    x = torch.randn(t, h).bfloat16()
    tw, ti = m.topk_softmax(torch.randn(t, e), k)
    out = m.fused_moe(x, weights, tw, ti, apply_router_weight_on_input=on_input)
    assert CALLS == [(t, h)]
    w13, w2 = weights.to_nvfp4()
    ref = m.fused_moe_torch(x, w13, w2, tw, ti, apply_router_weight_on_input=on_input).float()
    err = ((out.float() - 2 * ref).norm() / (2 * ref).norm()).item()
    assert err <= TOL, err
    assert m.warmup_fused_moe(weights, k, torch.bfloat16, 64) == []  # no warm-up entry: nothing to compile
