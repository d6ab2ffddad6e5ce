"""The converter on bad input, as a careless or hostile user gives it: every case ends in a ConversionError
naming the file or tensor (no traceback, no hang, no output left behind) or, where the input is usable, in a
correct conversion with a warning.  Sources are tiny synthetic BF16 Mixtral-style checkpoints.

Tolerances: none; stacked orientations must give byte-identical output.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_nvfp4.cli import main
from moe_nvfp4.convert import ConversionError, ConvertOptions, convert_checkpoint
from moe_nvfp4.convert import writer as writer_module

E, H, I = 2, 64, 32
PREFIX = "model.layers.0.block_sparse_moe.experts"
CONFIG = {"model_type": "mixtral", "hidden_size": H, "intermediate_size": I, "num_local_experts": E}


def expert_weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": torch.randn(16, H, generator=gen).bfloat16()}
    for e in range(E):
        for proj, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            out[f"{PREFIX}.{e}.{proj}.weight"] = torch.randn(*shape, generator=gen).bfloat16()
    return out


def write_source(root: Path, tensors: dict[str, torch.Tensor], config: object = CONFIG, shards: int = 1) -> Path:
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        return root
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(root / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def stacked(gen: torch.Generator, transposed: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    w = expert_weights(gen)
    gate_up = torch.stack([torch.cat([w[f"{PREFIX}.{e}.w1.weight"], w[f"{PREFIX}.{e}.w3.weight"]]) for e in range(E)])
    down = torch.stack([w[f"{PREFIX}.{e}.w2.weight"] for e in range(E)])
    if transposed:  # transformers' Llama-4 layout: [E, H, 2I] and [E, I, H]
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    return {
        "model.embed_tokens.weight": w["model.embed_tokens.weight"],
        f"{PREFIX}.gate_up_proj": gate_up,
        f"{PREFIX}.down_proj": down,
    }


def read_all(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(root.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def test_stacked_experts_in_either_orientation_convert_identically(tmp_path):
    gen = torch.Generator().manual_seed(1)
    normal = write_source(tmp_path / "normal", stacked(gen, transposed=False))
    gen = torch.Generator().manual_seed(1)
    flipped = write_source(tmp_path / "flipped", stacked(gen, transposed=True))
    convert_checkpoint(normal, tmp_path / "a", progress=False)
    convert_checkpoint(flipped, tmp_path / "b", progress=False)
    a, b = read_all(tmp_path / "a"), read_all(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a[f"{PREFIX}.0.gate_proj.weight"].shape == (I, H // 2)


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path)


def _edit_index(root: Path, fn: Callable[[dict], object]) -> None:
    path = root / "model.safetensors.index.json"
    path.write_text(json.dumps(fn(json.loads(path.read_text()))))


def _duplicate(root: Path) -> None:
    index = json.loads((root / "model.safetensors.index.json").read_text())
    name, shard = next((n, s) for n, s in index["weight_map"].items() if n.endswith("w2.weight"))
    other = next(s for s in set(index["weight_map"].values()) if s != shard)
    tensors = load_file(str(root / other))
    tensors[name] = load_file(str(root / shard))[name] * 0  # a stale copy
    save_file(tensors, str(root / other), metadata={"format": "pt"})


def _moved(root: Path) -> None:
    """The index names one shard, the tensor sits in the other."""

    def edit(index: dict) -> dict:
        name, shard = next(iter(index["weight_map"].items()))
        index["weight_map"][name] = next(s for s in set(index["weight_map"].values()) if s != shard)
        return index

    _edit_index(root, edit)


def _symlink_loop(root: Path) -> None:
    (root / "config.json").unlink()
    os.symlink("loop_b", root / "config.json")
    os.symlink("config.json", root / "loop_b")


def _restack(fn: Callable[[dict[str, torch.Tensor]], None], config: dict = CONFIG) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        tensors = stacked(torch.Generator().manual_seed(2), transposed=False)
        fn(tensors)
        for f in root.iterdir():
            f.unlink()
        (root / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})

    return edit


def _zero_experts(t: dict[str, torch.Tensor]) -> None:
    t[f"{PREFIX}.gate_up_proj"] = t[f"{PREFIX}.gate_up_proj"][:0]
    t[f"{PREFIX}.down_proj"] = t[f"{PREFIX}.down_proj"][:0]


def _wrong_stacked_shape(t: dict[str, torch.Tensor]) -> None:
    t[f"{PREFIX}.down_proj"] = torch.zeros(E, H, 48, dtype=torch.bfloat16)


def _transposed_per_expert(root: Path) -> None:
    """Every expert saved as [K, N] (a raw dump of a layer that keeps x @ W)."""
    for shard in root.glob("*.safetensors"):
        tensors = {n: t.T.contiguous() if ".experts." in n else t for n, t in load_file(str(shard)).items()}
        save_file(tensors, str(shard), metadata={"format": "pt"})


# (why, corruption of a 2-shard source, what the ConversionError must say)
BAD_SOURCES = [
    (
        "config.json is a list",
        lambda r: (r / "config.json").write_text("[1, 2]"),
        r"config.json: expected a JSON object, got list",
    ),
    (
        "index is a string",
        lambda r: (r / "model.safetensors.index.json").write_text('"x"'),
        r"index.json: expected a JSON object",
    ),
    (
        "index shard is a number",
        lambda r: _edit_index(r, lambda i: {**i, "weight_map": {**i["weight_map"], "x": 3}}),
        r"weight_map entry 'x' -> 3 is not a shard file name",
    ),
    (
        "index shard escapes the directory",
        lambda r: _edit_index(r, lambda i: {"weight_map": {k: "../" + v for k, v in i["weight_map"].items()}}),
        r"is not a shard file name",
    ),
    ("tensor in two shards", _duplicate, r"w2.weight: in two shards"),
    ("index names the other shard", _moved, r"index.json names shard model-0000\d-of-00002.safetensors, but it is in"),
    ("symlink loop", _symlink_loop, r"config.json: cannot stat .*symlink loop"),
    ("FIFO as config.json", lambda r: _fifo(r / "config.json"), r"config.json: not a regular file"),
    (
        "FIFO as a shard",
        lambda r: _fifo(r / "model-00002-of-00002.safetensors"),
        r"00002.safetensors: not a regular file",
    ),
    ("FIFO beside the weights", lambda r: _fifo(r / "tokenizer.json"), r"tokenizer.json: not a regular file"),
    ("zero experts", _restack(_zero_experts), r"experts.down_proj: shape \(0, 64, 32\) holds zero experts"),
    (
        "stacked shape fits neither orientation",
        _restack(_wrong_stacked_shape),
        r"down_proj: shape \(2, 64, 48\) fits neither",
    ),
    ("stacked without sizes in config", _restack(lambda t: None, {"model_type": "mixtral"}), r"no hidden_size"),
    ("per-expert weight stored transposed", _transposed_per_expert, r"w1.weight: shape \(64, 32\) is the transpose"),
]


@pytest.mark.parametrize("why, corrupt, message", BAD_SOURCES, ids=[c[0] for c in BAD_SOURCES])
def test_bad_source_fails_with_named_error(gen, tmp_path, capsys, why, corrupt, message):
    src = write_source(tmp_path / "src", expert_weights(gen), shards=2)
    corrupt(src)
    dst = tmp_path / "out" / "model"
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(src, dst, progress=False)
    assert not dst.exists() and not (dst.parent.exists() and list(dst.parent.iterdir())), "output left behind"
    assert main(["convert", str(src), str(dst), "--quiet"]) == 1
    assert "moe-nvfp4 convert: error:" in capsys.readouterr().err


def test_full_disk_is_a_conversion_error(gen, tmp_path, monkeypatch):
    def full(tensors, path, metadata=None):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(writer_module, "save_file", full)
    src = write_source(tmp_path / "src", expert_weights(gen))
    with pytest.raises(ConversionError, match=r"shard-00000.tmp: cannot write \(No space left on device\)"):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["src"]


def test_dangling_symlink_destination(gen, tmp_path):
    src = write_source(tmp_path / "src", expert_weights(gen))
    os.symlink(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(ConversionError, match=r"out: output a dangling symbolic link"):
        convert_checkpoint(src, tmp_path / "out", progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda(gen, tmp_path):
    src = write_source(tmp_path / "src", expert_weights(gen))
    with pytest.raises(ConversionError, match=r"--device cuda: not usable on this machine"):
        convert_checkpoint(src, tmp_path / "out", ConvertOptions(device="cuda"), progress=False)
    assert not (tmp_path / "out").exists()


def test_output_permissions_subdirectories_and_warnings(gen, tmp_path):
    """The output follows the umask (not mkdtemp's 0700); subdirectories are left out and listed; NaN in a
    copied tensor and an outlier that zeroes most of an expert are warnings naming the tensor and expert."""
    tensors = expert_weights(gen)
    tensors["model.embed_tokens.weight"][3, 5] = float("nan")
    tensors[f"{PREFIX}.1.w3.weight"][0, 0] = 1e8  # shares its global scale with w1: both lose their values
    src = write_source(tmp_path / "src", tensors)
    (src / "original").mkdir()
    (src / "original" / "consolidated.pth").write_bytes(b"weights")
    (src / "tokenizer.json").write_text("{}")
    old = os.umask(0o022)
    try:
        summary = convert_checkpoint(src, tmp_path / "out", progress=False)
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.endswith(".safetensors")) == [
        "config.json",
        "hf_quant_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    assert summary.left_out == ("original",)
    text = "\n".join(summary.warnings)
    assert "model.embed_tokens.weight: copied unchanged with 1 NaN values" in text
    assert f"{PREFIX}.1.w1.weight, {PREFIX}.1.w3.weight (expert 1): {PREFIX}.1.w1:" in text
    assert "quantize to 0 (relative error 1" in text, text
    assert f"(expert 0)" not in text


# a converter whose every unit takes a minute (argv: source, output, a file it touches once converting), then the
# line that converts; test_convert_edges.py runs the same through the CLI
SLOW_CONVERTER = """
import pathlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal: a background CI job starts us ignoring it
from moe_nvfp4.convert import convert as c
real = c._run_unit
def slow(*a, **k):
    pathlib.Path(sys.argv[3]).touch()  # a unit is being converted: the signal lands mid-conversion
    time.sleep(60)
    return real(*a, **k)
c._run_unit = slow
"""
_SLOW_CONVERT = SLOW_CONVERTER + "c.convert_checkpoint(sys.argv[1], sys.argv[2], progress=False)\n"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_removes_the_temp_directory(gen, tmp_path, sig):
    src = write_source(tmp_path / "src", expert_weights(gen))
    out, converting = tmp_path / "out", tmp_path.parent / f"{tmp_path.name}.converting"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERT, str(src), str(out), str(converting)], env=env, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 60
    while not converting.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert converting.exists() and list(tmp_path.glob(".out.tmp-*")), "the converter never started writing"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0, err.decode()[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"], err.decode()[-2000:]
