"""weight_layouts: one MoEWeights type, three layouts; each packs checkpoint tensors and unpacks them back bit for
bit (every FP4 code, random e4m3 scales, gate and up with their own global scales), and the custom ops rebuild a
layout from its name and offset.  Exact: bytes compared with ``torch.equal``."""

from __future__ import annotations

import pytest
import torch

import moe_nvfp4 as m
import moe_nvfp4.prepare_weights as prepare_weights
from moe_nvfp4.weight_layouts import FlashInferLayout, Sm90Layout, Sm100Layout, weight_layout

LAYOUTS = [Sm90Layout(), Sm100Layout(), FlashInferLayout()]


def _checkpoint(gen: torch.Generator, e: int, h: int, i: int) -> tuple[m.NVFP4Tensor, m.NVFP4Tensor]:
    def rand(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
        scales = (torch.rand(e, n, k // 16, generator=gen) * 4 + 0.25).to(torch.float8_e4m3fn)
        return packed, scales

    return (
        m.NVFP4Tensor(*rand(2 * i, h), torch.rand(e, 2, generator=gen) + 0.5),
        m.NVFP4Tensor(*rand(h, i), torch.rand(e, generator=gen) + 0.5),
    )


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize(("e", "h", "i"), [(1, 32, 16), (3, 96, 48), (2, 256, 208)])  # H, I off every padding
def test_every_layout_round_trips(gen: torch.Generator, layout, e: int, h: int, i: int) -> None:
    w13, w2 = _checkpoint(gen, e, h, i)
    weights = prepare_weights._packed(w13, w2, layout)
    assert isinstance(weights, m.MoEWeights) and weights.layout is layout
    assert (weights.num_experts, weights.hidden, weights.intermediate) == (e, h, i)
    back13, back2 = weights.to_nvfp4()
    for got, want in ((back13, w13), (back2, w2)):
        assert torch.equal(got.packed, want.packed)
        assert torch.equal(got.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
        assert torch.equal(got.global_scale, want.global_scale)


def test_layouts_rebuilt_from_name_and_offset() -> None:
    """Only the FlashInfer layout is routed by an offset; the others take the expert map, so theirs stays 0."""
    for layout in LAYOUTS:
        assert weight_layout(layout.name) == layout
    assert weight_layout("flashinfer_trtllm", 4).expert_offset == 4
    assert weight_layout("sm100_interleaved", 4).expert_offset == 0
    with pytest.raises(ValueError, match="unknown weight layout 'fragments'"):
        weight_layout("fragments")


def test_flashinfer_reference_routes_the_local_range() -> None:
    """The reference routes FlashInfer weights by their contiguous range, as the kernel does, whatever the map."""
    got = FlashInferLayout(expert_offset=2).expert_map_for(torch.zeros(7, dtype=torch.int32), 3)
    assert got.tolist() == [-1, -1, 0, 1, 2, -1, -1]
    assert Sm100Layout().expert_map_for(None, 3) is None


def test_fragments_hold_a_non_gated_w13_as_one_block(gen: torch.Generator) -> None:
    """A non-gated activation's w13 [E, I, H] (global [E]) packs as one padded block of I rows and comes back."""
    e, h, i = 2, 96, 48
    gated13, w2 = _checkpoint(gen, e, h, i)
    w13 = m.NVFP4Tensor(gated13.packed[:, :i], gated13.block_scale[:, :i], gated13.global_scale[:, 0].contiguous())
    layout = Sm90Layout()
    weights = m.MoEWeights(
        *layout.pack(w13.linear_scales(), w2), hidden=h, intermediate=i, layout=layout, activation=m.RELU2
    )  # a one-block w13 is a non-gated activation's
    assert weights.w13_packed.shape == (e, layout.fragments.padded_n(i), layout.fragments.padded_k(h) // 2)
    back13, back2 = weights.to_nvfp4()
    for got, want in ((back13, w13), (back2, w2)):
        assert torch.equal(got.packed, want.packed) and torch.equal(got.global_scale, want.global_scale)
        assert torch.equal(got.block_scale.view(torch.uint8), want.block_scale.view(torch.uint8))
