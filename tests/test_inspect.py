"""inspect: every problem the validator knows is reported (exit 1), and --fix repairs gate/up scale mismatch."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers_checkpoints import make_tiny_checkpoint
from moe_nvfp4.cli import main
from moe_nvfp4.convert import ConversionError, ConvertOptions, QuantSettings, convert_checkpoint, fix_checkpoint, inspect_checkpoint
from moe_nvfp4.formats import NVFP4Tensor, dequantize_nvfp4

# Requantizing with a larger global scale moves each value by at most about one e2m1 step of its block.
FIX_MAX_RELATIVE_CHANGE = 0.12

GATE = "model.layers.1.mlp.experts.2.gate_proj"
UP = "model.layers.1.mlp.experts.2.up_proj"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inspect")
    src = make_tiny_checkpoint("qwen3_moe", root / "src", shards=2)
    out = {}
    for name, settings in {
        "shared": QuantSettings(),
        "separate": QuantSettings(separate_gate_up_scales=True),
        "w4a4": QuantSettings(input_amax=100.0),
    }.items():
        out[name] = root / name
        convert_checkpoint(src, out[name], ConvertOptions(settings=settings), progress=False)
    return out


def _shard_of(root: Path, name: str) -> Path:
    return root / json.loads((root / "model.safetensors.index.json").read_text())["weight_map"][name]


def _edit(root: Path, name: str, fn: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Replace (or, when fn returns None, delete) one tensor of a checkpoint in place."""
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = root / index["weight_map"][name]
    tensors = load_file(str(shard))
    new = fn(tensors[name].clone())
    if new is None:
        del tensors[name], index["weight_map"][name]
        index_path.write_text(json.dumps(index))
    else:
        tensors[name] = new
    save_file(tensors, str(shard), metadata={"format": "pt"})


def _set(value: float, at: int | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(t: torch.Tensor) -> torch.Tensor:
        f = t.float()
        if at is None:
            f.fill_(value)
        else:
            f.view(-1)[at] = value
        return f.to(t.dtype)

    return fn


def _declare_shared(root: Path) -> None:
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"]["moe_nvfp4"]["gate_up_global_scale"] = "shared_max"
    (root / "config.json").write_text(json.dumps(config))


@dataclass(frozen=True)
class Case:
    why: str
    base: str
    tensor: str | None
    edit: Callable[[torch.Tensor], torch.Tensor | None] | None
    message: str
    fixable: bool = False


CASES = [
    Case("NaN block scale", "shared", f"{GATE}.weight_scale", _set(float("nan"), at=5), "NaN or inf"),
    Case("inf global scale", "shared", f"{UP}.weight_scale_2", _set(float("inf")), "finite and positive"),
    Case("zero global scale", "shared", f"{GATE}.weight_scale_2", _set(0.0), "finite and positive"),
    Case("negative block scale", "shared", f"{GATE}.weight_scale", _set(-1.0, at=0), "negative"),
    Case("zero block scale over data", "shared", f"{GATE}.weight_scale", _set(0.0, at=3), "zero over non-zero codes"),
    Case("missing input scale under W4A4", "w4a4", f"{UP}.input_scale", lambda t: None, "missing input scale"),
    Case("undeclared gate/up mismatch", "separate", None, None, "gate/up global scales differ", fixable=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.why for c in CASES])
def test_detects_problem(converted, tmp_path, case):
    root = shutil.copytree(converted[case.base], tmp_path / "ckpt")
    if case.tensor is not None:
        _edit(root, case.tensor, case.edit)
    else:
        _declare_shared(root)
    report = inspect_checkpoint(root)
    assert not report.ok
    hits = [p for p in report.problems if case.message in p.message and p.severity == "error"]
    assert hits, f"expected '{case.message}' in {[str(p) for p in report.problems]}"
    assert all(p.fixable == case.fixable for p in hits)
    assert main(["inspect", str(root)]) == 1


def test_clean_checkpoints_pass(converted):
    for name in ("shared", "w4a4"):
        report = inspect_checkpoint(converted[name])
        assert report.ok and not report.problems, [str(p) for p in report.problems]
        assert report.conventions == ("modelopt",) and report.quantized_modules == 24
        assert report.experts_per_layer == {"model.layers.0.mlp.experts": 4, "model.layers.1.mlp.experts": 4}
        assert report.shapes == {"gate": (64, 64), "up": (64, 64), "down": (64, 64)}


def test_fix_shares_gate_up_scale(converted, tmp_path):
    root = shutil.copytree(converted["separate"], tmp_path / "ckpt")
    _declare_shared(root)
    assert main(["inspect", str(root), "--fix", str(tmp_path / "fixed")]) == 0
    report = inspect_checkpoint(tmp_path / "fixed")
    assert report.ok and not report.problems
    before, after = {}, {}
    for d, name in ((root, "before"), (tmp_path / "fixed", "after")):
        t = {}
        for shard in sorted(d.glob("*.safetensors")):
            t.update(load_file(str(shard)))
        (before if name == "before" else after).update(t)
    g, u = (float(after[f"{m}.weight_scale_2"]) for m in (GATE, UP))
    assert g == u == max(float(before[f"{GATE}.weight_scale_2"]), float(before[f"{UP}.weight_scale_2"]))
    for m in (GATE, UP):
        old = dequantize_nvfp4(NVFP4Tensor(before[f"{m}.weight"], before[f"{m}.weight_scale"], before[f"{m}.weight_scale_2"]))
        new = dequantize_nvfp4(NVFP4Tensor(after[f"{m}.weight"], after[f"{m}.weight_scale"], after[f"{m}.weight_scale_2"]))
        assert float(torch.linalg.vector_norm(new - old) / torch.linalg.vector_norm(old)) < FIX_MAX_RELATIVE_CHANGE
    down = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert torch.equal(before[down], after[down]), "modules without problems are copied unchanged"


def test_fix_refuses_existing_output(converted):
    with pytest.raises(ConversionError, match="already exists"):
        fix_checkpoint(converted["separate"], converted["shared"])
