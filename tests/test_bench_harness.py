"""CPU tests of the benchmark harness (moe_nvfp4.bench.harness): bytes/FLOPs declarations, floors, L2 rotation, report
writers; and of benchmarks/bench_moe.py, the lab's user of the package's bench (moe_nvfp4.bench.moe).

No GPU: the timing code itself is exercised only by the host-clock smoke run of bench_moe.py at the end.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
sys.path.insert(0, BENCH)

from moe_nvfp4.bench import harness  # noqa: E402
from moe_nvfp4.bench.harness import (  # noqa: E402
    Ceilings,
    MoEShape,
    floors,
    markdown_table,
    nvfp4_matrix_bytes,
    rotation_copies,
)

MIXTRAL = MoEShape("Mixtral-8x7B", experts=8, top_k=2, hidden=4096, intermediate=14336)
QWEN3 = MoEShape("Qwen3-30B-A3B", experts=128, top_k=8, hidden=2048, intermediate=768)
H200_L2 = 50 * 2**20  # bytes, as torch reports for H100/H200


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_moe", os.path.join(BENCH, "bench_moe.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_scripts_use_the_package_harness_and_bench():
    """benchmarks/harness.py and bench_moe.py hand out the package's objects, not copies of them."""
    import harness as lab_harness

    from moe_nvfp4.bench import moe, paths

    assert set(lab_harness.__all__) == set(harness.__all__)
    for name in harness.__all__:
        assert getattr(lab_harness, name) is getattr(harness, name), name
    bench = _load_bench()
    for name in ("make_weights", "make_inputs", "copies_for", "resolve_models", "columns", "add_ratios"):
        assert getattr(bench, name) is getattr(moe, name), name
    assert bench.build_path is paths.build_path and bench.PATHS == paths.PATHS


# --------------------------------------------------------------------------------------------------
# bytes and FLOPs
# --------------------------------------------------------------------------------------------------
def test_nvfp4_matrix_bytes_counts_packed_scales_and_global():
    # [N=32, K=64]: 32*64/2 packed + 32*64/16 e4m3 scales + one fp32 global
    assert nvfp4_matrix_bytes(32, 64) == 1024 + 128 + 4
    assert nvfp4_matrix_bytes(32, 64, global_scales=2) == 1024 + 128 + 8
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4_matrix_bytes(32, 40)


def test_expert_bytes_mixtral_and_qwen3():
    # w13 [2I, H] and w2 [H, I]: 3*I*H values at 4.5 bits (4 + 8/16) plus two global scales
    for shape in (MIXTRAL, QWEN3):
        values = 3 * shape.intermediate * shape.hidden
        assert shape.expert_nvfp4_bytes() == values // 2 + values // 16 + 8
        assert shape.expert_bf16_bytes() == 2 * values
    assert MIXTRAL.expert_nvfp4_bytes() == 99_090_440  # ~99 MB per Mixtral expert
    assert QWEN3.expert_nvfp4_bytes() == 2_654_216  # ~2.65 MB per Qwen3 expert


def test_a_non_gated_layer_counts_one_w13_matrix_and_runs_relu2():
    """Nemotron-3-Nano from the zoo: relu2 experts, w13 [I, H], so 2 I H values an expert (not 3 I H); ours and the
    torch loop run it on the CPU (the torch reference, and moe_dense_torch with relu2) and agree."""
    import torch

    from moe_nvfp4.bench.moe import make_inputs, make_weights
    from moe_nvfp4.bench.paths import build_path
    from moe_nvfp4.zoo import zoo_shape

    nano = MoEShape.from_zoo(zoo_shape("nemotron-3-nano"))
    assert (nano.activation, nano.w13_rows, nano.experts, nano.top_k) == ("relu2", 1856, 128, 6)
    values = 2 * 1856 * 2688
    assert nano.expert_nvfp4_bytes() == values // 2 + values // 16 + 8 and nano.expert_bf16_bytes() == 2 * values
    assert nano.flops(3) == 2 * 3 * 6 * values
    tiny = MoEShape("tiny relu2", experts=5, top_k=3, hidden=64, intermediate=48, activation="relu2")
    weights = make_weights(tiny, 0, "cpu")
    assert weights[0].packed.shape == (5, 48, 32)  # [E, I, H/2]
    x, tw, ti, emap = make_inputs(tiny, 7, 0, "cpu")
    ours, loop = (build_path(name, tiny, weights, 1).fn(0, x, tw, ti, emap)().float() for name in ("ours", "torch"))
    assert loop.norm() > 0 and ((ours - loop).norm() / loop.norm()).item() < 2e-2  # bf16 rounding only


