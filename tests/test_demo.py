"""`moe-nvfp4 demo`: runs end to end on CPU and prints the accuracy table."""
from __future__ import annotations

import re

from moe_nvfp4.cli import main

# Tolerance bounds of this file: the demo's own numbers (random Mixtral-like layer, two NVFP4 GEMMs in
# W4A16; measured rel. error ~0.16 and cosine ~0.987).
TOL = {"max_rel_error": 0.25, "min_cosine": 0.97}

ROW = re.compile(r"^\|\s*(NVFP4[^|]*?)\s*\|\s*([0-9.]+)\s*\|\s*([0-9.]+)\s*\|$")


def test_demo_prints_error_and_cosine(capsys, seed):
    assert main(["demo", "--tokens", "8", "--seed", str(seed % 2**31)]) == 0
    out = capsys.readouterr().out
    assert "rel. error" in out and "cosine" in out
    assert "T=8" in out
    lines = [line for line in out.splitlines() if line.startswith("|")]
    assert len({len(line) for line in lines}) == 1, "table columns must line up"
    rows = [m.groups() for m in map(ROW.match, out.splitlines()) if m]
    assert rows, out
    for name, rel, cos in rows:
        assert 0.0 < float(rel) < TOL["max_rel_error"], (name, rel)
        assert TOL["min_cosine"] < float(cos) <= 1.0, (name, cos)
    assert re.search(r"BF16 [0-9.]+ MiB -> NVFP4 [0-9.]+ MiB", out), out
