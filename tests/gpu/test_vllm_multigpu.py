"""Tensor, expert and data parallel vLLM 0.26 engines with ``--quantization nvfp4_grouped`` on two GPUs.

TP=2 and EP=2 (``enable_expert_parallel=True`` at TP=2: each rank holds half the experts, whole) must give the
greedy tokens of TP=1 on the same converted checkpoint, for tiny Mixtral, Qwen3-MoE and DeepSeek-V3 models,
CUDA graphs on.  TP=2 sums partial expert outputs across ranks in another order, so tokens may differ only where
TP=1's top-2 log-probabilities are within 2 * LOGPROB_ATOL (a tie, after MIN_EQUAL_TOKENS equal tokens) and the
chosen tokens' log-probabilities must agree within LOGPROB_ATOL = 0.05 (``_compare`` of test_vllm_e2e.py).

Every engine here, TP=1 included, runs with the settings for hosts without NVLink multicast (docs/vllm-plugin.md,
"Hosts without NVLink multicast"): ``VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm``, ``NCCL_NVLS_ENABLE=0`` and
``compilation_config={"pass_config": {"fuse_allreduce_rms": False}}``, so no engine reaches FlashInfer's
``mnnvl`` all-reduce (an illegal address in the warm-up, then a hang, on such hosts).  Autotuning is off
(``MOE_NVFP4_AUTOTUNE=0``: each rank would spend up to 50 s; test_vllm_e2e.py covers it) and the token budget is
the model length, so each engine start stays near a minute.

DP=2 + EP (``test_dp2_ep_servers_match_tp1``): two ``vllm serve`` processes, TP=1 and ``--data-parallel-size 2
--enable-expert-parallel``, vLLM's all2all driving our experts as its modular experts stage (benchmarks/dp_ep_check.py).

Run: ``CUDA_VISIBLE_DEVICES=0,1 python -m pytest -q -m "gpu and multigpu" tests/gpu/test_vllm_multigpu.py -k FAMILY``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import dp_ep_check  # noqa: E402  (the DP=2 + EP servers and their check)
from test_vllm_e2e import _compare, _run_llm  # noqa: E402  (the same engine runner and comparison)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.multigpu]

FAMILIES = ["mixtral", "qwen3_moe", "deepseek_v3"]
# Always set, on every engine of this file: never let a test reach the multicast all-reduce.
NO_MULTICAST_ENV = dp_ep_check.NO_MULTICAST_ENV
NO_MULTICAST_ENGINE = {"compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}
ENV = {**NO_MULTICAST_ENV, "MOE_NVFP4_AUTOTUNE": "0"}
ENGINE = {**NO_MULTICAST_ENGINE, "max_num_batched_tokens": 256}  # = max_model_len: a short kernel warm-up
MODES = {"tp2": {}, "ep2": {"enable_expert_parallel": True}}  # extra engine arguments at TP=2


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Path]:
    """Per family: the tiny BF16 model converted by our converter (ModelOpt form, separate gate/up scales)."""
    from helpers_checkpoints import make_tiny_checkpoint

    from moe_nvfp4.convert import ConvertOptions, QuantSettings, convert_checkpoint

    root = tmp_path_factory.mktemp("vllm_multigpu")
    out = {}
    for family in FAMILIES:
        src = make_tiny_checkpoint(family, root / f"{family}-bf16", seed=1)
        out[family] = root / f"{family}-modelopt"
        convert_checkpoint(
            src, out[family], ConvertOptions(settings=QuantSettings(separate_gate_up_scales=True)), progress=False
        )
    return out


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_two_gpus_match_one(tmp_path, converted, family, mode):
    model = converted[family]
    tp1 = _run_llm(tmp_path, model, "nvfp4_grouped", tp=1, tag=f"{family}-mg-tp1", env_extra=ENV, engine=ENGINE)
    two = _run_llm(
        tmp_path,
        model,
        "nvfp4_grouped",
        tp=2,
        tag=f"{family}-mg-{mode}",
        env_extra=ENV,
        engine={**ENGINE, **MODES[mode]},
    )
    _compare(two, tp1, f"{family} {mode} vs TP=1")


@pytest.mark.parametrize("family", dp_ep_check.parse_args([]).families.split(","))
def test_dp2_ep_servers_match_tp1(tmp_path, family):
    """``vllm serve --data-parallel-size 2 --enable-expert-parallel``: vLLM's all2all drives our experts as its
    modular experts stage (the server log must say so) and 64 concurrent greedy requests agree with a TP=1 server
    but for ties (benchmarks/dp_ep_check.py, whose checks this runs)."""
    args = dp_ep_check.parse_args([])
    problems = dp_ep_check.check_family(family, args, dp_ep_check.server_env(), tmp_path, tmp_path / "logs")
    assert not problems, "\n".join(problems[:20])