def test_moe_flops():
    # 2 * T * k * (2I*H + H*I)
    assert MIXTRAL.flops(1) == 2 * 1 * 2 * 3 * 14336 * 4096
    assert QWEN3.flops(4096) == 2 * 4096 * 8 * 3 * 768 * 2048
    assert MIXTRAL.flops(0) == 0


def test_hbm_bytes_touched_experts_and_activations():
    t, touched = 16, 5
    weights = touched * QWEN3.expert_nvfp4_bytes()
    acts = 2 * t * QWEN3.hidden * 2  # x read + out written, bf16
    assert QWEN3.hbm_bytes(t, touched, include_activations=False) == weights
    assert QWEN3.hbm_bytes(t, touched) == weights + acts
    assert QWEN3.hbm_bytes(t, 0, include_activations=False) == 0
    with pytest.raises(ValueError, match="touched_experts"):
        QWEN3.hbm_bytes(t, 129)
    assert QWEN3.max_touched(1) == 8 and QWEN3.max_touched(1024) == 128
    assert MIXTRAL.max_touched(1) == 2 and MIXTRAL.max_touched(4) == 8


# --------------------------------------------------------------------------------------------------
# floors
# --------------------------------------------------------------------------------------------------
def test_floors_take_the_larger_bound():
    ceil = Ceilings(copy_bytes_per_s=4e12, bf16_flops_per_s=800e12)
    f = floors(bytes_moved=8e6, flops=1.6e9, ceilings=ceil)  # 2 us HBM, 2 us compute
    assert f["hbm_floor_us"] == pytest.approx(2.0)
    assert f["compute_floor_us"] == pytest.approx(2.0)
    f = floors(bytes_moved=40e6, flops=1.6e9, ceilings=ceil)
    assert f["floor_us"] == pytest.approx(10.0) and f["bound"] == "hbm"
    f = floors(bytes_moved=4e6, flops=16e9, ceilings=ceil)
    assert f["floor_us"] == pytest.approx(20.0) and f["bound"] == "compute"


def test_mixtral_decode_is_hbm_bound_and_prefill_compute_bound():
    ceil = Ceilings(copy_bytes_per_s=4.0e12, bf16_flops_per_s=750e12)
    small = floors(MIXTRAL.hbm_bytes(1, 2), MIXTRAL.flops(1), ceil)
    assert small["bound"] == "hbm"
    assert small["floor_us"] == pytest.approx(2 * 99_090_440 / 4.0e12 * 1e6 + 2 * 4096 * 2 / 4.0e12 * 1e6)
    big = floors(MIXTRAL.hbm_bytes(4096, 8), MIXTRAL.flops(4096), ceil)
    assert big["bound"] == "compute"


def test_pct_of_floor_and_ratio_handle_missing():
    assert harness.pct_of_floor(5.0, 10.0) == pytest.approx(50.0)
    assert harness.pct_of_floor(None, 10.0) is None
    assert harness.pct_of_floor(5.0, None) is None
    assert harness.pct_of_floor(5.0, 0.0) is None
    assert harness.ratio(30.0, 10.0) == pytest.approx(3.0)
    assert harness.ratio(None, 10.0) is None and harness.ratio(3.0, None) is None


def test_rotation_copies():
    # Qwen3 decode: 8 experts * 2.65 MB ~ 21 MB per call -> 10 copies stream 4 x 50 MiB between reuses
    assert rotation_copies(8 * QWEN3.expert_nvfp4_bytes(), H200_L2) == 10
    # Mixtral decode: 2 experts ~ 198 MB >= 4 x 50 MiB? not quite -> 2 copies
    assert rotation_copies(2 * MIXTRAL.expert_nvfp4_bytes(), H200_L2) == 2
    assert rotation_copies(8 * MIXTRAL.expert_nvfp4_bytes(), H200_L2) == 1
    assert rotation_copies(1, H200_L2, max_copies=16) == 16
    assert rotation_copies(0, H200_L2) == 1
    assert rotation_copies(10 * 2**20, H200_L2, factor=1.0) == 5


# --------------------------------------------------------------------------------------------------
# writers
# --------------------------------------------------------------------------------------------------
COLS = [("model", "model", ""), ("tokens", "T", "d"), ("ours_us", "ours µs", ".1f"), ("status", "status", "")]


