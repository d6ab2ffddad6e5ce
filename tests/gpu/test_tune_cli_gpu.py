"""GPU tier for ``moe-nvfp4 tune`` (run with ``pytest -m gpu`` on the GPU machine): the command itself, in a
subprocess as a user runs it, on one small shape with a small budget; its cache file must hold valid entries for
this GPU's key, and a new process (this one) must serve exactly them through the load step the vLLM plugin runs
(``autotune.cached_configs``), with outputs that match the reference.

Tolerance (REL_TOL), ||out - ref|| / ||ref|| against the float64 reference on the same NVFP4 weights: the weights
decode exactly, so what remains is the rounding of x, of the SiLU*up intermediate and of the output to bf16.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_nvfp4 as m
import moe_nvfp4.sm90.tuned_configs as tuned_configs
from moe_nvfp4.shapes import LayerShape, device_traits
from moe_nvfp4.sm90.autotune import cache_key, cache_path, cached_configs, token_buckets
from moe_nvfp4.sm90.configs import MoEKernelConfig
from moe_nvfp4.sm90.tuned_configs import select_config

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
REL_TOL = 1e-2
EXPERTS, TOP_K, HIDDEN, INTER, MAX_TOKENS = 16, 4, 512, 256, 256
BUDGET_S = 15.0


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def test_tune_command_fills_the_cache_a_start_serves(tmp_path, monkeypatch) -> None:
    env = dict(os.environ, MOE_NVFP4_CACHE_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    argv = [
        sys.executable,
        "-m",
        "moe_nvfp4.cli",
        "tune",
        "--shape",
        f"{EXPERTS},{TOP_K},{HIDDEN},{INTER}",
        "--max-tokens",
        str(MAX_TOKENS),
        "--budget-s",
        str(BUDGET_S),
    ]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr[-2000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "timings over" in proc.stdout and " of 15 s" in proc.stderr  # the summary and the progress bar

    shape = LayerShape(EXPERTS, TOP_K, HIDDEN, INTER)
    traits = device_traits(torch.device("cuda"))
    path = cache_path(cache_key(shape, traits), tmp_path / "autotune")
    data = json.loads(path.read_text())
    assert data["key"] == cache_key(shape, traits) and data["max_tokens"] == MAX_TOKENS
    assert [e["max_tokens"] for e in data["entries"]] == token_buckets(MAX_TOKENS, shape, traits)
    chosen = [MoEKernelConfig.from_dict(e["config"]) for e in data["entries"]]
    assert all(shape.accepts(c) for c in chosen)
    assert any(e["time_us"] is not None for e in data["entries"])  # it timed within its budget

    monkeypatch.setattr(tuned_configs, "_MEASURED", {})  # the start of a server: nothing chosen in this process yet
    monkeypatch.setenv("MOE_NVFP4_CACHE_DIR", str(tmp_path))
    report = cached_configs(shape, traits, MAX_TOKENS)
    assert report.source == "cache" and report.cache_path == path and report.seconds < 1.0
    assert [select_config(e["max_tokens"], shape, traits) for e in data["entries"]] == chosen

    seed = secrets.randbelow(2**31)
    print(f"seed {seed}")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q13 = m.quantize_nvfp4(
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda") / HIDDEN**0.5, segments=2
    )
    q2 = m.quantize_nvfp4(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device="cuda") / INTER**0.5)
    w = m.prepare_moe_weights(q13, q2)
    for tokens in (1, 5, 40, 100, MAX_TOKENS):
        x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").bfloat16()
        tw, ti = m.topk_softmax(torch.randn(tokens, EXPERTS, generator=gen, device="cuda"), TOP_K, renormalize=True)
        ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
        assert _rel(m.fused_moe(x, w, tw, ti), ref) < REL_TOL, tokens
