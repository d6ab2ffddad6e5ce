"""Packing into the sm_90 fragment layout: the Triton kernel (sm90/fragment_pack.py) under the interpreter gives
the torch twin's bytes (``FragmentLayout.pack``) exactly, alone and inside ``Sm90Layout.pack``; and
``reuse_input_memory`` packs into the checkpoint tensors' own memory where the layout adds no padding, with the
same bytes as a fresh packing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import moe_nvfp4 as m
from moe_nvfp4.weight_layouts import Sm90Layout

# Runs in a subprocess so TRITON_INTERPRET is set before triton is imported.
SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from moe_nvfp4.formats import NVFP4, NVFP4Tensor
    from moe_nvfp4.layouts import FragmentLayout
    from moe_nvfp4.sm90.fragment_pack import pack_fragment_block
    from moe_nvfp4 import weight_layouts
    from moe_nvfp4.weight_layouts import Sm90Layout
    e, i, h, seed = map(int, sys.argv[1:])
    g = torch.Generator().manual_seed(seed)

    def matrix(*shape):  # every code, every non-negative finite e4m3 scale byte, zeros and -0.0 among them
        packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=g, dtype=torch.uint8)
        scale = torch.randint(0, 0x7F, (*shape[:-1], shape[-1] // 16), generator=g, dtype=torch.uint8)
        scale[torch.rand(scale.shape, generator=g) < 0.1] = 0
        scale[torch.rand(scale.shape, generator=g) < 0.05] = 0x80
        return packed, scale.view(NVFP4.scale_dtype)

    result = {}
    packed, scale = matrix(2 * i, h)
    want = FragmentLayout().pack(packed[i:], scale[i:])  # the up block of a w13: a row slice, as the layout reads it
    got = [torch.full_like(t, 0xAB) for t in want]
    pack_fragment_block(packed[i:], scale[i:], *got)
    result["block"] = all(torch.equal(a, b) for a, b in zip(got, want))
    (p13, s13), (p2, s2) = matrix(e, 2 * i, h), matrix(e, h, i)
    w13 = NVFP4Tensor(p13, s13, torch.rand(e, 2) + 0.5)
    w2 = NVFP4Tensor(p2, s2, torch.rand(e) + 0.5)
    twin = Sm90Layout().pack(w13, w2)
    for run_bytes in (1, 1 << 26):  # runs of one expert, and one run for the layer
        weight_layouts.PACK_RUN_BYTES = run_bytes
        for reuse in (False, True):
            c13 = NVFP4Tensor(p13.clone(), s13.clone(), w13.global_scale)
            c2 = NVFP4Tensor(p2.clone(), s2.clone(), w2.global_scale)
            got = Sm90Layout().pack(c13, c2, reuse_input_memory=reuse, pack_block=pack_fragment_block)
            result[f"layer_reuse={reuse}"] = result.get(f"layer_reuse={reuse}", True) and all(
                torch.equal(a, b) for a, b in zip(got, twin))
            result[f"in_place_reuse={reuse}"] = [got[0].data_ptr() == c13.packed.data_ptr(),
                                                 got[3].data_ptr() == c2.packed.data_ptr()]
    print(json.dumps(result))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("e", "i", "h"),
    [(3, 128, 128), (2, 48, 144), (1, 64, 256)],
    ids=["both-in-place", "rows-and-k-padded", "w13-in-place-w2-k-padded"],
)
def test_kernel_gives_the_twins_bytes(e: int, i: int, h: int, seed: int) -> None:
    """I=48, H=144: rows and K padded inside the unit and chunk, so nothing is packed in place; I=64: w13 in place,
    w2's K padded (64 -> 128); I=H=128: both in place."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(e), str(i), str(h), str(seed % 2**31)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["block"] and result["layer_reuse=False"] and result["layer_reuse=True"], result
    assert result["in_place_reuse=False"] == [False, False]
    aligned = i % 64 == 0 and h % 128 == 0, h % 64 == 0 and i % 128 == 0
    assert result["in_place_reuse=True"] == list(aligned), result


def _checkpoint(e: int, i: int, h: int, gen: torch.Generator) -> tuple[m.NVFP4Tensor, m.NVFP4Tensor]:
    w13 = torch.randn(e, 2 * i, h, generator=gen)
    w13[..., :16] = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6])  # every code
    return m.quantize_nvfp4(w13, segments=2), m.quantize_nvfp4(torch.randn(e, h, i, generator=gen))


def _copy(q: m.NVFP4Tensor) -> m.NVFP4Tensor:
    return m.NVFP4Tensor(q.packed.clone(), q.block_scale.clone(), q.global_scale.clone())


