"""Autotuning (moe_nvfp4.sm90.autotune) on the CPU: buckets, candidates, the search and its budget, the disk cache (keys,
reuse, damage), what a start reads without tuning (the default since issue 53) and the switch that tunes at load,
with a stand-in for the GPU timing.  The GPU tests are tests/gpu/test_autotune_gpu.py and test_tune_cli_gpu.py.

No tolerances: configs, buckets, cache contents and call counts are exact; time bounds are stated per test.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import moe_nvfp4.sm90.autotune as autotune
import moe_nvfp4.sm90.configs as sm90_configs
import moe_nvfp4.sm90.default_config as default_rule
import moe_nvfp4.sm90.tuned_configs as tuned_configs
from moe_nvfp4.shapes import DeviceTraits, LayerShape
from moe_nvfp4.sm90.autotune import cache_key, neighbours, search, token_buckets, tune_layer
from moe_nvfp4.sm90.configs import MoEKernelConfig
from moe_nvfp4.sm90.tuned_configs import select_config
from moe_nvfp4.zoo import zoo_shape

H100 = DeviceTraits("NVIDIA H100 80GB HBM3", (9, 0), 132, 80)
QWEN3 = LayerShape(128, 8, 2048, 768)
KIMI_EP8 = LayerShape(48, 8, 7168, 2048, global_experts=384)


@pytest.fixture(autouse=True)
def fresh_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Nothing measured in this process; no tuned files (an empty config directory)."""
    monkeypatch.setattr(tuned_configs, "_MEASURED", {})
    monkeypatch.setattr(tuned_configs, "CONFIG_DIR", tmp_path / "no-configs")
    tuned_configs._tuned_entries.cache_clear()
    yield
    tuned_configs._tuned_entries.cache_clear()


def test_buckets_end_at_the_default_bounds_powers_of_four_and_max_tokens() -> None:
    b = token_buckets(8192, QWEN3, H100)
    assert b == sorted(set(b)) and b[0] == 1 and b[-1] == 8192
    bounds = [t for t in default_rule.default_bounds(QWEN3, H100) if t < 8192]
    assert set(bounds) <= set(b)  # the config changes only at a bucket's end
    for p in (4**i for i in range(7)):  # each power of four is a bucket or within MERGE of one
        assert any(k / autotune.MERGE <= p <= k * autotune.MERGE for k in b)
    assert token_buckets(1, QWEN3, H100) == [1] and token_buckets(100, QWEN3, H100)[-1] == 100


def test_buckets_follow_the_entries_where_a_shape_has_them(monkeypatch) -> None:
    cfg = select_config(16, QWEN3, H100)
    tuned_configs.register_entries(
        H100,
        [
            dict(
                experts=128,
                top_k=8,
                hidden=2048,
                intermediate=768,
                dtype="bfloat16",
                max_tokens=t,
                config=cfg.to_dict(),
            )
            for t in (7, 300)
        ],
    )
    assert token_buckets(1024, QWEN3, H100) == [1, 4, 7, 16, 64, 300, 1024]


@pytest.mark.parametrize("key", ["qwen3-30b-a3b", "mixtral-8x7b", "kimi-k2-ep8", "llama-4-maverick", "dbrx-tp8"])
@pytest.mark.parametrize("tokens", [1, 2, 16, 64, 256, 1024, 4096])
def test_neighbours_are_valid_and_one_value_away(key: str, tokens: int) -> None:
    z = zoo_shape(key)
    s = LayerShape(z.experts, z.top_k, z.hidden, z.intermediate, global_experts=z.global_experts)
    cfg = select_config(tokens, s, H100)
    near = neighbours(cfg, tokens, s)
    assert near and len(near) == len(set(near)) and cfg not in near
    for c in near:
        assert s.accepts(c)
        moved = [f.name for f in dataclasses.fields(cfg) if getattr(c, f.name) != getattr(cfg, f.name)]
        # a token tile move may narrow both GEMMs' MMAs with it (with_token_tile); anything else is one field
        assert len(moved) == 1 or moved[0] == "block_m", (moved, c)
    if cfg.block_m >= 16:  # the other kernel family for each GEMM
        assert any(c.gemm1.warp_specialized != cfg.gemm1.warp_specialized for c in near)
        assert any(c.gemm2.warp_specialized != cfg.gemm2.warp_specialized for c in near)
    assert any(c.partials_in_x_dtype != cfg.partials_in_x_dtype for c in near)


