"""The design records, the results index and the benchmarks' and tools' READMEs point at files that exist (CPU,
no torch).

A record's measurement is only as good as the pointer to its raw numbers: a result file renamed, moved to an
archive or deleted must fail here, not leave a dangling name in docs/design/.  Every backticked path-like token
(one with a '/' or a data-file ending, no spaces or placeholders) must name an existing file or folder, or match
one as a glob, relative to one of the bases below (records write `ab_x.jsonl.gz` for
benchmarks/results/archive/ab_x...) or to a folder named before it in the same record (`zoo/` then `models/`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASES = (
    ROOT,
    ROOT / "benchmarks" / "results",
    ROOT / "benchmarks" / "results" / "archive",
    ROOT / "benchmarks",
    ROOT / "moe_nvfp4",
    ROOT / "docs" / "design",
)
DOCS = (
    sorted((ROOT / "docs" / "design").glob("*.md"))
    + [ROOT / "benchmarks" / "results" / name for name in ("README.md", "probes_2026-11.md")]
    + [ROOT / "benchmarks" / "README.md", ROOT / "tools" / "README.md"]
)
DATA_ENDINGS = (".gz", ".jsonl", ".json", ".md", ".csv", ".txt", ".png", ".log")
CONFIG_FILES = sorted((ROOT / "configs").glob("*/*.json"))
DATE = re.compile(r"^2026-\d\d-\d\d$")


def _path_tokens(text: str) -> list[str]:
    """Backticked tokens that name a path: no spaces, assignments or placeholders, not absolute or home paths."""
    tokens = []
    for token in re.findall(r"`([^`\n]+)`", text):
        if any(c in token for c in " =<>$") or token.startswith(("/", "~", "-", ".")):
            continue
        token = token.split("::")[0]  # a pytest node id names its file
        if "/" in token or token.endswith(DATA_ENDINGS):
            tokens.append(token.rstrip(".,;:"))
    return tokens


def _resolve(token: str, bases: tuple[Path, ...] = BASES) -> Path | None:
    """The first existing path ``token`` names under ``bases`` (a glob: its first match), else None."""
    for base in bases:
        if any(c in token for c in "*?["):
            match = next(iter(sorted(base.glob(token.rstrip("/")))), None)
            if match is not None:
                return match
        elif (base / token).exists():
            return base / token
    return None


def _exists(token: str) -> bool:
    return _resolve(token) is not None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_record_names_exists(doc: Path) -> None:
    missing, folders = [], []
    for token in _path_tokens(doc.read_text()):
        found = _resolve(token, BASES + tuple(folders))
        if found is None:
            missing.append(token)
        elif found.is_dir():
            folders.append(found)
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_checker_catches_a_missing_file() -> None:
    tokens = _path_tokens("see `ab_never_written_h200.jsonl.gz` and `benchmarks/results/moe.md`, not `python a.py`")
    assert tokens == ["ab_never_written_h200.jsonl.gz", "benchmarks/results/moe.md"]
    assert [_exists(t) for t in tokens] == [False, True]


def test_tried_and_lost_rows_have_a_result_a_date_and_a_file() -> None:
    rows = [
        line
        for line in (ROOT / "docs" / "design" / "tried-and-lost.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| tried ")
    ]
    assert len(rows) > 40
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert len(cells) == 4, row
        tried, result, date, files = cells
        assert tried and result, row
        assert DATE.match(date), row
        assert _path_tokens(files) and all(_exists(t) for t in _path_tokens(files)), row


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_meta_is_data_with_one_pointer(path: Path) -> None:
    meta = json.loads(path.read_text())["meta"]
    assert set(meta) == {
        "kernel",
        "version",
        "device",
        "capability",
        "sm_count",
        "memory_gib",
        "torch",
        "triton",
        "date",
        "produced_by",
    }
    pointed = re.findall(r"(?:benchmarks|docs)/[\w./*-]+\w", meta["produced_by"])
    assert pointed and all(_exists(p) for p in pointed), pointed
    record = re.search(r"(docs/design/[\w.-]+\.md), section '([^']+)'", meta["produced_by"])
    assert record and f"### {record.group(2)}" in (ROOT / record.group(1)).read_text()
