"""`moe-nvfp4 demo` on the CPU end to end, its argument handling, and its choice of device (a GPU absent; present,
supported or not, through mocks of torch.cuda)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from helpers_device import fake_gpu

import moe_nvfp4.demo as demo
from moe_nvfp4.bench.moe import TINY
from moe_nvfp4.cli import main

# Tolerance bounds of this file: the demo's own numbers (random Mixtral-like layer, two NVFP4 GEMMs in
# W4A16; measured rel. error ~0.16 and cosine ~0.987).
TOL = {"max_rel_error": 0.25, "min_cosine": 0.97}

ROW = re.compile(r"^\|\s*(NVFP4[^|]*?)\s*\|\s*([0-9.]+)\s*\|\s*([0-9.]+)\s*\|$")


def _rows(out: str) -> list[tuple[str, str, str]]:
    lines = [line for line in out.splitlines() if line.startswith("|")]
    assert len({len(line) for line in lines}) == 1, "table columns must line up"
    return [m.groups() for m in map(ROW.match, out.splitlines()) if m]


def test_demo_on_the_cpu_says_it_ran_the_reference_and_prints_error_and_cosine(capsys, seed):
    assert main(["demo", "--device", "cpu", "--tokens", "8", "--seed", str(seed % 2**31)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("moe-nvfp4 demo on the CPU: ran the torch reference"), out
    assert "not the fused kernel" in out and "T=8" in out and "Mixtral-8x7B scaled down by 4" in out
    rows = _rows(out)
    assert len(rows) == 2, out
    for name, rel, cos in rows:
        assert 0.0 < float(rel) < TOL["max_rel_error"], (name, rel)
        assert TOL["min_cosine"] < float(cos) <= 1.0, (name, cos)
    assert re.search(r"BF16 [0-9.]+ MiB -> NVFP4 [0-9.]+ MiB", out), out


def test_demo_on_the_cpu_takes_an_explicit_shape(capsys, seed):
    """--shape on the CPU: that layer (odd expert count, top-3), not the default one."""
    assert main(["demo", "--device", "cpu", "--shape", "5,3,64,48", "--tokens", "7", "--seed", str(seed % 2**31)]) == 0
    out = capsys.readouterr().out
    assert "E=5 top-3 H=64 I=48 T=7" in out, out
    for name, rel, cos in _rows(out):
        assert 0.0 < float(rel) < TOL["max_rel_error"] and TOL["min_cosine"] < float(cos) <= 1.0, (name, rel, cos)


# The README's CPU sample is this run's output (seed 0, the default shape and tokens); its printed digits may move by
# one in the last place on another CPU's float summation order, so numbers compare within that.
README_DIGITS = {"rel. error": 1e-4, "cosine": 1e-5}


def test_readme_cpu_sample_is_what_the_demo_prints():
    """Issue 54: the README showed numbers no run with its seed gave.  Its block after "What `moe-nvfp4 demo` prints"
    must be the demo's output line for line (the timing line aside)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme[readme.index("What `moe-nvfp4 demo` prints") :]
    block = block[block.index("```\n") + 4 :]
    sample = block[: block.index("```")].rstrip().splitlines()
    out = demo.run_reference_demo(seed=0).splitlines()
    assert len(sample) == len(out) and sample[-1].startswith("quantize ") and out[-1].startswith("quantize ")
    for want, got in zip(sample[:-1], out[:-1]):
        if ROW.match(want):
            (name, rel, cos), (name_got, rel_got, cos_got) = ROW.match(want).groups(), ROW.match(got).groups()
            assert name == name_got and abs(float(rel) - float(rel_got)) <= README_DIGITS["rel. error"], (want, got)
            assert abs(float(cos) - float(cos_got)) <= README_DIGITS["cosine"], (want, got)
        else:
            assert want == got


