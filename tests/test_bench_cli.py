"""`moe-nvfp4 bench` on the CPU: its arguments (zoo keys, --shape, tokens, paths, --out), its refusals (one line,
exit 2), the device check (a GPU absent; present via mocks), that the package module imports no vLLM, and a
host-clock run writing today's JSON and Markdown forms."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from helpers_device import fake_gpu

import moe_nvfp4.bench.moe as bench
from moe_nvfp4.bench.moe import finish_args, parse_shape
from moe_nvfp4.cli import build_parser, main
from moe_nvfp4.zoo import zoo_shape


def _args(*argv: str):
    return finish_args(build_parser().parse_args(["bench", *argv]))


def _dims(shape) -> tuple[int, int, int, int, int]:
    return shape.experts, shape.top_k, shape.hidden, shape.intermediate, shape.global_experts


def test_defaults_are_qwen3_the_full_token_sweep_and_the_available_paths(monkeypatch):
    monkeypatch.setattr(bench, "available_paths", lambda device: ["ours", "torch"])
    args = _args()
    assert list(args.models) == ["qwen3-30b-a3b"] and _dims(args.models["qwen3-30b-a3b"]) == (128, 8, 2048, 768, 128)
    assert args.tokens == list(bench.TOKENS) and args.paths == ["ours", "torch"]
    assert args.out is None and args.device == "cuda" and args.repro_command == "moe-nvfp4 bench"
    assert (args.replays, args.rounds) == (10, 3)
    quick = _args("--quick")
    assert quick.tokens == list(bench.QUICK_TOKENS) and (quick.replays, quick.rounds) == (5, 1)


def test_models_shapes_tokens_and_paths():
    args = _args(
        "--model", "kimi-k2-ep8,mixtral", "--shape", "60,4,1040,336", "--tokens", "1,16", "--paths", "ours,BF16,ours"
    )
    assert list(args.models) == ["kimi-k2-ep8", "mixtral-8x7b", "60,4,1040,336"]
    ep8 = zoo_shape("kimi-k2-ep8")
    assert _dims(args.models["kimi-k2-ep8"]) == (ep8.experts, 8, 7168, 2048, 384)
    assert _dims(args.models["60,4,1040,336"]) == (60, 4, 1040, 336, 60)
    assert args.tokens == [1, 16] and args.paths == ["ours", "bf16"]
    only_shape = _args("--shape", "8,2,128,64")
    assert list(only_shape.models) == ["8,2,128,64"]  # a shape alone: no default model beside it
    assert bench.repro_command(only_shape, "8,2,128,64", 16) == "moe-nvfp4 bench --shape 8,2,128,64 --tokens 16"
    assert bench.repro_command(args, "kimi-k2-ep8", 1) == "moe-nvfp4 bench --models kimi-k2-ep8 --tokens 1"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "llama-2-70b"], "unknown model 'llama-2-70b'"),
        (["--shape", "8,2,128"], "--shape '8,2,128': give four integers"),
        (["--shape", "8,2,130,64"], "hidden H=130 must be a positive multiple of 16"),
        (["--shape", "8,0,128,64"], "top-k K=0 must be in 1..8"),
        (["--tokens", "1,x"], "--tokens '1,x': give a comma list of integers"),
        (["--tokens", "0,4"], "token counts must be >= 1"),
        (["--paths", "ours,cutlass"], "unknown ['cutlass']"),
        (["--paths", ","], "--paths ','"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(capsys, monkeypatch, argv, message):
    monkeypatch.setattr(bench, "run", lambda args: pytest.fail("ran despite bad arguments"))
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-nvfp4 bench: error: ") and err.count("\n") == 1 and message in err, err


def test_argparse_errors_exit_2():
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--replays", "many"])
    assert exc.value.code == 2


def test_parse_shape_names_the_layer():
    s = parse_shape("16,4,6144,10752")
    assert s.name == "E=16 top-4 H=6144 I=10752" and _dims(s) == (16, 4, 6144, 10752, 16)


# --------------------------------------------------------------------------------------------------
# the device check
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def runs(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "run", lambda args: calls.append(args) or [])
    return calls


def test_no_gpu_is_refused_unless_asked_for_the_cpu(capsys, monkeypatch, runs):
    fake_gpu(monkeypatch, available=False)
    assert main(["bench", "--paths", "ours"]) == 2
    err = capsys.readouterr().err
    assert "sees no CUDA GPU; --device cpu runs on the CPU" in err and err.count("\n") == 1, err
    assert not runs
    assert main(["bench", "--device", "cpu", "--paths", "ours"]) == 0 and runs[0].device == "cpu"


def test_an_sm90_gpu_runs_and_others_are_refused(capsys, monkeypatch, runs):
    fake_gpu(monkeypatch, available=True, name="NVIDIA H100 80GB HBM3")
    assert main(["bench", "--model", "olmoe", "--tokens", "1,16", "--paths", "ours"]) == 0
    assert list(runs[0].models) == ["olmoe"] and runs[0].tokens == [1, 16]
    fake_gpu(monkeypatch, available=True, capability=(12, 0), name="NVIDIA GeForce RTX 5090")
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "NVIDIA GeForce RTX 5090 is sm_120; the fused kernel supports sm_90 GPUs (H100, H200, GH200)" in err, err
    assert len(runs) == 1


def test_available_paths_follow_the_installed_packages(monkeypatch):
    import importlib.util

    def installed(*names):
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name in names else None)
        return bench.available_paths()

    assert installed() == ["ours", "torch"]
    assert installed("vllm") == ["ours", "marlin", "bf16"]
    assert installed("vllm", "humming") == ["ours", "marlin", "humming", "bf16"]
    assert installed("humming") == ["ours", "torch"]  # Humming is reached through vLLM


def test_the_package_bench_imports_no_vllm():
    """Importing the bench, the CLI and the demo must not import vLLM (the paths import it when they are built)."""
    code = (
        "import sys; import moe_nvfp4.bench.moe, moe_nvfp4.bench.paths, moe_nvfp4.cli, moe_nvfp4.demo; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'humming')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------------
# a run on the host clock: rows, table, JSON and Markdown
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_on_the_cpu_writes_json_and_markdown(tmp_path, capsys):
    """Ours (the torch reference on a CPU) and the torch loop on an odd little layer (5 experts, top-3) at T=1 and
    T=3: the table on stdout, and --out as JSON (today's rows and meta) and as Markdown."""
    common = [
        "bench",
        "--device",
        "cpu",
        "--shape",
        "5,3,64,48",
        "--tokens",
        "1,3",
        "--paths",
        "ours,torch",
        "--rounds",
        "1",
        "--replays",
        "2",
        "--no-rotate",
    ]
    assert main([*common, "--out", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "| model | config | T | ours µs | torch µs | floor µs |" in out and "Marlin" not in out, out
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["meta"]["ceilings"]["copy_GBps"] > 0 and data["meta"]["args"]["paths"] == ["ours", "torch"]
    rows = data["rows"]
    assert [(r["model"], r["tokens"]) for r in rows] == [("E=5 top-3 H=64 I=48", 1), ("E=5 top-3 H=64 I=48", 3)]
    for r in rows:
        assert r["ours_us"] > 0 and r["torch_us"] > 0 and r["floor_us"] > 0 and "marlin_us" not in r
        assert math.isclose(r["floor_us"], max(r["hbm_floor_us"], r["compute_floor_us"]))
        assert r["rel_err_ours_vs_ref"] < 2e-2 and r["rel_err_torch_vs_ref"] < 2e-2  # bf16 rounding only
        assert r["repro"] == f"moe-nvfp4 bench --shape 5,3,64,48 --tokens {r['tokens']}"
    assert main([*common, "--tokens", "2", "--out", str(tmp_path / "r.md")]) == 0
    md = (tmp_path / "r.md").read_text()
    assert md.startswith("# NVFP4 MoE forward") and "| E=5 top-3 H=64 I=48 | - | 2 |" in md, md


@pytest.mark.slow
def test_bench_w4a8_column_on_the_cpu(tmp_path):
    """--paths ours,ours_w4a8 (the W4A8 mode is opt-in, never in auto): at T=160 each of 4 experts (top-2) expects 80
    rows, so the column times W4A8 (its error against the reference within its own e4m3 bound, not a mismatch) and
    at T=3 the W4A16 forward (ours' output exactly)."""
    from moe_nvfp4.bench.paths import REGISTRY

    args = ["bench", "--device", "cpu", "--shape", "4,2,64,64", "--tokens", "3,160", "--paths", "ours,ours_w4a8"]
    args += ["--rounds", "1", "--replays", "1", "--no-rotate", "--out", str(tmp_path / "r.json")]
    assert main(args) == 0
    few, many = json.loads((tmp_path / "r.json").read_text())["rows"]
    for r in (few, many):
        assert r["ours_w4a8_us"] > 0 and not r["mismatched"], r
    assert few["rel_err_ours_vs_ours_w4a8"] == 0.0
    floor = REGISTRY["ours_w4a8"].error_floor
    assert 1e-2 < many["rel_err_ours_w4a8_vs_ref"] < floor and many["rel_err_ours_vs_ref"] < 2e-2