def _fake(costs: dict[MoEKernelConfig, float], calls: list, default: float = 100.0):
    def measure(cfg: MoEKernelConfig, tokens: int) -> float | None:
        calls.append((cfg, tokens))
        return costs.get(cfg, default)

    return measure


def test_search_climbs_through_neighbours_and_keeps_the_start_when_nothing_is_faster() -> None:
    start = {t: select_config(t, QWEN3, H100) for t in (1, 64)}
    step1 = neighbours(start[64], 64, QWEN3)[3]
    step2 = neighbours(step1, 64, QWEN3)[-1]
    costs = {start[64]: 100.0, step1: 90.0, step2: 80.0}
    calls: list = []
    out = search([1, 64], start.__getitem__, lambda c, t: neighbours(c, t, QWEN3), _fake(costs, calls), budget_s=60)
    one, sixty_four = out
    assert one.config == start[1] and one.us == one.start_us == 100.0  # every neighbour ties: no move
    assert sixty_four.config == step2 and (sixty_four.start_us, sixty_four.us) == (100.0, 80.0)
    assert calls[:2] == [(start[1], 1), (start[64], 64)]  # each bucket's start first
    assert len(calls) == len(set(calls)) == one.timed + sixty_four.timed  # nothing timed twice


def test_a_gain_under_min_gain_is_noise() -> None:
    start = select_config(64, QWEN3, H100)
    first = neighbours(start, 64, QWEN3)[0]
    costs = {start: 100.0, first: 100.0 * (1 - autotune.MIN_GAIN / 2)}
    out = search([64], lambda t: start, lambda c, t: neighbours(c, t, QWEN3), _fake(costs, []), budget_s=60)
    assert out[0].config == start


def test_failed_candidates_are_skipped_and_a_failed_start_stays() -> None:
    start = select_config(16, QWEN3, H100)
    out = search([16], lambda t: start, lambda c, t: neighbours(c, t, QWEN3), lambda c, t: None, budget_s=60)
    assert out[0].config == start and out[0].us is None and out[0].timed == 1


def test_search_stops_at_its_budget_and_times_every_start_first() -> None:
    clock = [0.0]

    def measure(cfg, tokens):
        clock[0] += 1.0  # one second a timing
        return 100.0

    buckets = token_buckets(8192, QWEN3, H100)
    out = search(
        buckets,
        lambda t: select_config(t, QWEN3, H100),
        lambda c, t: neighbours(c, t, QWEN3),
        measure,
        budget_s=len(buckets) + 5.5,
        clock=lambda: clock[0],
    )
    assert all(r.start_us == 100.0 for r in out)
    assert sum(r.timed for r in out) == len(buckets) + 6  # no timing starts past the budget
    short = search(
        buckets, lambda t: select_config(t, QWEN3, H100), lambda c, t: [], measure, budget_s=2.5, clock=lambda: clock[0]
    )
    assert [r.timed for r in short] == [1, 1, 1] + [0] * (len(buckets) - 3)  # the rest keep their config untimed
    assert all(r.config == r.start for r in short)


def test_cache_keys_change_with_everything_a_choice_depends_on() -> None:
    base = cache_key(QWEN3, H100)
    variants = [
        cache_key(dataclasses.replace(QWEN3, **change), H100)
        for change in (
            dict(experts=64),
            dict(top_k=4),
            dict(hidden=4096),
            dict(intermediate=384),
            dict(dtype="float16"),
            dict(global_experts=256),
        )
    ]
    variants += [
        cache_key(QWEN3, dataclasses.replace(H100, **change))
        for change in (dict(name="NVIDIA H200"), dict(sm_count=114), dict(capability=(9, 1)))
    ]
    paths = {autotune.cache_path(k) for k in [base, *variants]}
    assert len(paths) == len(variants) + 1
    assert {"package", "kernels", "triton", "torch", "config_version"} <= set(base)
    assert autotune.cache_path(base) == autotune.cache_path(cache_key(QWEN3, H100))  # stable


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("MOE_NVFP4_CACHE_DIR", str(tmp_path))
    assert autotune.cache_dir() == tmp_path / "autotune"
    monkeypatch.delenv("MOE_NVFP4_CACHE_DIR")
    assert autotune.cache_dir() == Path.home() / ".cache" / "moe_nvfp4" / "autotune"


