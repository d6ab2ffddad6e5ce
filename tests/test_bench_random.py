"""CPU tests of what issue 58 asked of the bench, and issue 54 of its CPU run: random layers (`--models random:N`,
seeded, in bounds, the same layers for the same seed), T up to 16384 (copies and memory), `meta.tuned_entries`
from the configs that served the rows, the humming-kernels version, the prefill summary against the targets,
`--min-tokens`, the paths registry, and `bench --device cpu` (seconds, a footer that claims no GPU).

Tolerances: none; every check here is exact (shapes drawn, counts, strings), except the one host-clock run, whose
errors are held to the bench's own bound (2e-2: the same dequantized weights, bf16 rounding only).
"""

from __future__ import annotations

import json
from argparse import Namespace

import pytest

import moe_nvfp4.bench.moe as bench
from moe_nvfp4 import shapes
from moe_nvfp4.bench.harness import Ceilings, MoEShape
from moe_nvfp4.bench.layer import config_source, copies_for
from moe_nvfp4.bench.paths import NVFP4_PATHS, PATHS, REGISTRY, Path, build_path, short_error
from moe_nvfp4.bench.report import (
    COLUMNS,
    PREFILL_TARGETS,
    prefill_summary,
    prefill_table,
    summary_lines,
)
from moe_nvfp4.cli import build_parser, main
from moe_nvfp4.sm90 import tuned_configs
from moe_nvfp4.zoo import MODELS, RANDOM_BOUNDS, RANDOM_SEED, ZooShape, random_model, random_models, zoo_shape

H200 = shapes.DeviceTraits("NVIDIA H200", (9, 0), 132, 140)
H200_GIB = 140  # what an H200 offers a process, about
L2 = 50 * 2**20


def _args(*argv: str):
    return bench.finish_args(build_parser().parse_args(["bench", *argv]))


# --------------------------------------------------------------------------------------------------
# random layers
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 7, 12345])
def test_a_seed_draws_the_same_layers_in_bounds(seed):
    b = RANDOM_BOUNDS
    layers = random_models(64, seed)
    assert layers == random_models(64, seed)  # a rerun draws them again
    assert [m.key for m in layers] == [f"random-s{seed}-{i:02d}" for i in range(64)]
    for m in layers:
        assert b.min_experts <= m.experts <= b.max_experts and 1 <= m.top_k <= min(b.max_top_k, m.experts)
        for dim in (m.hidden, m.intermediate):
            assert b.min_dim <= dim <= b.max_dim and dim % b.dim_step == 0
        assert m.activation.name == "silu" and m.activation.gated
        assert m.experts * 3 * m.hidden * m.intermediate <= b.max_params
        assert m.name == f"{m.key} E={m.experts} top-{m.top_k} H={m.hidden} I={m.intermediate}"


def test_the_draw_is_a_sequence_that_keys_index():
    """random:4 is random:16's first four; a row's key names its layer alone (the repro of a row); seeds differ."""
    sixteen = random_models(16)
    assert random_models(4) == sixteen[:4]
    assert all(random_model(m.key) == m for m in sixteen)
    assert [m.key for m in random_models(3, 1)] != [m.key for m in random_models(3, 0)]
    assert [(m.experts, m.hidden) for m in random_models(8, 1)] != [(m.experts, m.hidden) for m in sixteen[:8]]
    # zoo_shape takes a row's key too (tools/ab_moe.py's cases), at TP = EP = 1; a malformed one names itself
    assert all(zoo_shape(m.key) == ZooShape(m) and zoo_shape(m.key).layer.experts == m.experts for m in sixteen)
    with pytest.raises(ValueError, match="random-s0-x"):
        zoo_shape("random-s0-x")


