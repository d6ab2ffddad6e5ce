"""inspect on converted checkpoints: clean ones pass (exit 0), separate gate/up scales warn (exit 3), --fix shares
them within its bound and refuses beyond it.  Every corruption is in test_validate.py (inspect, converter, loader)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers_checkpoints import make_tiny_checkpoint
from moe_nvfp4.cli import main
from moe_nvfp4.convert import (
    ConversionError,
    ConvertOptions,
    QuantSettings,
    convert_checkpoint,
    fix_checkpoint,
    inspect_checkpoint,
)
from moe_nvfp4.convert.inspect import FIX_MAX_RELATIVE_ERROR
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


def test_separate_gate_up_scales_are_a_warning(converted, capsys):
    """Both formats store a global scale per projection and our loader keeps both exact: a warning (exit 3)."""
    report = inspect_checkpoint(converted["separate"])
    assert report.ok and report.problems and all(p.severity == "warning" and p.fixable for p in report.problems)
    assert main(["inspect", str(converted["separate"])]) == 3


def test_clean_checkpoints_pass(converted):
    for name in ("shared", "w4a4"):
        report = inspect_checkpoint(converted[name])
        assert report.ok and not report.problems, [str(p) for p in report.problems]
        assert report.conventions == ("modelopt",) and report.quantized_modules == 24
        assert report.experts_per_layer == {"model.layers.0.mlp.experts": 4, "model.layers.1.mlp.experts": 4}
        assert report.shapes == {"gate": (64, 64), "up": (64, 64), "down": (64, 64)}


def test_fix_shares_gate_up_scale(converted, tmp_path):
    root = shutil.copytree(converted["separate"], tmp_path / "ckpt")
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
        old = dequantize_nvfp4(
            NVFP4Tensor(before[f"{m}.weight"], before[f"{m}.weight_scale"], before[f"{m}.weight_scale_2"])
        )
        new = dequantize_nvfp4(
            NVFP4Tensor(after[f"{m}.weight"], after[f"{m}.weight_scale"], after[f"{m}.weight_scale_2"])
        )
        assert float(torch.linalg.vector_norm(new - old) / torch.linalg.vector_norm(old)) < FIX_MAX_RELATIVE_CHANGE
    down = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert torch.equal(before[down], after[down]), "modules without problems are copied unchanged"


def test_fix_refuses_existing_output(converted):
    with pytest.raises(ConversionError, match="already exists"):
        fix_checkpoint(converted["separate"], converted["shared"])


def test_fix_refuses_a_lossy_shared_scale(converted, tmp_path, capsys):
    """A 1e30 up scale would requantize gate to zeros: --fix refuses, naming the expert and the error."""
    root = shutil.copytree(converted["separate"], tmp_path / "ckpt")
    _edit(root, f"{UP}.weight_scale_2", lambda t: torch.full_like(t, 1e30))
    assert main(["inspect", str(root), "--fix", str(tmp_path / "fixed")]) == 1
    err = capsys.readouterr().err
    assert f"{GATE} (expert 2)" in err and f"bound {FIX_MAX_RELATIVE_ERROR}" in err, err
    assert not (tmp_path / "fixed").exists()