@pytest.mark.parametrize(
    "value,on", [(None, False), ("", False), ("0", False), ("off", False), ("1", True), ("True", True), (" on ", True)]
)
def test_the_switch_is_off_unless_asked_for(monkeypatch, value, on) -> None:
    if value is None:
        monkeypatch.delenv(autotune.SWITCH_ENV, raising=False)
    else:
        monkeypatch.setenv(autotune.SWITCH_ENV, value)
    assert autotune.autotune_enabled() is on


def test_a_switch_value_that_means_nothing_is_refused(monkeypatch) -> None:
    monkeypatch.setenv(autotune.SWITCH_ENV, "maybe")
    with pytest.raises(ValueError, match="MOE_NVFP4_AUTOTUNE='maybe': use 1"):
        autotune.autotune_enabled()


def test_a_second_start_reads_the_cache_and_times_nothing(tmp_path, monkeypatch) -> None:
    winner = neighbours(select_config(64, KIMI_EP8, H100), 64, KIMI_EP8)[2]
    calls: list = []
    first = tune_layer(KIMI_EP8, H100, 1024, _fake({winner: 10.0}, calls), budget_s=60, directory=tmp_path)
    assert first.source == "timed" and calls and first.cache_path.exists()
    assert select_config(64, KIMI_EP8, H100) == winner  # registered in this process
    assert "changed" in first.summary() and "T<=64" in first.summary()
    assert tune_layer(KIMI_EP8, H100, 1024, _fake({}, calls), directory=tmp_path).source == "process"

    monkeypatch.setattr(tuned_configs, "_MEASURED", {})  # a new process
    assert select_config(64, KIMI_EP8, H100) != winner
    again: list = []
    second = tune_layer(KIMI_EP8, H100, 1024, _fake({}, again), budget_s=60, directory=tmp_path)
    assert second.source == "cache" and again == [] and select_config(64, KIMI_EP8, H100) == winner
    data = json.loads(first.cache_path.read_text())
    assert data["key"] == cache_key(KIMI_EP8, H100) and data["max_tokens"] == 1024
    assert [e["max_tokens"] for e in data["entries"]] == token_buckets(1024, KIMI_EP8, H100)
    assert all(e["global_experts"] == 384 and e["experts"] == 48 for e in data["entries"])


def test_a_larger_budget_of_tokens_tunes_only_the_buckets_past_the_cache(tmp_path, monkeypatch) -> None:
    tune_layer(QWEN3, H100, 256, _fake({}, []), budget_s=60, directory=tmp_path)
    monkeypatch.setattr(tuned_configs, "_MEASURED", {})
    calls: list = []
    report = tune_layer(QWEN3, H100, 4096, _fake({}, calls), budget_s=60, directory=tmp_path)
    assert report.source == "timed" and {t for _, t in calls} == {
        b for b in token_buckets(4096, QWEN3, H100) if b > 256
    }
    assert [e["max_tokens"] for e in json.loads(report.cache_path.read_text())["entries"]] == token_buckets(
        4096, QWEN3, H100
    )


