"""tools/accuracy_modes.py's roundings (the record behind docs/design/008): each mode's quantizer and its forward.

Tolerances: an e4m3 value keeps 4 significant bits, so a rounded element is within 2^-4 of itself (relative, in
the normal range); the layer-level bounds are the orders of magnitude the record reports (W4A16 ~3e-3, W4A8 ~4e-2,
W4A4 ~1.3e-1) with a factor of two or more of room.
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import accuracy_modes as A  # noqa: E402

from moe_nvfp4 import formats  # noqa: E402
from moe_nvfp4.zoo import MODELS  # noqa: E402


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbelow(2**31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def test_e4m3_rows_keep_four_significant_bits(gen: torch.Generator) -> None:
    a = (
        torch.randn(16, 256, generator=gen, dtype=torch.float64)
        * torch.rand(16, 1, generator=gen, dtype=torch.float64)
        * 100
    )
    q = A.e4m3_per_row(a)
    scale = a.abs().amax(-1, keepdim=True) / A.E4M3_MAX
    normal = a.abs() >= scale * 2.0**-6  # e4m3's smallest normal, times the row's scale
    assert ((q - a).abs() <= a.abs() * 2.0**-4 + 1e-12)[normal].all()
    assert torch.equal(
        A.e4m3_per_row(torch.tensor([[1.0, -2.0, 448.0, 0.5]], dtype=torch.float64)),
        torch.tensor([[1.0, -2.0, 448.0, 0.5]], dtype=torch.float64),
    )  # representable: exact


def test_folded_weights_round_each_product_once(gen: torch.Generator) -> None:
    q = formats.quantize_nvfp4(torch.randn(3, 64, 128, generator=gen), segments=1)
    exact = formats.dequantize_nvfp4(q, torch.float64)
    folded = A.folded_fp8(q)
    big = exact.abs() >= exact.abs().amax() * 2.0**-8  # clear of e4m3's subnormals after the expert's shift
    assert ((folded - exact).abs() <= exact.abs() * 2.0**-4 * 1.0001)[big].all()
    assert (folded != exact).any(), "code x scale needs up to 5 significant bits: some products must round"


def test_modes_order_as_the_record_says(gen: torch.Generator) -> None:
    model = next(m for m in MODELS if m.key == "olmoe")
    rows = A.measure(model, experts=4, tokens=24, seed=int(torch.randint(0, 2**31, (1,), generator=gen)))
    for r in rows:
        assert r["w4a16"] < 1e-2 < r["w4a8"] < r["w4a4"], r
        assert r["w4a8"] < 1e-1 and r["w4a8_folded"] < 1.5e-1 and r["w4a4"] < 3e-1, r