def test_markdown_table_formats_and_escapes():
    rows = [
        {"model": "Qwen3", "tokens": 16, "ours_us": 12.345, "status": "ok"},
        {"model": "Mixtral", "tokens": 1, "ours_us": None, "status": "a|b"},
        {"model": "x", "tokens": 2, "ours_us": float("nan")},
    ]
    lines = markdown_table(rows, COLS).splitlines()
    assert lines[0] == "| model | T | ours µs | status |"
    assert lines[1] == "|---|---:|---:|---|"
    assert lines[2] == "| Qwen3 | 16 | 12.3 | ok |"
    assert lines[3] == "| Mixtral | 1 | - | a\\|b |"
    assert lines[4] == "| x | 2 | - | - |"
    assert len(lines) == 5


def test_write_json_is_strict_and_round_trips(tmp_path):
    path = tmp_path / "sub" / "r.json"
    meta = {"device": "NVIDIA H200", "copy_GBps": 4100.5}
    rows = [{"model": "m", "tokens": 1, "ours_us": float("nan"), "x": [1.0, float("inf")], "d": {"a": float("-inf")}}]
    harness.write_json(str(path), meta, rows)
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    data = json.loads(text)
    assert data["meta"] == meta
    assert data["rows"][0] == {"model": "m", "tokens": 1, "ours_us": None, "x": [1.0, None], "d": {"a": None}}


def test_write_markdown(tmp_path):
    path = tmp_path / "r.md"
    harness.write_markdown(str(path), "Title", ["device: X"], "| a |\n|---|\n| 1 |", ["note"])
    text = path.read_text()
    assert text.startswith("# Title\n\n- device: X\n\n| a |")
    assert text.rstrip().endswith("note")


def test_environment_has_versions_and_command():
    env = harness.environment()
    for key in ("date", "command", "python", "torch", "triton", "git_commit"):
        assert key in env


def test_timing_dataclass_median():
    t = harness._timing([0.010, 0.030, 0.020], "graph", calls=7, rotation=2)
    assert t.median_us == pytest.approx(20.0) and t.min_us == pytest.approx(10.0) and t.max_us == pytest.approx(30.0)
    assert t.as_dict()["method"] == "graph" and t.samples == 3


def test_time_eager_on_host_clock():
    calls = []
    t = harness.time_eager([lambda: calls.append(0), lambda: calls.append(1)], iters=6, warmup=2)
    assert t.method == "eager" and t.rotation == 2 and t.samples == 6
    assert calls.count(0) == calls.count(1) == 4  # warm-up covers every copy, then strict rotation