@pytest.mark.parametrize("damage", ["not json", json.dumps([1, 2]), "key"])
def test_a_damaged_or_foreign_cache_file_is_timed_again(tmp_path, damage: str) -> None:
    key = cache_key(QWEN3, H100)
    path = autotune.cache_path(key, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if damage == "key":  # another key's content under this name (a hash collision, or an edited file)
        damage = json.dumps(dict(key=dict(key, triton="0.0"), max_tokens=99999, entries=[]))
    path.write_text(damage)
    calls: list = []
    assert tune_layer(QWEN3, H100, 64, _fake({}, calls), budget_s=60, directory=tmp_path).source == "timed"
    assert calls and json.loads(path.read_text())["key"] == key


def test_a_cache_entry_with_an_invalid_config_is_timed_again(tmp_path) -> None:
    key = cache_key(QWEN3, H100)
    bad = dataclasses.replace(select_config(64, QWEN3, H100), block_m=8, gemm2=sm90_configs.GemmConfig())
    entry = dict(
        experts=128, top_k=8, hidden=2048, intermediate=768, dtype="bfloat16", max_tokens=64, config=bad.to_dict()
    )
    autotune.write_cache(autotune.cache_path(key, tmp_path), key, 64, [entry], 1.0)
    calls: list = []
    assert tune_layer(QWEN3, H100, 64, _fake({}, calls), budget_s=60, directory=tmp_path).source == "timed"
    assert calls


def test_tuning_is_bounded_in_time(tmp_path) -> None:
    """A real clock and a 20 ms timing: the search starts no timing past its budget (0.5 s), so the whole call
    ends within the budget plus one timing and the cache write (bound: 1.0 s)."""

    def slow(cfg, tokens):
        time.sleep(0.02)
        return 100.0

    began = time.monotonic()
    report = tune_layer(QWEN3, H100, 8192, slow, budget_s=0.5, directory=tmp_path)
    assert time.monotonic() - began < 1.0 and report.seconds < 1.0
    assert 0 < sum(b.timed for b in report.buckets) <= 0.5 / 0.02 + 1


def test_cpu_weights_have_nothing_to_tune() -> None:
    import moe_nvfp4

    q13 = moe_nvfp4.quantize_nvfp4(torch.randn(4, 128, 64), segments=2)
    q2 = moe_nvfp4.quantize_nvfp4(torch.randn(4, 64, 64))
    report = autotune.autotune_fused_moe(moe_nvfp4.prepare_moe_weights(q13, q2), 2, torch.bfloat16, 64)
    assert report.source == "cpu" and report.buckets == [] and "configs from cpu" in report.summary()


def test_a_start_without_a_cache_serves_the_default_and_registers_nothing(tmp_path) -> None:
    report = autotune.cached_configs(QWEN3, H100, 8192, directory=tmp_path)
    assert report.source == "default" and report.cache_path == autotune.cache_path(cache_key(QWEN3, H100), tmp_path)
    assert tuned_configs.measured_entries(QWEN3, H100) == [] and "moe-nvfp4 tune" in report.summary()
    assert select_config(64, QWEN3, H100) == default_rule.default_config(64, 128, 8, 2048, 768, device=H100)


def test_a_start_without_tuning_serves_exactly_what_the_tuner_cached(tmp_path, monkeypatch) -> None:
    """The cache a tune wrote (here up to 1024 tokens) is what cached_configs registers, entry for entry, as the
    autotuner's own second start did; past its 1024 tokens the default still serves, bucket by bucket."""
    winner = neighbours(select_config(64, KIMI_EP8, H100), 64, KIMI_EP8)[2]
    tuned = tune_layer(KIMI_EP8, H100, 1024, _fake({winner: 10.0}, []), budget_s=60, directory=tmp_path)
    monkeypatch.setattr(tuned_configs, "_MEASURED", {})  # a new process
    default = {t: select_config(t, KIMI_EP8, H100) for t in (2000, 4096, 8192)}
    report = autotune.cached_configs(KIMI_EP8, H100, 8192, directory=tmp_path)
    assert report.source == "cache" and report.covered == 1024 and "up to 1024 tokens" in report.summary()
    written = json.loads(tuned.cache_path.read_text())["entries"]
    registered = tuned_configs.measured_entries(KIMI_EP8, H100)
    assert registered[: len(written)] == written and select_config(64, KIMI_EP8, H100) == winner
    assert [e["max_tokens"] for e in registered[len(written) :]] == [
        t for t in token_buckets(8192, KIMI_EP8, H100) if t > 1024
    ]
    assert {t: select_config(t, KIMI_EP8, H100) for t in default} == default
    assert autotune.cached_configs(KIMI_EP8, H100, 8192, directory=tmp_path).source == "process"


def test_a_damaged_cache_leaves_the_default_serving_at_a_start(tmp_path) -> None:
    key = cache_key(QWEN3, H100)
    bad = dataclasses.replace(select_config(64, QWEN3, H100), block_m=8, gemm2=sm90_configs.GemmConfig())
    entry = dict(
        experts=128, top_k=8, hidden=2048, intermediate=768, dtype="bfloat16", max_tokens=64, config=bad.to_dict()
    )
    autotune.write_cache(autotune.cache_path(key, tmp_path), key, 64, [entry], 1.0)
    assert autotune.cached_configs(QWEN3, H100, 64, directory=tmp_path).source == "default"
    assert tuned_configs.measured_entries(QWEN3, H100) == []


def test_force_times_again_what_the_cache_holds(tmp_path, monkeypatch) -> None:
    tune_layer(QWEN3, H100, 64, _fake({}, []), budget_s=60, directory=tmp_path)
    monkeypatch.setattr(tuned_configs, "_MEASURED", {})
    calls: list = []
    report = tune_layer(QWEN3, H100, 64, _fake({}, calls), budget_s=60, directory=tmp_path, force=True)
    assert report.source == "timed" and {t for _, t in calls} == set(token_buckets(64, QWEN3, H100))


@pytest.mark.parametrize("switch", [None, "0", "1"])
def test_load_reads_the_cache_and_tunes_only_when_switched_on(switch, tmp_path, monkeypatch) -> None:
    """What the vLLM plugin runs at load: by default (and with 0) the cache (cached_configs), never a timing; with
    MOE_NVFP4_AUTOTUNE=1 the autotuner, with the scheduler's token budget and the expert map."""
    weights = SimpleNamespace(
        w13_packed=SimpleNamespace(device=torch.device("cuda", 0)),  # where and what shape only
        layer_shape=lambda top_k, dtype, expert_map=None: QWEN3,
    )
    monkeypatch.setattr(autotune, "device_traits", lambda device: H100)
    monkeypatch.setenv("MOE_NVFP4_CACHE_DIR", str(tmp_path))
    if switch is None:
        monkeypatch.delenv(autotune.SWITCH_ENV, raising=False)
    else:
        monkeypatch.setenv(autotune.SWITCH_ENV, switch)
    tuned: list = []
    monkeypatch.setattr(autotune, "autotune_fused_moe", lambda *a, **k: tuned.append((a[1:], k)) or "timed")
    report = autotune.load_configs(weights, 8, "bfloat16", 4096, expert_map=None)
    if switch == "1":
        assert report == "timed" and tuned == [((8, "bfloat16", 4096), {"expert_map": None})]
    else:
        assert tuned == [] and report.source == "default" and report.cache_path.parent == tmp_path / "autotune"


def test_load_on_cpu_weights_chooses_nothing_but_still_refuses_a_bad_switch(monkeypatch) -> None:
    import moe_nvfp4

    q13 = moe_nvfp4.quantize_nvfp4(torch.randn(4, 128, 64), segments=2)
    w = moe_nvfp4.prepare_moe_weights(q13, moe_nvfp4.quantize_nvfp4(torch.randn(4, 64, 64)))
    monkeypatch.delenv(autotune.SWITCH_ENV, raising=False)
    assert autotune.load_configs(w, 2, torch.bfloat16, 64).source == "cpu"
    monkeypatch.setenv(autotune.SWITCH_ENV, "2")
    with pytest.raises(ValueError, match="MOE_NVFP4_AUTOTUNE"):
        autotune.load_configs(w, 2, torch.bfloat16, 64)


def test_the_api_loads_configs_through_the_backend_entry(monkeypatch) -> None:
    """moe_nvfp4.load_moe_configs (what the vLLM plugin calls at load) runs the device's moe_w4a16 backend's
    load_configs entry: the sm_90 one where the triton backend serves (here forced on the CPU, so its report says
    "cpu"), and nothing where the backend has no such entry (the CPU's torch reference)."""
    import moe_nvfp4

    q13 = moe_nvfp4.quantize_nvfp4(torch.randn(4, 128, 64), segments=2)
    w = moe_nvfp4.prepare_moe_weights(q13, moe_nvfp4.quantize_nvfp4(torch.randn(4, 64, 64)))
    monkeypatch.delenv(autotune.SWITCH_ENV, raising=False)
    monkeypatch.delenv("MOE_NVFP4_BACKEND", raising=False)
    assert moe_nvfp4.load_moe_configs(w, 2, torch.bfloat16, 64) is None
    monkeypatch.setenv("MOE_NVFP4_BACKEND", "triton")  # the selection is cached per architecture and override
    report = moe_nvfp4.load_moe_configs(w, 2, torch.bfloat16, 64)
    assert isinstance(report, autotune.AutotuneReport) and report.source == "cpu"
    assert report.shape == w.layer_shape(2, torch.bfloat16)
