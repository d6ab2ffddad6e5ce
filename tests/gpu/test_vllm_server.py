"""``vllm serve DIR --quantization nvfp4_grouped`` under load, driven through the OpenAI API as users drive it.

The model: the tiny Qwen3-MoE of tests/helpers_checkpoints.py with a word-level tokenizer and a chat template made
offline (``write_word_tokenizer``), converted by our converter (which carries the tokenizer files over).  The
server runs as a subprocess on 127.0.0.1 and a free port, its log in a file; the ``openai`` client (in the vLLM
0.26 bundle) sends:

* ``N_REQUESTS`` requests, ``CONCURRENCY`` at a time: completions (token-id and text prompts) and chat, streamed
  and not, prompts of 1-150 tokens and outputs of 1-96, greedy and sampled, all with ``ignore_eos``.  Every answer
  must be well formed with exactly the requested completion tokens and the prompt's token count
  (``helpers_engine.response_problems``).  Four greedy prompts go out four times each across the run, with top-2
  log-probabilities: every copy must give the first copy's tokens up to a tie (top-2 within ``TIE``; another
  batch composition may round the other way there).
* bad requests among ``BAD_LOAD`` good ones: a prompt longer than the model, negative ``max_tokens``, an unknown
  model, token ids outside the vocabulary; each must be answered 4xx, the good ones as above, and the server
  must stay healthy.
* then SIGINT: the server must exit within ``SHUTDOWN_S`` and its log must hold no error line or traceback
  (``helpers_engine.log_problems``).

Bounded: the server start (``START_S``), each load (``LOAD_S``) and the shutdown; about 2-3 minutes on an H100.
Run: ``python -m pytest -q -m gpu tests/gpu/test_vllm_server.py`` after ``pip install -e .`` (the server finds the
plugin through its entry point).
"""

from __future__ import annotations