def test_seed_0_draws_the_layers_the_committed_sweep_measured():
    """The layers behind a committed random sweep: a change to the draw must fail here, not silently re-key rows."""
    dims = [(m.experts, m.top_k, m.hidden, m.intermediate) for m in random_models(4, RANDOM_SEED)]
    assert dims == [(268, 8, 3968, 2816), (67, 5, 6656, 3200), (58, 6, 7552, 4608), (25, 8, 5504, 2816)]


def test_the_draw_reaches_the_ends_of_its_bounds():
    layers = random_models(400, 3)
    experts = [m.experts for m in layers]
    assert min(experts) <= 10 and max(experts) >= 300  # log-uniform: small E as often as large
    assert {m.top_k for m in layers} == set(range(1, 11))
    dims = [d for m in layers for d in (m.hidden, m.intermediate)]
    assert min(dims) <= 1152 and max(dims) >= 8064


def test_no_random_layer_is_larger_than_the_zoos_largest_so_every_path_fits_an_h200():
    """The cap is Kimi-K2's layer; at the cap the BF16 copy plus four NVFP4 copies (the quantized experts, ours',
    Marlin's and Humming's) stay well inside an H200, leaving room for T=16384's workspaces."""
    kimi = MoEShape.from_zoo(zoo_shape("kimi-k2"))
    assert (
        RANDOM_BOUNDS.max_params
        == 384 * 3 * 7168 * 2048
        == max(m.experts * 3 * m.hidden * m.intermediate for m in MODELS if m.activation.gated)
    )
    weights = kimi.experts * (kimi.expert_bf16_bytes() + 4 * kimi.expert_nvfp4_bytes())
    assert weights < 0.6 * H200_GIB * 2**30, weights / 2**30
    for m in random_models(64):
        shape = MoEShape.from_zoo(ZooShape(m))
        assert shape.experts * shape.expert_bf16_bytes() <= kimi.experts * kimi.expert_bf16_bytes()


def test_prefill_sizes_rotate_one_weight_copy():
    """At T >= 1024 every expert is touched, far more than 4 x L2: one copy per path, so T=16384 costs no copies."""
    args = Namespace(no_rotate=False, device="cuda", l2_factor=4.0, max_copies=16)
    for key in ("kimi-k2", "mixtral-8x7b", "qwen3-30b-a3b"):
        shape = MoEShape.from_zoo(zoo_shape(key))
        for path in ("ours", "bf16"):
            assert copies_for(shape, [1024, 4096, 16384], path, args, L2) == 1
    tiny = MoEShape("small", experts=8, top_k=1, hidden=1024, intermediate=1024)
    assert copies_for(tiny, [1, 16384], "ours", args, L2) > 1  # decode still rotates
    assert copies_for(tiny, [1], "ours", Namespace(**{**vars(args), "device": "cpu"}), L2) == 1  # no L2 to keep cold