# --------------------------------------------------------------------------------------------------
# the script
# --------------------------------------------------------------------------------------------------
def test_bench_moe_help():
    out = subprocess.run(
        [sys.executable, os.path.join(BENCH, "bench_moe.py"), "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--out", "--models", "--tokens", "--quick", "--paths"):
        assert flag in out.stdout


def test_bench_moe_args():
    bench = _load_bench()
    args = bench.parse_args([])
    assert list(args.models) == ["mixtral-8x7b", "qwen3-30b-a3b"] and args.tokens == [1, 4, 16, 64, 256, 1024, 4096]
    assert args.paths == ["ours", "marlin", "humming", "bf16"] and not args.autotune
    quick = bench.parse_args(["--quick", "--models", "qwen3"])
    assert quick.tokens == list(bench.QUICK_TOKENS) and quick.replays < args.replays
    assert args.rounds == 3 and quick.rounds == 1 and bench.parse_args(["--rounds", "5"]).rounds == 5
    assert bench.parse_args(["--tokens", "4,8"]).tokens == [4, 8]
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "llama"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--paths", "cutlass"])
    assert bench.parse_args(["--paths", "ours,Humming"]).paths == ["ours", "humming"]
    dims = lambda s: (s.experts, s.top_k, s.hidden, s.intermediate, s.renormalize, s.global_experts)  # noqa: E731
    assert dims(args.models["mixtral-8x7b"]) == dims(MIXTRAL) == (8, 2, 4096, 14336, True, 8)
    assert dims(args.models["qwen3-30b-a3b"]) == dims(QWEN3) == (128, 8, 2048, 768, True, 128)


def test_bench_moe_takes_the_zoo():
    """--models zoo runs every zoo shape, zoo-models each model at TP=1, and a per-rank key that shape: its local
    experts, intermediate slice and the routing's expert count."""
    from moe_nvfp4.zoo import MODELS, zoo_shapes

    bench = _load_bench()
    assert list(bench.parse_args(["--models", "zoo"]).models) == [s.key for s in zoo_shapes()]
    assert list(bench.parse_args(["--models", "zoo-models"]).models) == [m.key for m in MODELS]
    ep8 = bench.parse_args(["--models", "kimi-k2-ep8,glm-4.5-tp4"]).models
    assert (ep8["kimi-k2-ep8"].experts, ep8["kimi-k2-ep8"].global_experts, ep8["kimi-k2-ep8"].intermediate) == (
        48,
        384,
        2048,
    )
    assert (ep8["glm-4.5-tp4"].experts, ep8["glm-4.5-tp4"].global_experts, ep8["glm-4.5-tp4"].intermediate) == (
        160,
        160,
        384,
    )


def test_bench_moe_expert_parallel_inputs_map_the_first_experts_to_this_rank():
    bench = _load_bench()
    shape = bench.resolve_models("qwen3-235b-a22b-ep8")["qwen3-235b-a22b-ep8"]
    x, tw, ids, emap = bench.make_inputs(shape, 64, 0, "cpu")
    assert emap.tolist() == list(range(16)) + [-1] * 112 and ids.max() >= 16  # routed over all 128
    assert bench.make_inputs(QWEN3, 4, 0, "cpu")[3] is None
    assert shape.flops(64) == 2 * 64 * 8 * 16 // 128 * 3 * 4096 * 1536  # the local pairs' share


def test_model_summaries_give_min_and_median_per_model():
    bench = _load_bench()
    rows = [
        dict(model="A", config_source="default", speedup_vs_marlin=s, pct_of_floor=p)
        for s, p in ((1.0, 50.0), (2.0, 70.0), (3.0, 90.0))
    ] + [dict(model="B", status="failed")]
    a, b = bench.model_summaries(rows)
    assert a == "A (default): x Marlin min 1.00 median 2.00; % floor min 50.00 median 70.00"
    assert b == "B (no config): no timed rows"


def test_columns_follow_the_paths_run():
    bench = _load_bench()
    keys = lambda paths: [c[0] for c in bench.columns(paths)]  # noqa: E731
    humming = ["humming_us", "humming_pct_of_floor", "speedup_vs_humming", "rel_err_humming"]
    assert keys(list(bench.PATHS)) == [c[0] for c in bench.COLUMNS]
    assert set(humming) <= set(keys(list(bench.PATHS)))
    without = keys(["ours", "marlin", "bf16"])
    assert not set(humming) & set(without) and "torch_us" not in without
    assert "marlin_us" in without and "speedup_vs_marlin" in without and "rel_err_marlin" in without
    others = ("marlin", "bf16", "torch", "batched", "w4a8")
    assert keys(["ours", "humming"]) == [k for k in keys(list(bench.PATHS)) if not any(p in k for p in others)]
    assert "torch_us" in keys(["ours", "torch"]) and "speedup_vs_torch" in keys(["ours", "torch"])


def test_add_ratios_for_every_baseline():
    bench = _load_bench()
    row = {"floor_us": 10.0, "ours_us": 5.0, "marlin_us": 10.0, "humming_us": 20.0, "torch_us": 500.0}
    bench.add_ratios(row)
    assert row["pct_of_floor"] == pytest.approx(200.0) and row["speedup_vs_torch"] == pytest.approx(100.0)
    assert row["marlin_pct_of_floor"] == pytest.approx(100.0) and row["humming_pct_of_floor"] == pytest.approx(50.0)
    assert row["speedup_vs_marlin"] == pytest.approx(2.0) and row["speedup_vs_humming"] == pytest.approx(4.0)
    assert row["bf16_pct_of_floor"] is None and row["speedup_vs_bf16"] is None  # not run
    row = {"floor_us": 10.0, "humming_us": 20.0}  # ours failed: no speedups, the baselines keep their % floor
    bench.add_ratios(row)
    assert row["pct_of_floor"] is None and row["speedup_vs_humming"] is None
    assert row["humming_pct_of_floor"] == pytest.approx(50.0)


def test_clone_tensors_gives_new_storage():
    import dataclasses

    import torch

    bench = _load_bench()

    @dataclasses.dataclass(frozen=True)
    class W:
        a: torch.Tensor
        n: int

    w = W(torch.arange(4), 3)
    c = bench.clone_tensors(w)
    assert c.n == 3 and torch.equal(c.a, w.a) and c.a.data_ptr() != w.a.data_ptr()
    t = bench.clone_tensors((w.a, w.a))
    assert all(x.data_ptr() != w.a.data_ptr() for x in t)
    m = torch.nn.Module()  # a layer as vLLM's Humming conversion leaves it: parameters, a buffer, metadata
    m.weight = torch.nn.Parameter(torch.arange(4.0), requires_grad=False)
    m.register_buffer("locks", torch.zeros(2, dtype=torch.int32))
    m.metas = {"w13": object()}
    c = bench.clone_tensors(m)
    assert torch.equal(c.weight, m.weight) and c.weight.data_ptr() != m.weight.data_ptr()
    assert isinstance(c.weight, torch.nn.Parameter) and not c.weight.requires_grad
    assert c.locks.data_ptr() != m.locks.data_ptr() and c.metas is m.metas
    assert dict(m.named_parameters())["weight"] is m.weight  # the original keeps its own


def test_plot_rows(tmp_path):
    pytest.importorskip("matplotlib")
    import plot

    rows = [
        {"model": m, "tokens": t, "ours_us": 10.0 * t, "floor_us": 5.0 * t, "hbm_floor_us": 4.0 * t}
        for m in ("A", "B")
        for t in (1, 16, 256)
    ]
    rows.append({"model": "A", "status": "failed"})
    rows.append({"model": "C", "tokens": 1024, "status": "skipped (time budget)"})  # no timing: no panel
    assert plot.plotted_models(rows) == ["A", "B"]
    path = plot.plot_rows(rows, str(tmp_path / "p.png"))
    assert os.path.getsize(path) > 1000


@pytest.mark.slow
def test_bench_moe_cpu_smoke(tmp_path):
    """The whole script on a tiny shape with the host clock: rows, JSON and Markdown come out even when the
    vLLM paths cannot run here (each path fails on its own and the run goes on)."""
    cmd = [
        sys.executable,
        os.path.join(BENCH, "bench_moe.py"),
        "--device",
        "cpu",
        "--models",
        "tiny",
        "--tokens",
        "1,8",
        "--replays",
        "2",
        "--rounds",
        "2",
        "--out",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((tmp_path / "moe.json").read_text())
    assert [r["tokens"] for r in data["rows"]] == [1, 8]
    for r in data["rows"]:
        assert r["flops"] == 2 * r["tokens"] * 2 * 3 * 64 * 128
        assert math.isclose(r["floor_us"], max(r["hbm_floor_us"], r["compute_floor_us"]))
        rounds = r["ours_timing"]["rounds_us"]  # the paths in turn; the row takes the median round (of two, the slower)
        assert len(rounds) == 2 and r["ours_us"] == r["ours_timing"]["median_us"] == max(rounds)
    assert data["meta"]["rounds"] == 2
    assert (tmp_path / "moe.md").read_text().startswith("# NVFP4 MoE forward")
    assert "| model |" in out.stdout


def test_every_shape_type_is_one_layer_shape() -> None:
    """One shape type (issue 56): a zoo entry, the bench's case and a tune run's shape each hold the
    shapes.LayerShape of the layer they name, with the same field names, so the three never disagree on a rank's
    experts, routing or intermediate slice."""
    from moe_nvfp4.shapes import LayerShape
    from moe_nvfp4.tune_cli import TuneShape, per_rank
    from moe_nvfp4.zoo import zoo_shape, zoo_shapes

    for z in zoo_shapes():
        case = MoEShape.from_zoo(z)
        assert isinstance(z.layer, LayerShape) and case.layer == z.layer, z.key
        assert (case.experts, case.global_experts, case.intermediate) == (z.experts, z.global_experts, z.intermediate)
    kimi = zoo_shape("kimi-k2")
    tune = TuneShape("kimi", kimi.experts, kimi.top_k, kimi.hidden, kimi.intermediate)
    assert per_rank(tune, ep=8).layer == zoo_shape("kimi-k2-ep8").layer
    assert per_rank(tune, tp=4).layer == zoo_shape("kimi-k2-tp4").layer
    nano = MoEShape.from_zoo(zoo_shape("nemotron-3-nano")).layer
    assert not nano.gated and nano.global_experts == nano.experts == 128