import asyncio
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_engine import (  # noqa: E402
    RequestSpec,
    VllmServer,
    drive,
    free_port,
    greedy_divergence,
    log_problems,
    request_mix,
    response_problems,
)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny-qwen3-moe-nvfp4"
MAX_MODEL_LEN = 256
N_REQUESTS = 256
CONCURRENCY = 64
BAD_LOAD = 32  # good requests sent alongside the bad ones
TIE = 0.1  # top-2 log-probability margin under which two greedy answers may part (2 x test_vllm_e2e's LOGPROB_ATOL)
START_S = 600  # engine start: load, torch.compile, CUDA graphs, our kernel warm-up
LOAD_S = 300
SHUTDOWN_S = 60
STATE: dict[str, float] = {}  # the server start time, reported by the shutdown test


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, tokenizer): the converted tiny model behind ``vllm serve``; stopped by the last test or at exit."""
    from helpers_checkpoints import VOCAB, make_tiny_checkpoint, write_word_tokenizer

    from moe_nvfp4.convert import ConvertOptions, QuantSettings, convert_checkpoint

    if "nvfp4_grouped" not in {ep.name for ep in entry_points(group="vllm.general_plugins")}:
        pytest.fail("vllm serve finds nvfp4_grouped through its entry point: run `pip install -e .` first")
    root = tmp_path_factory.mktemp("vllm_server")
    src = make_tiny_checkpoint("qwen3_moe", root / "bf16", seed=2)
    tokenizer = write_word_tokenizer(src, VOCAB)
    model = root / "nvfp4"
    convert_checkpoint(src, model, ConvertOptions(settings=QuantSettings(separate_gate_up_scales=True)), progress=False)
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", MOE_NVFP4_AUTOTUNE="0")  # no JIT build, no tuning
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "integrations"), env.get("PYTHONPATH", "")])
    args = [
        str(model),
        "--quantization",
        "nvfp4_grouped",
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(CONCURRENCY),
        "--seed",
        "0",
        "--gpu-memory-utilization",
        "0.3",
        "--max-logprobs",
        "5",
    ]
    log = Path(os.environ.get("MOE_NVFP4_ENGINE_LOGS", root)) / "vllm-serve.log"
    with VllmServer(args, port=free_port(), log_path=log, env=env) as server:
        STATE["start_s"] = server.start(START_S)
        yield server, tokenizer


def _run(server: VllmServer, specs: list[RequestSpec], bad: list[dict] = ()) -> tuple[list, list]:
    return asyncio.run(drive(server.base_url, MODEL_NAME, specs, bad, concurrency=CONCURRENCY, timeout_s=LOAD_S))


def _mix(tokenizer, n: int, seed: int) -> list[RequestSpec]:
    from helpers_checkpoints import SPECIAL_TOKENS, VOCAB

    def count_chat_tokens(messages):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    return request_mix(
        n,
        vocab=VOCAB,
        first_word=len(SPECIAL_TOKENS),
        max_model_len=MAX_MODEL_LEN,
        count_chat_tokens=count_chat_tokens,
        seed=seed,
    )


def test_mixed_load_is_well_formed_and_greedy_repeats(served):
    from helpers_checkpoints import VOCAB

    server, tokenizer = served
    specs = _mix(tokenizer, N_REQUESTS, seed=0)
    answers, _ = _run(server, specs)
    problems = [
        f"request {s.index} ({s.endpoint}, stream={s.stream}): {p}"
        for s, a in zip(specs, answers)
        for p in response_problems(s, a, vocab=VOCAB)
    ]
    assert not problems, "\n".join(problems[:20])
    groups: dict[str, list[dict]] = {}
    for s, a in zip(specs, answers):
        if s.group:
            groups.setdefault(s.group, []).append(a)
    assert len(groups) >= 2 and all(len(g) >= 2 for g in groups.values()), groups.keys()
    parted = [
        f"{name} copy {i}: {d}"
        for name, g in groups.items()
        for i, other in enumerate(g[1:], 1)
        if (d := greedy_divergence(g[0], other, tie=TIE))
    ]
    assert not parted, "\n".join(parted)


def test_bad_requests_get_4xx_while_the_server_keeps_serving(served):
    from helpers_checkpoints import VOCAB

    server, tokenizer = served
    too_long = list(range(10, 10 + MAX_MODEL_LEN + 8))
    bad = [
        {"model": MODEL_NAME, "prompt": too_long, "max_tokens": 4},  # longer than the model
        {
            "model": MODEL_NAME,
            "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in too_long)}],
            "max_tokens": 4,
        },
        {"model": MODEL_NAME, "prompt": [10, 11, 12], "max_tokens": -1},  # negative max_tokens
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "w10"}], "max_tokens": -5},
        {"model": "no-such-model", "prompt": [10, 11, 12], "max_tokens": 4},  # unknown model
        {"model": "no-such-model", "messages": [{"role": "user", "content": "w10"}], "max_tokens": 4},
        {"model": MODEL_NAME, "prompt": [10, 11, VOCAB + 7], "max_tokens": 4},  # out of the vocabulary
        {"model": MODEL_NAME, "prompt": [VOCAB * 1000], "max_tokens": 4},
    ]
    specs = _mix(tokenizer, BAD_LOAD, seed=1)
    answers, statuses = _run(server, specs, bad * 2)
    wrong = [(body, s) for body, s in zip(bad * 2, statuses) if not (isinstance(s, int) and 400 <= s < 500)]
    assert not wrong, f"bad requests not answered 4xx: {wrong}"
    problems = [p for s, a in zip(specs, answers) for p in response_problems(s, a, vocab=VOCAB)]
    assert not problems, "\n".join(problems[:20])
    assert server.healthy(), "the server is not healthy after the bad requests"
    after, _ = _run(server, specs[:4])  # and it still answers
    assert not [p for s, a in zip(specs[:4], after) for p in response_problems(s, a, vocab=VOCAB)]


def test_sigint_shuts_down_within_bound_and_the_log_is_clean(served):
    server, _ = served
    seconds = server.stop(SHUTDOWN_S)
    log = server.log()
    assert seconds is not None, f"vllm serve did not exit within {SHUTDOWN_S} s of SIGINT:\n{log[-4000:]}"
    problems = log_problems(log)
    assert not problems, "server log reports errors:\n" + "\n".join(problems[:30]) + f"\n...\n{log[-3000:]}"
    print(f"vllm serve: healthy after {STATE.get('start_s', float('nan')):.0f} s, exited {seconds:.1f} s after SIGINT")
