"""Activation quantization on the GPU: the reference's bytes at serving shapes, and inside a CUDA graph."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import moe_nvfp4 as m

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_quant import assert_reference_bytes, compare_with_reference, hard_activations  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("rows,k", [(8, 48), (333, 2048), (1000, 7168)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_bytes_on_the_gpu(rows: int, k: int, dtype: torch.dtype, seed: int) -> None:
    x, gs = hard_activations(rows, k, dtype, seed)
    got = m.quantize_activations(x.cuda(), gs.cuda())
    assert got.packed.is_cuda and got.block_scale.is_cuda
    assert_reference_bytes(compare_with_reference(x, gs, got))


def test_graph_replay_with_new_inputs(seed: int) -> None:
    x, gs = hard_activations(64, 512, torch.bfloat16, seed)
    static_x, static_gs = x.cuda(), gs.cuda()
    m.quantize_activations(static_x, static_gs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m.quantize_activations(static_x, static_gs)
    x2, gs2 = hard_activations(64, 512, torch.bfloat16, seed + 1)
    static_x.copy_(x2)
    graph.replay()
    assert_reference_bytes(compare_with_reference(x2, gs2, out))
