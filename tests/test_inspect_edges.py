"""inspect at the edges (issue 54): expert ids are taken from the tensors present, never from a claimed count (a
config claiming 10**12 experts, or an expert named 10**12, answers at once with one error naming it); a shard whose
header claims more than a memory limit allows is one clear error; ``--json`` follows its documented schema; the text
report sums up repeated gate/up warnings in one line.

Tolerances: none (the checkpoints are valid NVFP4 and inspect reports facts).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe_nvfp4.checkpoint import Convention, NVFP4Linear, to_checkpoint
from moe_nvfp4.cli import main
from moe_nvfp4.convert import inspect_checkpoint
from moe_nvfp4.convert.inspect import JSON_SCHEMA_VERSION, PROBLEMS_SHOWN
from moe_nvfp4.convert.source import open_checkpoint
from moe_nvfp4.formats import quantize_nvfp4

LAYER = "model.layers.{}.mlp.experts"
N = K = 32
QUANT = {"quant_method": "modelopt", "quant_algo": "W4A16_NVFP4", "group_size": 16, "ignore": []}
# A subprocess that must answer: inspect of any of these checkpoints takes seconds (torch's import most of it).
ANSWER_WITHIN_S = 120


def write_nvfp4(
    root: Path, gen: torch.Generator, ids: list[int], *, layers: int = 1, claimed: int | None = None
) -> Path:
    """A ModelOpt NVFP4 checkpoint of ``layers`` MoE layers with experts ``ids`` (gate/up quantized apart, so their
    global scales differ: a warning each); config.json claims ``claimed`` experts where given."""
    tensors = {}
    for layer in range(layers):
        for e in ids:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                q = quantize_nvfp4(torch.randn(N, K, generator=gen))
                for suffix, t in to_checkpoint(NVFP4Linear(q), Convention.MODELOPT).items():
                    tensors[f"{LAYER.format(layer)}.{e}.{proj}.{suffix}"] = t
    root.mkdir(parents=True)
    config = {"model_type": "qwen3_moe", "quantization_config": QUANT, **({"num_experts": claimed} if claimed else {})}
    (root / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def _cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "moe_nvfp4.cli", *args],
        capture_output=True,
        text=True,
        timeout=ANSWER_WITHIN_S,
        **kwargs,
    )


def test_claimed_expert_count_is_never_looped_over(gen, tmp_path):
    """config.json claiming 10**12 experts used to make inspect (and the converter's self-check) walk every id."""
    root = write_nvfp4(tmp_path / "ckpt", gen, [0, 1], claimed=10**12)
    run = _cli("inspect", str(root))
    assert run.returncode == 1, run.stderr
    layer = LAYER.format(0)
    assert (
        f"error: {layer}.2: missing: the checkpoint has 2 experts (0..1), config.json says 1000000000000 (num_experts)"
        in run.stdout
    )


def test_largest_expert_id_is_never_looped_over(gen, tmp_path):
    """An expert named 10**12 among 0 and 1: one error naming the gap, at once."""
    root = write_nvfp4(tmp_path / "ckpt", gen, [0, 1, 10**12])
    run = _cli("inspect", str(root))
    assert run.returncode == 1, run.stderr
    assert (
        f"error: {LAYER.format(0)}.2: missing: expert ids have gaps, 3 experts with ids up to 1000000000000 (missing [2, 3, 4] ...)"
        in run.stdout
    )


@pytest.mark.parametrize(
    "ids, claimed, where, message",
    [
        ([0, 2, 3], None, 1, "expert ids have gaps, 3 experts with ids up to 3 (missing [1])"),
        ([1, 2], None, 0, "expert ids have gaps, 2 experts with ids up to 2 (missing [0])"),
        ([0, 1, 2], 2, 2, "outside the config's experts: the checkpoint has 3 experts (0..2), config.json says 2"),
        ([0, 1], 3, 2, "missing: the checkpoint has 2 experts (0..1), config.json says 3"),
    ],
    ids=["gap", "no-expert-0", "more-than-claimed", "fewer-than-claimed"],
)
def test_expert_id_mismatch_is_one_error_naming_it(gen, tmp_path, ids, claimed, where, message):
    report = inspect_checkpoint(write_nvfp4(tmp_path / "ckpt", gen, ids, claimed=claimed))
    errors = [p for p in report.problems if p.severity == "error"]
    assert len(errors) == 1 and errors[0].module == f"{LAYER.format(0)}.{where}", [str(p) for p in errors]
    assert message in errors[0].message


def _huge_shard(root: Path, tensor_bytes: int) -> Path:
    """A valid safetensors shard holding one U8 tensor of ``tensor_bytes`` and a scalar, made sparse (no disk)."""
    name = f"{LAYER.format(0)}.0.gate_proj"
    header = {
        "__metadata__": {"format": "pt"},
        f"{name}.weight": {"dtype": "U8", "shape": [tensor_bytes // 16, 16], "data_offsets": [0, tensor_bytes]},
        f"{name}.weight_scale_2": {"dtype": "F32", "shape": [], "data_offsets": [tensor_bytes, tensor_bytes + 4]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"quantization_config": QUANT}))
    with open(root / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + tensor_bytes + 4)
    return root


_UNDER_LIMIT = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
from moe_nvfp4.cli import main
sys.exit(main(["inspect", sys.argv[2]]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and sparse files as Linux has them")
def test_huge_shard_under_a_memory_limit_is_one_clear_error(tmp_path):
    """A 64 GiB shard (sparse) under a 6 GB address-space limit: headers read without mapping the file (the
    checkpoint opens), then mapping it for a tensor fails as one line naming the shard and the limit."""
    root = _huge_shard(tmp_path / "ckpt", 64 * 2**30)
    with open_checkpoint(root) as src:  # headers only: no mapping, whatever the limit
        assert src.tensors[f"{LAYER.format(0)}.0.gate_proj.weight"].nbytes == 64 * 2**30
    run = subprocess.run(
        [sys.executable, "-c", _UNDER_LIMIT, str(6 * 10**9), str(root)],
        capture_output=True,
        text=True,
        timeout=ANSWER_WITHIN_S,
    )
    assert run.returncode == 1, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.safetensors: cannot map the shard (68.7 GB) into memory" in lines[0], run.stderr[
        -3000:
    ]
    assert "memory limit" in lines[0]


def test_json_report_follows_its_schema(gen, tmp_path, capsys):
    root = write_nvfp4(tmp_path / "ckpt", gen, [0, 1, 2], layers=2, claimed=3)
    assert main(["inspect", "--json", str(root)]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report == {
        "schema": JSON_SCHEMA_VERSION,
        "root": str(root),
        "formats": ["modelopt"],
        "quant_algo": "W4A16_NVFP4",
        "moe_nvfp4": None,
        "quantized_modules": 18,
        "moe_layers": {LAYER.format(0): 3, LAYER.format(1): 3},
        "shapes": {"gate": [N, K], "up": [N, K], "down": [N, K]},
        "ok": True,
        "exit_code": 3,
        "problems": report["problems"],
    }
    assert len(report["problems"]) == 6
    for p in report["problems"]:
        assert set(p) == {"module", "severity", "message", "fixable"}
        assert p["severity"] == "warning" and p["fixable"] and "gate/up global scales differ" in p["message"]


def test_json_with_fix_adds_the_copys_report(gen, tmp_path, capsys):
    root = write_nvfp4(tmp_path / "ckpt", gen, [0, 1])
    assert main(["inspect", "--json", str(root), "--fix", str(tmp_path / "fixed")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 3 and report["fixed"]["exit_code"] == 0 and report["fixed"]["problems"] == []


def test_repeated_gate_up_warnings_are_one_line(gen, tmp_path, capsys):
    """One warning per expert is thousands of lines on a real model: the text report sums them up."""
    root = write_nvfp4(tmp_path / "ckpt", gen, list(range(8)), layers=3)
    assert main(["inspect", str(root)]) == 3
    out = capsys.readouterr().out
    warnings = [line for line in out.splitlines() if line.strip().startswith("warning:")]
    assert len(warnings) == 1, out
    assert "warning: 8 experts x 3 layers have separate gate/up global scales (first: " in warnings[0]
    assert "[fixable with --fix]" in warnings[0]
    assert "problems:  24" in out


def test_many_errors_are_cut_to_a_count(gen, tmp_path, capsys):
    """Every expert's scale corrupted: the text report lists PROBLEMS_SHOWN and counts the rest (JSON has all)."""
    root = write_nvfp4(tmp_path / "ckpt", gen, list(range(12)), layers=2)
    from safetensors.torch import load_file

    tensors = load_file(str(root / "model.safetensors"))
    for name in [n for n in tensors if n.endswith("down_proj.weight_scale_2")]:
        tensors[name] = torch.tensor(-1.0)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    assert main(["inspect", str(root)]) == 1
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.strip().startswith("error:")]
    assert (
        len(errors) == PROBLEMS_SHOWN and f"... and {24 - PROBLEMS_SHOWN} more (inspect --json lists every one)" in out
    )
    assert main(["inspect", "--json", str(root)]) == 1
    assert sum(p["severity"] == "error" for p in json.loads(capsys.readouterr().out)["problems"]) == 24


def test_closed_pipe_ends_quietly_with_141(gen, tmp_path):
    """`moe-nvfp4 inspect DIR | head`: the reader goes away; no BrokenPipeError traceback, status 128 + SIGPIPE."""
    root = write_nvfp4(tmp_path / "ckpt", gen, [0, 1])
    read, write = os.pipe()
    os.close(read)  # closed before the report is written: the first write meets a broken pipe
    proc = subprocess.run(
        [sys.executable, "-m", "moe_nvfp4.cli", "inspect", str(root)],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=ANSWER_WITHIN_S,
    )
    os.close(write)
    assert proc.returncode == 141, proc.stderr[-3000:]
    assert proc.stderr == ""
