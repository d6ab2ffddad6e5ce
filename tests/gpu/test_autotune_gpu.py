"""GPU tier for the default config model and autotuning at load (run with ``pytest -m gpu`` on the GPU machine).

Tolerance (REL_TOL), ||out - ref|| / ||ref|| against the float64 reference on the same NVFP4 weights: the weights
decode exactly, so what remains is the rounding of x, of the SiLU*up intermediate and of the output to bf16.
"""

from __future__ import annotations

import secrets

import pytest
import torch

import moe_nvfp4 as m
import moe_nvfp4.sm90.tuned_configs as tuned_configs
from moe_nvfp4.shapes import LayerShape, device_traits
from moe_nvfp4.sm90.autotune import autotune_fused_moe
from moe_nvfp4.sm90.host import fused_moe_sm90
from moe_nvfp4.sm90.tuned_configs import configs_up_to, select_config
from moe_nvfp4.zoo import zoo_shape

pytestmark = pytest.mark.gpu

REL_TOL = 1e-2


@pytest.fixture
def gen() -> torch.Generator:
    seed = secrets.randbelow(2**31)
    print(f"seed {seed}")
    return torch.Generator(device="cuda").manual_seed(seed)


@pytest.fixture
def fresh_process(monkeypatch: pytest.MonkeyPatch):
    """Nothing measured in this process yet."""
    monkeypatch.setattr(tuned_configs, "_MEASURED", {})


def _layer(experts: int, hidden: int, inter: int, gen: torch.Generator):
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda") / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen, device="cuda") / inter**0.5
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.5, -1, -1.5, -2, -3, -4, -6, 6], device="cuda") / 6
    w13[..., :16] = grid * w13.abs().amax(-1, keepdim=True)  # the full FP4 code range in every row
    return m.quantize_nvfp4(w13, segments=2), m.quantize_nvfp4(w2)


def _inputs(tokens: int, hidden: int, experts: int, top_k: int, gen: torch.Generator):
    x = torch.randn(tokens, hidden, generator=gen, device="cuda").bfloat16()
    return (x, *m.topk_softmax(torch.randn(tokens, experts, generator=gen, device="cuda"), top_k, renormalize=True))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize(
    "key", ["qwen3-235b-a22b-tp8", "gpt-oss-120b", "llama-4-maverick", "qwen3-next-80b-a3b", "kimi-k2-ep8"]
)
def test_every_default_config_of_a_zoo_shape_matches_the_reference(
    key: str, gen: torch.Generator, fresh_process, monkeypatch, tmp_path
) -> None:
    """Each config the default model picks for the shape up to 4096 tokens (configs_up_to, as the warm-up compiles
    them), run at the fewest tokens that pick it and at 4x that, on a layer of the shape's H, I and top-k with
    fewer experts (the launch parameters are what is under test, and they do not depend on E), outputs poisoned."""
    monkeypatch.setattr(tuned_configs, "CONFIG_DIR", tmp_path)  # no tuned files: the default
    tuned_configs._tuned_entries.cache_clear()
    z = zoo_shape(key)
    shape = LayerShape(z.experts, z.top_k, z.hidden, z.intermediate, "bfloat16", z.global_experts)
    experts = min(z.experts, 4 * z.top_k)
    q13, q2 = _layer(experts, z.hidden, z.intermediate, gen)
    w = m.prepare_moe_weights(q13, q2)
    for cfg, first in configs_up_to(4096, shape, device_traits(torch.device("cuda"))).items():
        for tokens in (first, min(4 * first, 4096)):
            x, tw, ti = _inputs(tokens, z.hidden, experts, z.top_k, gen)
            out = torch.full_like(x, float("nan"))
            fused_moe_sm90(x, w, tw, ti, None, cfg, out=out)
            ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
            assert not out.isnan().any() and _rel(out, ref) < REL_TOL, (tokens, cfg)
    tuned_configs._tuned_entries.cache_clear()


def test_autotune_chooses_valid_configs_that_match_the_reference_and_a_second_start_reads_the_cache(
    gen: torch.Generator, fresh_process, monkeypatch, tmp_path
) -> None:
    """A layer of Qwen3-30B-A3B's H and I with 32 experts (no tuned entry): the search stays inside its budget
    (20 s, plus at most one compile and timing past it), every bucket's config is valid and fused_moe then runs
    them correctly; a second process (nothing measured) reads the cache and times nothing."""
    experts, top_k, hidden, inter = 32, 4, 2048, 768
    q13, q2 = _layer(experts, hidden, inter, gen)
    w = m.prepare_moe_weights(q13, q2)
    report = autotune_fused_moe(w, top_k, torch.bfloat16, 256, budget_s=20.0, directory=tmp_path)
    print(report.summary())
    assert report.source == "timed" and report.cache_path.exists() and report.seconds < 20.0 + 15.0
    shape = w.layer_shape(top_k, torch.bfloat16)
    assert [b.tokens for b in report.buckets][-1] == 256 and all(shape.accepts(b.config) for b in report.buckets)
    assert all(b.start_us is not None for b in report.buckets)  # every bucket's own time, at least
    traits = device_traits(torch.device("cuda"))
    for b in report.buckets:
        assert select_config(b.tokens, shape, traits) == b.config
    for tokens in (1, 3, 17, 100, 256):
        x, tw, ti = _inputs(tokens, hidden, experts, top_k, gen)
        ref = m.fused_moe_torch(x, q13, q2, tw, ti, compute_dtype=torch.float64)
        assert _rel(m.fused_moe(x, w, tw, ti), ref) < REL_TOL, tokens

    monkeypatch.setattr(tuned_configs, "_MEASURED", {})  # a new process
    again = autotune_fused_moe(w, top_k, torch.bfloat16, 256, budget_s=20.0, directory=tmp_path)
    assert again.source == "cache" and again.seconds < 1.0
    assert [select_config(b.tokens, shape, traits) for b in report.buckets] == [b.config for b in report.buckets]
