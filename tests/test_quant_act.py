"""Activation quantization (moe_nvfp4.quantize_activations): the Triton kernel under the interpreter must give
the reference's bytes exactly, packed values and swizzled scales, padding included; bad inputs fail first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import moe_nvfp4 as m

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))
from helpers_quant import assert_reference_bytes  # noqa: E402

# Runs in a subprocess so TRITON_INTERPRET is set before triton is imported.
SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, moe_nvfp4 as m
    from helpers_quant import compare_with_reference, hard_activations
    rows, k, dtype_name, seed = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    x, gs = hard_activations(rows, k, getattr(torch, dtype_name), seed)
    print(json.dumps(compare_with_reference(x, gs, m.quantize_activations(x, gs))))
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("rows,k", [(37, 48), (130, 272)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_triton_kernel_gives_the_reference_bytes(rows: int, k: int, dtype: str, seed: int) -> None:
    """Odd row counts (130 spans two 128-row scale tiles), K/16 = 3 and 17 (padded to 4 and 20 scale columns,
    a masked K tail), helpers_quant.hard_activations: bytes equal, and the inputs reach all 16 codes."""
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        MOE_NVFP4_BACKEND="triton",
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(rows), str(k), dtype, str(seed % 2**31)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_reference_bytes(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_cpu_path_is_the_reference(gen: torch.Generator) -> None:
    x = torch.randn(9, 64, generator=gen, dtype=torch.float32).to(torch.bfloat16)
    gs = torch.tensor([0.003])
    got = m.quantize_activations(x, gs)
    ref = m.quantize_activations_nvfp4(x, gs.reshape(())).swizzled_scales()
    assert torch.equal(got.packed, ref.packed)
    assert torch.equal(got.block_scale.view(torch.uint8), ref.block_scale.view(torch.uint8))
    assert got.block_scale.shape == (128, 4) and got.scale_layout is m.ScaleLayout.SWIZZLED_128x4
    back = m.dequantize_nvfp4(got)
    assert ((back - x.float()).norm() / x.float().norm()).item() < 0.15  # 4-bit values: a sanity bound


@pytest.mark.parametrize(
    "x,gs,error,match",
    [
        (torch.zeros(4, 40), torch.tensor(1.0), ValueError, "multiple of 16"),
        (torch.zeros(2, 4, 16), torch.tensor(1.0), ValueError, r"\[M, K\]"),
        (torch.zeros(4, 32, dtype=torch.int32), torch.tensor(1.0), TypeError, "bfloat16, float16 or float32"),
        (torch.zeros(4, 32), torch.tensor([1.0, 2.0]), ValueError, "one float32 value"),
        (torch.zeros(4, 32), torch.tensor(1.0, dtype=torch.float64), ValueError, "one float32 value"),
    ],
)
def test_bad_inputs_fail_before_any_kernel(x: torch.Tensor, gs: torch.Tensor, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        m.quantize_activations(x, gs)
