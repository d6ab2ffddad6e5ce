"""Packing at load on the GPU (sm90/fragment_pack.py through prepare_moe_weights): the kernel passes its
known-answer check and gives the torch twin's bytes at model shapes, and with ``reuse_input_memory`` (what vLLM's
method passes) it peaks at a run of experts' blocks above the checkpoint tensors (tens of MiB), where packing
into fresh memory costs the whole packed layer."""

from __future__ import annotations

import time

import pytest
import torch

import moe_nvfp4 as m
from moe_nvfp4.checkpoint import SCAN_CHUNK_BYTES
from moe_nvfp4.formats import NVFP4, NVFP4Tensor
from moe_nvfp4.weight_layouts import PACK_RUN_BYTES, Sm90Layout

# A failed known-answer check falls back to the twin with a RuntimeWarning: here it fails the test instead, so the
# tests below measure the kernel and never the twin standing in for it.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("error::RuntimeWarning"),
]


def test_the_kernel_passes_its_known_answer_check() -> None:
    from moe_nvfp4.sm90.fragment_pack import agrees_with_twin

    assert agrees_with_twin(torch.device("cuda", torch.cuda.current_device()))


def _checkpoint(e: int, i: int, h: int, seed: int, device: str) -> tuple[NVFP4Tensor, NVFP4Tensor]:
    """Random bytes: every code, every non-negative finite e4m3 scale, zero scales among them."""
    g = torch.Generator(device).manual_seed(seed)

    def matrix(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        packed = torch.randint(0, 256, (e, n, k // 2), generator=g, device=device, dtype=torch.uint8)
        scale = torch.randint(0, 0x7F, (e, n, k // 16), generator=g, device=device, dtype=torch.uint8)
        scale[torch.rand(scale.shape, generator=g, device=device) < 0.05] = 0
        return packed, scale.view(NVFP4.scale_dtype)

    w13, w2 = matrix(2 * i, h), matrix(h, i)
    return NVFP4Tensor(*w13, torch.rand(e, 2, device=device) + 0.5), NVFP4Tensor(
        *w2, torch.rand(e, device=device) + 0.5
    )


@pytest.mark.parametrize(
    ("e", "i", "h"),
    [(4, 768, 2048), (2, 1856, 2688), (3, 96, 4096), (2, 208, 176)],
    ids=["qwen3-30b", "nemotron-3-nano", "i96-tp8-slice", "odd"],
)
@pytest.mark.parametrize("reuse", [False, True])
def test_the_twins_bytes(e: int, i: int, h: int, reuse: bool, seed: int) -> None:
    w13, w2 = _checkpoint(e, i, h, seed, "cpu")
    want = m.prepare_moe_weights(w13, w2)
    cuda = [NVFP4Tensor(q.packed.cuda(), q.block_scale.cuda(), q.global_scale.cuda()) for q in (w13, w2)]
    got = m.prepare_moe_weights(*cuda, reuse_input_memory=reuse)
    for name in ("w13_packed", "w13_scale", "w13_global", "w2_packed", "w2_scale", "w2_global"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name


def test_reuse_input_memory_peaks_far_under_the_layer(seed: int) -> None:
    """Qwen3-30B-A3B's layer (128 experts, I=768, H=2048: no padding): packing into fresh memory takes the packed
    layer (about 340 MB) on top of the checkpoint; in place, at most a run of experts' blocks (PACK_RUN_BYTES of
    values and their scales) or the validator's masks of one chunk of scale bytes (3 SCAN_CHUNK_BYTES), far under
    the layer.  The layer takes seconds at most, not the minutes of the torch twin's launches."""
    e, i, h = 128, 768, 2048
    bound = max(PACK_RUN_BYTES * (1 + 2 / NVFP4.block_size), 3 * SCAN_CHUNK_BYTES) + 2**20  # + small tensors
    one_expert = 3 * i * h * (1 / 2 + 1 / NVFP4.block_size)
    peaks = {}
    for reuse in (False, True):
        w13, w2 = _checkpoint(e, i, h, seed, "cuda")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        weights = m.prepare_moe_weights(w13, w2, reuse_input_memory=reuse)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peaks[reuse] = torch.cuda.max_memory_allocated() - before
        del w13, w2, weights
        assert seconds < 30, f"packing one layer took {seconds:.1f} s"
    assert peaks[False] > 100 * one_expert, peaks
    assert peaks[True] <= bound, f"peak extra {peaks[True] / 2**20:.2f} MiB, bound {bound / 2**20:.2f} MiB"


def test_the_layout_reads_the_checkpoint_rows_it_overwrites_from_a_copy(seed: int) -> None:
    """Gate and up blocks of one expert in place: the up block must not read gate rows already repacked."""
    w13, w2 = _checkpoint(1, 128, 256, seed, "cuda")
    want = Sm90Layout().pack(
        NVFP4Tensor(w13.packed.cpu(), w13.block_scale.cpu(), w13.global_scale.cpu()),
        NVFP4Tensor(w2.packed.cpu(), w2.block_scale.cpu(), w2.global_scale.cpu()),
    )
    got = m.prepare_moe_weights(w13, w2, reuse_input_memory=True)
    assert got.w13_packed.data_ptr() == w13.packed.data_ptr()
    assert torch.equal(got.w13_packed.cpu(), want[0]) and torch.equal(got.w2_packed.cpu(), want[3])