@pytest.mark.parametrize(("i", "h"), [(64, 128), (128, 256), (96, 128), (64, 144)])
def test_reuse_input_memory_packs_the_same_bytes_into_the_inputs(i: int, h: int, gen: torch.Generator) -> None:
    """prepare_moe_weights(reuse_input_memory=True) on the CPU (torch twin): the same tensors as a fresh packing;
    each matrix the layout does not pad lives in its input's memory afterwards, a padded one in new memory with
    its input untouched."""
    w13, w2 = _checkpoint(3, i, h, gen)
    fresh = m.prepare_moe_weights(w13, w2)
    c13, c2 = _copy(w13), _copy(w2)
    reused = m.prepare_moe_weights(c13, c2, reuse_input_memory=True)
    for name in ("w13_packed", "w13_scale", "w13_global", "w2_packed", "w2_scale", "w2_global"):
        assert torch.equal(getattr(reused, name), getattr(fresh, name)), name
    layout = Sm90Layout().fragments
    for q, orig, packed, scale, (rows, k) in (
        (c13, w13, reused.w13_packed, reused.w13_scale, (i, h)),
        (c2, w2, reused.w2_packed, reused.w2_scale, (h, i)),
    ):
        in_place = layout.padded_n(rows) == rows and layout.padded_k(k) == k
        assert (packed.data_ptr() == q.packed.data_ptr()) == in_place
        assert (scale.data_ptr() == q.block_scale.data_ptr()) == in_place
        if not in_place:
            assert torch.equal(q.packed, orig.packed) and torch.equal(
                q.block_scale.view(torch.uint8), orig.block_scale.view(torch.uint8)
            )
    out = m.fused_moe(
        torch.randn(5, h, generator=gen).half(),
        reused,
        torch.rand(5, 2, generator=gen),
        torch.randint(0, 3, (5, 2), generator=gen),
    )
    assert torch.isfinite(out).all()


def test_a_bad_expert_is_named_before_any_memory_is_reused(gen: torch.Generator) -> None:
    """Validation comes first, matrix by matrix: a NaN scale in expert 2 fails with its name, inputs unchanged."""
    w13, w2 = _checkpoint(4, 64, 128, gen)
    w2.block_scale.view(torch.uint8)[2, 5, 1] = 0x7F
    before = w13.packed.clone()
    with pytest.raises(m.CheckpointError, match=r"w2\.weight_scale \(expert 2\): 1 block scales are NaN or inf"):
        m.prepare_moe_weights(w13, w2, reuse_input_memory=True)
    assert torch.equal(w13.packed, before)


def test_kernel_compiles_for_hopper() -> None:
    """The kernel through Triton's whole sm_90 pipeline on this CPU machine (PTX, then ptxas to a cubin): a GPU
    host would fail at the first load of a checkpoint otherwise, and the interpreter does not compile."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_nvfp4.sm90.fragment_pack import _pack_fragments_kernel

    signature = dict(
        src_ptr="*u8",
        src_scale_ptr="*u8",
        dst_ptr="*i32",
        dst_scale_ptr="*u8",
        bits_ptr="*i32",
        e5m3_ptr="*u8",
        n="i32",
        k="i32",
        src_stride="i32",
        scale_stride="i32",
        chunks="i32",
        src_matrix_stride="i64",
        scale_matrix_stride="i64",
        dst_matrix_words="i64",
        dst_scale_matrix_stride="i64",
    )
    assert list(signature) == _pack_fragments_kernel.arg_names, "test signature out of date with the kernel"
    compiled = triton.compile(
        ASTSource(_pack_fragments_kernel, signature), target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)
    )
    assert compiled.asm["cubin"] and "st.global" in compiled.asm["ptx"]


def test_prepare_moe_weights_packs_with_the_kernel_on_a_gpu(monkeypatch) -> None:
    """The sm_90 backend's packer (its ``pack_block`` entry), read without a GPU: the kernel (for the layout's own
    fragments) on CUDA where it passes its known-answer check, else the twin with a warning that names the device;
    the twin on the CPU."""
    pytest.importorskip("triton")
    from moe_nvfp4.backends import TRITON
    from moe_nvfp4.sm90 import fragment_pack
    from moe_nvfp4.weight_layouts import weight_layout

    fragments = weight_layout(TRITON.w4a16_layout).fragments
    block_packer = TRITON.entry("pack_block")
    checked = []
    monkeypatch.setattr(fragment_pack, "agrees_with_twin", lambda device, layout: checked.append(layout) or True)
    packer = block_packer(torch.device("cuda", 0), fragments)
    assert packer.func is fragment_pack.pack_fragment_block and packer.keywords == {"layout": fragments}
    assert checked == [fragments]
    assert block_packer(torch.device("cpu"), fragments) is None
    monkeypatch.setattr(fragment_pack, "agrees_with_twin", lambda device, layout: False)
    with pytest.warns(RuntimeWarning, match=r"other bytes than its torch twin on cuda:0 \(Triton 3"):
        assert block_packer(torch.device("cuda", 0), fragments) is None


KNOWN_ANSWER_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from moe_nvfp4.sm90 import fragment_pack
    cpu = torch.device("cpu")
    print(fragment_pack.agrees_with_twin(cpu))
    kernel = fragment_pack.pack_fragment_block

    def one_byte_off(packed, scales, dst, dst_scales, layout):  # a kernel built wrong in one place
        kernel(packed, scales, dst, dst_scales, layout)
        (dst if sys.argv[1] == "codes" else dst_scales).view(-1)[int(sys.argv[2])] ^= 1

    fragment_pack.pack_fragment_block = one_byte_off
    fragment_pack.agrees_with_twin.cache_clear()
    print(fragment_pack.agrees_with_twin(cpu))
    """
)


@pytest.mark.parametrize(("where", "offset"), [("codes", 0), ("codes", 24575), ("scales", 3071)])
def test_known_answer_check_passes_the_kernel_and_catches_one_wrong_byte(where: str, offset: int) -> None:
    """agrees_with_twin under the interpreter: the kernel agrees; one flipped bit anywhere in its output (first
    and last code byte, last scale byte of the padded 128 x 384 block) does not."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", KNOWN_ANSWER_SCRIPT, where, str(offset)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False"], proc.stdout