def test_random_models_on_the_command_line():
    args = _args("--models", "zoo-models,random:16", "--tokens", "1024,4096,16384")
    assert list(args.models) == [m.key for m in MODELS] + [f"random-s0-{i:02d}" for i in range(16)]
    assert args.tokens == [1024, 4096, 16384]
    seven = _args("--models", "random:3:7,random-s0-02")
    assert list(seven.models) == ["random-s7-00", "random-s7-01", "random-s7-02", "random-s0-02"]
    r = seven.models["random-s0-02"]
    assert (r.experts, r.top_k, r.hidden, r.intermediate, r.activation) == (58, 6, 7552, 4608, "silu")
    assert bench.repro_command(seven, "random-s0-02", 4096) == "moe-nvfp4 bench --models random-s0-02 --tokens 4096"
    meta = bench.random_meta(seven.models)
    assert meta["seeds"] == [0, 7] and meta["default_seed"] == RANDOM_SEED
    assert meta["bounds"]["max_experts"] == 512 and meta["bounds"]["max_top_k"] == 10
    assert meta["layers"][-1] == dict(key="random-s0-02", experts=58, top_k=6, hidden=7552, inter=4608)
    assert bench.random_meta(_args("--models", "qwen3").models) is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "random:0"], "--models 'random:0': give random:N or random:N:SEED"),
        (["--models", "random:x"], "--models 'random:x': give random:N"),
        (["--models", "random:4:-1"], "SEED >= 0"),
        (["--models", "random:4:1:2"], "--models 'random:4:1:2'"),
        (["--models", "random-s0-x"], "not a random layer's key"),
        (["--min-tokens", "100000"], "--min-tokens 100000: leaves none of the token counts"),
    ],
)
def test_bad_random_specs_and_token_filters_exit_2_with_one_line(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(bench, "run", lambda args: pytest.fail("ran despite bad arguments"))
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-nvfp4 bench: error: ") and err.count("\n") == 1 and message in err, err


def test_min_tokens_keeps_the_prefill_sizes():
    assert _args("--min-tokens", "1024").tokens == [1024, 4096]
    assert _args("--tokens", "16,1024,16384", "--min-tokens", "1024").tokens == [1024, 16384]


# --------------------------------------------------------------------------------------------------
# configs: meta.tuned_entries
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def no_measured_entries(monkeypatch):
    monkeypatch.setattr(tuned_configs, "_MEASURED", {})
    tuned_configs._tuned_entries.cache_clear()
    yield
    tuned_configs._tuned_entries.cache_clear()


def test_a_rows_config_source_follows_the_files_and_the_autotuner(monkeypatch, tmp_path, no_measured_entries):
    """A size a shipped H200 entry serves is `tuned` (past the entries, `default`); with MOE_NVFP4_CONFIG_DIR empty
    it is `default`; entries the autotuner registered make it `autotuned`."""
    qwen3 = shapes.LayerShape(128, 8, 2048, 768)
    assert config_source(qwen3, H200, 1024) == "tuned" and config_source(qwen3, H200, 4096) == "default"
    monkeypatch.setattr(tuned_configs, "CONFIG_DIR", tmp_path)
    tuned_configs._tuned_entries.cache_clear()
    assert config_source(qwen3, H200, 1024) == "default"
    entry = dict(
        experts=128,
        top_k=8,
        hidden=2048,
        intermediate=768,
        dtype="bfloat16",
        max_tokens=4096,
        config=tuned_configs.select_config(4096, qwen3, H200).to_dict(),
    )
    tuned_configs.register_entries(H200, [entry])
    assert config_source(qwen3, H200, 4096) == "autotuned" and config_source(qwen3, H200, 4097) == "default"


@pytest.mark.parametrize(
    "sources, tuned",
    [(["default", "default"], False), (["default", "tuned"], True), (["autotuned"], True), ([], False)],
)
def test_tuned_entries_is_true_iff_an_entry_served_a_row(monkeypatch, sources, tuned):
    """measure() sets meta.tuned_entries from its rows' config sources, and the header says it."""
    rows = [dict(model="m", tokens=1024 * (i + 1), config_source=s) for i, s in enumerate(sources)]
    rows.append(dict(model="m", status="failed: out of memory"))  # no config: not counted
    monkeypatch.setattr(bench, "run_model", lambda *a, **k: rows)
    monkeypatch.setattr(bench, "measure_ceilings", lambda **k: Ceilings(1e9, 1e12, {"bytes": 1 << 26}, {"n": 512}))
    meta, got = bench.measure(_args("--device", "cpu"), log=lambda _: None)
    assert got == rows and meta["tuned_entries"] is tuned
    assert meta["config_sources"] == {s: sources.count(s) for s in set(sources)}
    gpu = dict(meta, device_kind="cuda", device="NVIDIA H200", capability="9.0", l2_policy="rotating")
    line = next(x for x in summary_lines(gpu) if x.startswith("configs:"))
    assert f"(tuned_entries {str(tuned).lower()})" in line, line
    assert ("no tuned entries: every row ran the default config" in line) is not tuned, line


def test_the_humming_kernels_version_comes_from_metadata():
    assert bench.package_version("humming-kernels-that-does-not-exist") == "not installed"
    assert bench.package_version("torch").split("+")[0].count(".") == 2


# --------------------------------------------------------------------------------------------------
# the prefill summary
# --------------------------------------------------------------------------------------------------
def _row(model, t, ours, bf16, humming, compute_floor, mismatched=()):
    return dict(
        model=model,
        tokens=t,
        ours_us=ours,
        compute_floor_us=compute_floor,
        pct_of_compute_floor=100.0 * compute_floor / ours,
        speedup_vs_bf16=bf16 / ours,
        speedup_vs_humming=None if humming is None else humming / ours,
        mismatched=list(mismatched),
    )


def test_the_prefill_summary_reads_the_targets_off_one_table():
    rows = [
        _row("A", 64, 10.0, 100.0, 100.0, 9.0),  # decode: left out
        _row("A", 1024, 100.0, 110.0, 140.0, 80.0),  # 80% floor, 1.10x BF16, 1.40x Humming: every target
        _row("A", 4096, 400.0, 380.0, 480.0, 240.0),  # 60%, 0.95x, 1.20x: none
        _row("B", 1024, 100.0, 150.0, 90.0, 70.0, mismatched=["humming"]),  # Humming wrong: its ratio left out
        _row("B", 16384, 1000.0, 1200.0, None, 900.0),  # no Humming row
        _row("C", 4096, 100.0, 100.0, 100.0, 90.0, mismatched=["ours"]),  # ours wrong: nothing of it counts
        dict(model="D", tokens=4096, status="skipped (time budget)"),
    ]
    s = prefill_summary(rows)
    a, b, every = s["by_model"]["A"], s["by_model"]["B"], s["by_model"]["all"]
    assert a["rows"] == 2 and a["pct_of_compute_floor"] == {"min": 60.0, "median": 70.0}
    assert a["speedup_vs_bf16"]["min"] == pytest.approx(0.95)
    assert a["speedup_vs_humming"]["median"] == pytest.approx(1.3)
    assert b["speedup_vs_humming"] is None and b["speedup_vs_bf16"]["min"] == pytest.approx(1.2)
    assert s["by_model"]["C"]["pct_of_compute_floor"] is None and "D" not in s["by_model"]
    assert every["rows"] == 5 and every["pct_of_compute_floor"]["min"] == 60.0
    assert s["targets"] == {
        "pct_of_compute_floor": {"target": 75.0, "met": 2, "of": 4},
        "speedup_vs_bf16": {"target": 1.0, "met": 3, "of": 4},
        "speedup_vs_humming": {"target": 1.3, "met": 1, "of": 2},
    }
    assert set(s["targets"]) == set(PREFILL_TARGETS)
    table = prefill_table(s)
    assert table[0].startswith("Prefill (T >= 1024")
    assert table[2] == "| model | rows | ours % compute floor | × BF16 | × Humming |"  # no Marlin rows: no column
    assert "| A | 2 | 60 / 70 | 0.95 / 1.02 | 1.20 / 1.30 |" in table, table
    assert "| B | 2 | 70 / 80 | 1.20 / 1.35 | - |" in table, table
    assert "| **all** | 5 |" in "\n".join(table)
    assert table[-1] == (
        "Rows meeting issue 58's targets: ours % compute floor >= 75%: 2 of 4; × BF16 >= 1x: 3 of 4; "
        "× Humming >= 1.3x: 1 of 2."
    )
    assert prefill_summary([r for r in rows if r.get("tokens", 0) < 1024]) == {} and prefill_table({}) == []


# --------------------------------------------------------------------------------------------------
# the paths registry
# --------------------------------------------------------------------------------------------------
def test_a_path_is_one_class_in_the_registry(monkeypatch):
    """Each registered path has its time and speedup columns, an NVFP4 one its error column; a new class in the
    registry is built on the weights it declares."""
    keys = [c[0] for c in COLUMNS]
    for name in PATHS:
        assert f"{name}_us" in keys and (name == "ours" or f"speedup_vs_{name}" in keys)
        assert (f"rel_err_{name}" in keys) == (name in NVFP4_PATHS) == (REGISTRY[name].weights == "nvfp4")

    class Dense(Path):
        name, label, weights = "dense", "dense", "bf16"

        def __init__(self, shape, w13, w2, copies):
            super().__init__(copies)
            self.add_copies((w13, w2))

    monkeypatch.setitem(REGISTRY, "dense", Dense)
    built = build_path("dense", bench.TINY, ("q13", "q2", "bf13", "bf2"), 1)
    assert built.weights == [("bf13", "bf2")]
    with pytest.raises(ValueError, match="unknown path 'cutlass'"):
        build_path("cutlass", bench.TINY, (None,) * 4, 1)


def test_out_of_memory_reads_as_does_not_fit():
    oom = type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate 34.00 GiB")
    expected = "does not fit in GPU memory (OutOfMemoryError: CUDA out of memory. Tried to allocate 34.00 GiB)"
    assert short_error(oom) == expected
    assert short_error(ValueError("bad\nmore")) == "ValueError: bad"


# --------------------------------------------------------------------------------------------------
# the CPU run (issue 54): seconds, and a footer that claims no GPU
# --------------------------------------------------------------------------------------------------
def test_the_cpu_defaults_are_one_tiny_shape_at_three_sizes():
    args = _args("--device", "cpu")
    assert list(args.models) == ["tiny"] and args.tokens == [1, 16, 64] and args.paths == ["ours", "torch"]
    assert (args.rounds, args.replays) == (1, 5)
    assert list(_args("--device", "cpu", "--models", "olmoe").models) == ["olmoe"]  # asked for: run


def test_the_cpu_run_is_quick_and_its_footer_claims_no_gpu(tmp_path, capsys):
    """`moe-nvfp4 bench --device cpu` with its defaults: three rows of the tiny shape, the torch reference for ours,
    and a header with no sm_, no cuBLAS and no CUDA graphs."""
    assert main(["bench", "--device", "cpu", "--out", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "r.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert [(r["model"], r["tokens"]) for r in rows] == [("tiny", 1), ("tiny", 16), ("tiny", 64)]
    assert all(r["status"] == "ok" and r["rel_err_ours_vs_ref"] < 2e-2 for r in rows), rows
    assert meta["device_kind"] == "cpu" and meta["ours_backend"] == "torch" and "capability" not in meta
    assert meta["tuned_entries"] is False and meta["humming_kernels"] and meta["random"] is None
    footer = "\n".join(summary_lines(meta))
    for claim in ("sm_", "cuBLAS", "CUDA graph", "device: None"):
        assert claim not in footer and claim not in out.split("| model |")[0], claim
    assert "device: CPU (" in footer and "the torch reference (moe_nvfp4.reference), no kernel" in footer
    assert "timing: host clock around eager calls" in footer
    assert meta["wall_s"] < 120, meta["wall_s"]  # 14 s on a loaded 2-core CI box; 7 minutes before issue 54


def test_the_gpu_header_names_humming_kernels_and_the_random_layers():
    meta = dict(
        device_kind="cuda",
        device="NVIDIA H200",
        capability="9.0",
        torch="2.11",
        triton="3.6.0",
        vllm="0.26.0",
        humming_kernels="0.1.10",
        command="bench",
        date="today",
        git_commit="abc",
        l2_policy="rotating",
        tuned_entries=False,
        config_sources={"default": 3},
        config_dir="/tmp/empty",
        random=bench.random_meta(_args("--models", "random:16").models),
        ceilings={"copy_GBps": 4000.0, "bf16_TFLOPs": 700.0, "copy": {}, "matmul": {"n": 8192}},
    )
    lines = summary_lines(meta)
    assert lines[0] == ("device: NVIDIA H200 (sm_90), torch 2.11, triton 3.6.0, vllm 0.26.0, humming-kernels 0.1.10")
    assert "(8192^3, cuBLAS)" in lines[1] and lines[3].startswith("timing: CUDA graph replay")
    assert lines[-1] == (
        "random layers: seed 0 (default 0), 16 drawn: E 8-512 (log-uniform), top-k 1-10, H and I "
        "multiples of 128 in 1024-8192, gated SiLU, at most 16.9 G expert parameters (the zoo's "
        "largest layer)"
    )


# --------------------------------------------------------------------------------------------------
# runs taken apart, one report
# --------------------------------------------------------------------------------------------------
def _run_meta(command: str, device: str = "NVIDIA H200", **extra) -> dict:
    return dict(
        device_kind="cuda",
        device=device,
        capability="9.0",
        torch="2.11",
        triton="3.6.0",
        vllm="0.26.0",
        humming_kernels="0.1.10",
        command=command,
        date="today",
        git_commit="abc",
        l2_policy="rotating",
        config_dir="/tmp/empty",
        wall_s=100.0,
        args={"paths": ["ours", "bf16"], "repro_command": "b"},
        ceilings={"copy_GBps": 4000.0, "bf16_TFLOPs": 700.0, "copy": {}, "matmul": {"n": 8192}},
        **extra,
    )


def test_merged_runs_make_one_report(tmp_path, capsys):
    """Two runs (one per GPU, say; one gzipped): one moe.json and moe.md whose configs line and prefill summary count
    every row, with each run's command kept; runs from two devices are refused."""
    import gzip
    import importlib.util
    import os

    from moe_nvfp4.bench.harness import write_json

    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_moe.py")
    spec = importlib.util.spec_from_file_location("bench_moe", script)
    lab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab)
    first = [dict(_row("A", 1024, 100.0, 110.0, 140.0, 80.0), config_source="default", bf16_us=110.0)]
    second = [dict(_row("random-s0-00 E=268", 4096, 400.0, 380.0, 480.0, 240.0), config_source="tuned")]
    random_part = bench.random_meta(_args("--models", "random:1").models)
    write_json(str(tmp_path / "gpu0" / "moe.json"), _run_meta("run 0"), first)
    write_json(str(tmp_path / "gpu1.json"), _run_meta("run 1", random=random_part), second)
    with open(tmp_path / "gpu1.json", "rb") as f, gzip.open(tmp_path / "gpu1.json.gz", "wb") as g:
        g.write(f.read())
    runs = [str(tmp_path / "gpu0"), str(tmp_path / "gpu1.json.gz")]
    assert lab.main(["--merge", *runs, "--out", str(tmp_path / "m")]) == 0
    data = json.loads((tmp_path / "m" / "moe.json").read_text())
    meta = data["meta"]
    assert [r["model"] for r in data["rows"]] == ["A", "random-s0-00 E=268"]
    assert [m["command"] for m in meta["merged_from"]] == ["run 0", "run 1"] and meta["wall_s"] == 200.0
    assert meta["tuned_entries"] is True and meta["config_sources"] == {"default": 1, "tuned": 1}
    assert meta["prefill"]["by_model"]["all"]["rows"] == 2 and meta["random"]["layers"][0]["key"] == "random-s0-00"
    md = (tmp_path / "m" / "moe.md").read_text()
    assert "one of 2 runs merged" in md and "| **all** | 2 |" in md and "tuned entries served 1 of 2 rows" in md, md
    write_json(str(tmp_path / "h100.json"), _run_meta("run 2", device="NVIDIA H100 80GB HBM3"), first)
    with pytest.raises(SystemExit, match="different devices"):
        lab.main(["--merge", str(tmp_path / "gpu0"), str(tmp_path / "h100.json"), "--out", str(tmp_path / "n")])
