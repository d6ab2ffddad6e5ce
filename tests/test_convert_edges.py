"""The converter at the edges (issue 54): expert ids checked from the names present before anything is written;
``--device meta`` refused by name; output shards readable as the umask says (safetensors itself writes 0600);
Ctrl-C in ``moe-nvfp4 convert`` one line, status 130, the partial output removed; a summary's repeated warnings
cut to a count; ``moe-nvfp4 --version``.

Tolerances: none (refusals, file modes and messages).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moe_nvfp4 import __version__
from moe_nvfp4.cli import EXIT_INTERRUPTED, main
from moe_nvfp4.convert import ConversionError, ConvertOptions, convert_checkpoint
from moe_nvfp4.convert.convert import WARNINGS_SHOWN

from test_convert_bad_input import CONFIG, PREFIX, SLOW_CONVERTER, expert_weights, write_source


def _renumbered(gen: torch.Generator, ids: list[int]) -> dict[str, torch.Tensor]:
    """Experts shaped as ``expert_weights``' under the expert ids ``ids``."""
    base = expert_weights(gen)
    out = {"model.embed_tokens.weight": base["model.embed_tokens.weight"]}
    for e in ids:
        for proj in ("w1", "w3", "w2"):
            shape = base[f"{PREFIX}.0.{proj}.weight"].shape
            out[f"{PREFIX}.{e}.{proj}.weight"] = torch.randn(shape, generator=gen).bfloat16()
    return out


@pytest.mark.parametrize(
    "ids, experts, message",
    [
        ([0, 1, 10**12], 3, rf"{PREFIX}.2: missing: expert ids have gaps, 3 experts with ids up to 1000000000000"),
        (
            [0, 1],
            10**12,
            rf"{PREFIX}.2: missing: the checkpoint has 2 experts \(0..1\), config.json says 1000000000000",
        ),
        ([0, 1, 2], 2, rf"{PREFIX}.2: outside the config's experts: the checkpoint has 3 experts"),
    ],
    ids=["id-10**12", "claimed-10**12", "more-than-claimed"],
)
def test_expert_ids_are_checked_before_writing(gen, tmp_path, ids, experts, message):
    """Before issue 54 the converter wrote everything, then its self-check looped up to the claimed count or the
    largest id (10**12: never answered)."""
    src = write_source(tmp_path / "src", _renumbered(gen, ids), config={**CONFIG, "num_local_experts": experts})
    start = time.monotonic()
    with pytest.raises(ConversionError, match=message):
        convert_checkpoint(src, tmp_path / "out", progress=False)
    assert time.monotonic() - start < 30 and not (tmp_path / "out").exists()


def test_meta_device_is_refused_by_name(gen, tmp_path, capsys):
    src = write_source(tmp_path / "src", expert_weights(gen))
    assert main(["convert", str(src), str(tmp_path / "out"), "--device", "meta", "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        "moe-nvfp4 convert: error: --device meta: a meta device holds shapes, not values, so nothing "
        "could be quantized; use cpu or a GPU (e.g. cuda)"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_output_files_follow_the_umask(gen, tmp_path, umask):
    """safetensors creates its files 0600 whatever the umask: a server running as another user could not read them."""
    src = write_source(tmp_path / "src", expert_weights(gen))
    old = os.umask(umask)
    try:
        convert_checkpoint(src, tmp_path / "out", ConvertOptions(max_shard_bytes=4096), progress=False)
    finally:
        os.umask(old)
    shards = sorted((tmp_path / "out").glob("*.safetensors"))
    assert len(shards) > 1
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask


def test_many_warnings_are_cut_to_a_count(gen, tmp_path):
    """An outlier in every expert (each zeroes most of its expert's values): the summary shows WARNINGS_SHOWN
    of them and counts the rest; ConvertSummary.warnings keeps every one."""
    ids = list(range(WARNINGS_SHOWN + 3))
    tensors = _renumbered(gen, ids)
    for e in ids:
        tensors[f"{PREFIX}.{e}.w3.weight"][0, 0] = 1e8
    src = write_source(tmp_path / "src", tensors, config={**CONFIG, "num_local_experts": len(ids)})
    summary = convert_checkpoint(src, tmp_path / "out", progress=False)
    text = str(summary)
    assert len(summary.warnings) == 2 * len(ids)  # w1 and w3 of each expert share the outlier's global scale
    assert text.count("  warning: ") == WARNINGS_SHOWN
    assert f"... and {2 * len(ids) - WARNINGS_SHOWN} more warnings like these" in text


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"moe-nvfp4 {__version__} (torch {torch.__version__}, python ")


_SLOW_CLI_CONVERT = SLOW_CONVERTER + (
    'from moe_nvfp4.cli import main\nsys.exit(main(["convert", sys.argv[1], sys.argv[2], "--quiet"]))\n'
)


def test_ctrl_c_in_convert_is_one_line_and_removes_the_partial_output(gen, tmp_path):
    src = write_source(tmp_path / "src", expert_weights(gen))
    out, converting = tmp_path / "out", tmp_path.parent / f"{tmp_path.name}.converting-cli"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLI_CONVERT, str(src), str(out), str(converting)],
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not converting.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert converting.exists() and list(tmp_path.glob(".out.tmp-*")), "the converter never started writing"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    converting.unlink()
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    assert err.strip() == "moe-nvfp4 convert: interrupted (Ctrl-C); the partial output was removed", err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