# --------------------------------------------------------------------------------------------------
# bad arguments and devices: one line on stderr, exit status 2, nothing run
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shape", "128,8,2048"], "give four integers E,K,H,I"),
        (["--shape", "a,b,c,d"], "give four integers"),
        (["--shape", "8,2,100,64"], "hidden H=100 must be a positive multiple of 16"),
        (["--shape", "8,2,128,40"], "intermediate I=40 must be a positive multiple of 16"),
        (["--shape", "4,5,128,64"], "top-k K=5 must be in 1..4"),
        (["--shape", "2048,8,128,64"], "experts E=2048 must be in 1..1024"),
        (["--model", "llama-2"], "unknown model 'llama-2'; choose a zoo model (mixtral-8x7b"),
        (["--model", "zoo"], "the demo runs one model"),
        (["--model", "qwen3", "--shape", "8,2,128,64"], "give --model or --shape, not both"),
        (["--tokens", "0"], "--tokens 0: must be >= 1"),
    ],
)
def test_demo_refuses_bad_arguments_in_one_line(capsys, monkeypatch, argv, message):
    ran = []
    monkeypatch.setattr(demo, "run_reference_demo", lambda *a, **k: ran.append(a) or "")
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("moe-nvfp4 demo: error: ") and message in err, err
    assert not ran


def test_demo_argparse_errors_exit_2():
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--device", "tpu"])
    assert exc.value.code == 2


@pytest.fixture
def runs(monkeypatch):
    """Which demo ran, with what: the two runners replaced by recorders."""
    calls = []
    monkeypatch.setattr(demo, "run_reference_demo", lambda shape, **kw: calls.append(("cpu", shape, kw)) or "cpu ran")
    monkeypatch.setattr(
        demo, "run_kernel_demo", lambda key, shape, **kw: calls.append(("gpu", key, shape, kw)) or ("gpu ran", True)
    )
    return calls


def test_no_gpu_auto_runs_the_reference_and_cuda_is_refused(capsys, monkeypatch, runs):
    fake_gpu(monkeypatch, available=False)
    assert main(["demo", "--tokens", "4"]) == 0
    assert runs == [("cpu", demo.CPU_SHAPE, {"tokens": 4, "seed": 0})]
    assert main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-nvfp4 demo: error: --device cuda, but torch") and "sees no CUDA GPU" in err, err
    assert err.count("\n") == 1 and len(runs) == 1


def test_an_sm90_gpu_runs_the_kernel_on_the_default_model(monkeypatch, runs):
    fake_gpu(monkeypatch, available=True)
    assert main(["demo"]) == 0
    ((kind, key, shape, kw),) = runs
    assert (kind, key, kw) == ("gpu", "qwen3-30b-a3b", {"tokens": 64, "seed": 0})
    assert (shape.experts, shape.top_k, shape.hidden, shape.intermediate) == (128, 8, 2048, 768)


def test_an_sm90_gpu_takes_a_zoo_model_or_a_shape(monkeypatch, runs):
    fake_gpu(monkeypatch, available=True)
    assert main(["demo", "--device", "cuda", "--model", "kimi-k2-ep8", "--tokens", "3", "--seed", "7"]) == 0
    assert main(["demo", "--shape", "64, 6, 1024, 512"]) == 0
    (_, key1, ep8, kw1), (_, key2, mine, _) = runs
    assert key1 == "kimi-k2-ep8" and kw1 == {"tokens": 3, "seed": 7}
    assert (ep8.experts, ep8.global_experts, ep8.top_k, ep8.hidden, ep8.intermediate) == (48, 384, 8, 7168, 2048)
    assert key2 == "64,6,1024,512" and (mine.experts, mine.top_k, mine.hidden, mine.intermediate) == (64, 6, 1024, 512)


