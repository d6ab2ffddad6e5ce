"""Shared test setup: marker auto-skips, fresh-but-reproducible random seeds, Hypothesis profile.

Markers (declared in pyproject.toml):
  gpu   skipped when ``torch.cuda.is_available()`` is False; run them with ``-m gpu`` on a GPU machine.
  vllm  skipped when ``import vllm`` fails.
  multigpu  skipped with fewer than ``MULTI_GPU`` CUDA devices (tensor / expert parallel engines).
  slow  never skipped; deselect with ``-m "not slow"`` when iterating.

Every run draws a new session seed (so CPU tests see fresh random inputs each time) and prints it in the
header; ``MOE_NVFP4_TEST_SEED=<seed>`` replays a run.  The ``gen`` fixture gives each test its own
``torch.Generator`` derived from that seed and the test's id, and a failing test reports its seed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import secrets

import pytest
import torch
from hypothesis import HealthCheck, settings

SEED_ENV = "MOE_NVFP4_TEST_SEED"
MULTI_GPU = 2

# Deadlines flake on a loaded 2-core CI machine; the examples database would litter the work tree.
settings.register_profile(
    "moe_nvfp4",
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "moe_nvfp4"))

_SESSION_SEED = int(os.environ[SEED_ENV]) if os.environ.get(SEED_ENV) else secrets.randbelow(2**31)


def _vllm_importable() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        import vllm  # noqa: F401
    except Exception:  # a broken install (wrong torch, missing CUDA libs) counts as absent
        return False
    return True


def pytest_report_header(config: pytest.Config) -> str:
    return f"moe_nvfp4 test seed: {_SESSION_SEED} (replay with {SEED_ENV}={_SESSION_SEED})"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    needs_gpu = [item for item in items if "gpu" in item.keywords]
    needs_vllm = [item for item in items if "vllm" in item.keywords]
    needs_gpus = [item for item in items if "multigpu" in item.keywords]
    if needs_gpus and torch.cuda.device_count() < MULTI_GPU:
        skip = pytest.mark.skip(reason=f"needs {MULTI_GPU} CUDA GPUs ({torch.cuda.device_count()} visible)")
        for item in needs_gpus:
            item.add_marker(skip)
    if needs_gpu and not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in needs_gpu:
            item.add_marker(skip)
    if needs_vllm and not _vllm_importable():
        skip = pytest.mark.skip(reason="needs vLLM (import vllm failed)")
        for item in needs_vllm:
            item.add_marker(skip)


def seed_for(nodeid: str) -> int:
    """The seed of one test: a hash of the session seed and the test id (stable under -k / -x)."""
    digest = hashlib.sha256(f"{_SESSION_SEED}:{nodeid}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    s = seed_for(request.node.nodeid)
    request.node.user_properties.append(("seed", s))
    return s


@pytest.fixture
def gen(seed: int) -> torch.Generator:
    """A CPU torch.Generator seeded for this test."""
    return torch.Generator().manual_seed(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        seeds = [v for k, v in item.user_properties if k == "seed"]
        if seeds:
            report.sections.append(
                ("random inputs", f"test seed {seeds[0]}; session seed {_SESSION_SEED} ({SEED_ENV}={_SESSION_SEED})")
            )
