"""GPU tier for triton.launcher.launch (``pytest -m gpu``): the kernel it launches is the one ``kernel[grid](...)``
launches for the same arguments (a specialization of its own per pointer alignment, integer class and constexpr),
a repeat launch skips JITFunction.run, and a launch hook sends every launch back through it.  Outputs are exact
(a copy times an integer)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs

from moe_nvfp4.triton import launcher
from moe_nvfp4.triton.launcher import launch

pytestmark = pytest.mark.gpu


@triton.jit
def _scaled_copy(src, dst, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n) * factor, mask=offs < n)


def _entries() -> int:
    return sum(1 for key in launcher._COMPILED if key[0] == id(_scaled_copy))


def test_launch_runs_triton_kernel_for_each_specialization(monkeypatch: pytest.MonkeyPatch) -> None:
    base = torch.arange(1, 4098, device="cuda", dtype=torch.float32)
    runs = []
    run = type(_scaled_copy).run
    monkeypatch.setattr(type(_scaled_copy), "run", lambda self, *a, **k: runs.append(1) or run(self, *a, **k))
    # (src view, n, factor, BLOCK): 16-byte aligned or not, n a multiple of 16 or not or 1, two constexprs
    cases = [(base[:4096], 4096, 3, 256), (base[1:4097], 4096, 3, 256), (base[:4095], 4095, 5, 256)]
    cases += [(base[:1], 1, 7, 256), (base[:4096], 4096, 3, 512)]
    for src, n, factor, block in cases:
        for _ in range(3):  # the first launch of a specialization through JITFunction.run, the rest past it
            dst = torch.zeros_like(src)
            launch(_scaled_copy, (triton.cdiv(n, block),), src, dst, n, factor, BLOCK=block)
            assert torch.equal(dst, src * factor)
    assert len(runs) == len(cases), "a repeat launch went through JITFunction.run, or a new one did not"
    assert _entries() == len(cases)
    specializations = {key[2] for key in launcher._COMPILED if key[0] == id(_scaled_copy)}
    assert len(specializations) == len(cases)


def test_launch_hook_takes_the_plain_launch() -> None:
    seen = []

    def hook(metadata) -> None:
        seen.append(metadata)

    src = torch.arange(64, device="cuda", dtype=torch.float32)
    dst = torch.zeros_like(src)
    launch(_scaled_copy, (1,), src, dst, 64, 2, BLOCK=64)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(_scaled_copy, (1,), src, dst, 64, 2, BLOCK=64)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(seen) == 1 and torch.equal(dst, src * 2)