def test_a_failing_kernel_check_exits_1(monkeypatch, capsys):
    fake_gpu(monkeypatch, available=True)
    monkeypatch.setattr(demo, "run_kernel_demo", lambda key, shape, **kw: ("MISMATCH", False))
    assert main(["demo"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize("device", ["auto", "cuda"])
@pytest.mark.parametrize(
    "capability, name", [((8, 0), "NVIDIA A100-SXM4-80GB"), ((10, 0), "NVIDIA B200"), ((8, 9), "NVIDIA L40S")]
)
def test_an_unsupported_gpu_is_refused_naming_what_is_supported(capsys, monkeypatch, runs, device, capability, name):
    fake_gpu(monkeypatch, available=True, capability=capability, name=name)
    assert main(["demo", "--device", device]) == 2
    err = capsys.readouterr().err
    sm = f"sm_{capability[0]}{capability[1]}"
    assert err == (
        f"moe-nvfp4 demo: error: {name} is {sm}; the fused kernel supports sm_90 GPUs (H100, H200, GH200);"
        " --device cpu runs the torch reference instead\n"
    )
    assert not runs
    assert main(["demo", "--device", "cpu", "--tokens", "2"]) == 0 and runs[0][0] == "cpu"  # the way out works


def test_the_supported_gpus_are_those_the_registry_has_run_on(monkeypatch, runs):
    """A backend's GPU tests passing on a new architecture (backends.Backend.ran_on) is what admits it here."""
    import dataclasses

    from moe_nvfp4 import backends

    fake_gpu(monkeypatch, available=True, capability=(10, 0), name="NVIDIA B200")
    assert main(["demo", "--device", "cuda"]) == 2
    verified = dataclasses.replace(backends.TRITON, ran_on=frozenset({"sm_90", "sm_100"}))
    monkeypatch.setitem(backends.DEFAULT_ORDER, "moe_w4a16", (verified,))
    assert main(["demo", "--device", "cuda"]) == 0 and runs[-1][0] == "gpu"


def test_kernel_demo_runs_the_bench_paths_it_can(monkeypatch):
    """The GPU demo's plumbing on the CPU: the bench's run_model and the ceilings replaced, the table and the
    verdict come from their row; without vLLM only ours and the torch loop run."""
    import moe_nvfp4.bench.moe as bench

    seen = {}

    def fake_run_model(key, shape, tokens, args, ceilings, l2, deadline, log):
        seen.update(key=key, tokens=tokens, paths=args.paths, quick=args.quick)
        return [
            dict(
                ours_us=50.0,
                torch_us=5000.0,
                speedup_vs_torch=100.0,
                rel_err_ours_vs_ref=3e-3,
                touched_experts=61,
                hbm_floor_us=20.0,
                pct_of_floor=40.0,
                notes=[],
            )
        ]

    class Props:
        name, major, minor, L2_cache_size = "NVIDIA H200", 9, 0, 50 << 20

    monkeypatch.setattr(bench, "run_model", fake_run_model)
    monkeypatch.setattr(demo, "measure_ceilings", lambda quick: bench.Ceilings(4.0e12, 700e12))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Props)
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None)
    text, ok = demo.run_kernel_demo("tiny", TINY, tokens=16)
    assert ok and seen == dict(key="tiny", tokens=[16], paths=["ours", "torch"], quick=True)
    assert "||out-ref||/||ref|| = 3.0e-03 (ok: bound 2e-02)" in text
    assert re.search(r"\| ours: fused NVFP4 kernel \(W4A16\) +\| +50\.0 \|", text), text
    assert re.search(r"\| torch BF16 \(per-expert loop\) +\| +5000\.0 \| +100\.00x \|", text), text
    assert "HBM floor (61 experts' NVFP4 weights once)" in text and "vLLM is not installed" in text
    assert "Marlin" not in text.split("vLLM is not installed")[0]
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len({len(line) for line in table}) == 1, "table columns must line up"

    def mismatching(*a, **k):
        return [dict(fake_run_model(*a, **k)[0], rel_err_ours_vs_ref=0.5)]

    monkeypatch.setattr(bench, "run_model", mismatching)
    text, ok = demo.run_kernel_demo("tiny", TINY, tokens=16)
    assert not ok and "MISMATCH" in text
