"""CPU checks of what the serving GPU tests stand on: the offline word-level tokenizer, the tiny DeepSeek-V3
checkpoint and its conversion, the server test's request mix, and its answer and log checks fed canned answers
(each defect the checks exist for must be reported; a well-formed answer must pass)."""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers_checkpoints import (  # noqa: E402
    DEEPSEEK_EXPERTS,
    DEEPSEEK_LAYERS,
    DEEPSEEK_ROUTED_SCALING,
    SPECIAL_TOKENS,
    VOCAB,
    make_tiny_checkpoint,
    write_word_tokenizer,
)
from helpers_engine import (  # noqa: E402
    GREEDY_COPIES,
    GREEDY_GROUPS,
    RequestSpec,
    free_port,
    greedy_divergence,
    log_problems,
    request_body,
    request_mix,
    response_problems,
)

FIRST_WORD = len(SPECIAL_TOKENS)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_word_tokenizer(d, VOCAB)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d))  # as vLLM loads it


def _count_chat(tok):
    def count(messages):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count


# ---- tokenizer ----


def test_word_tokenizer_round_trips_ids_and_renders_chat(tokenizer):
    assert len(tokenizer) == VOCAB
    ids = [FIRST_WORD, 17, VOCAB - 1]
    text = " ".join(f"w{i}" for i in ids)
    assert tokenizer(text)["input_ids"] == ids  # no BOS/EOS added: n words are n prompt tokens
    assert tokenizer.decode(ids) == text
    assert tokenizer("w99999")["input_ids"] == [0]  # unknown word -> <unk>
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "w10"}, {"role": "user", "content": "w11 w12"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    role = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    assert tokenizer(rendered, add_special_tokens=False)["input_ids"] == [
        role["<|system|>"],
        10,
        role["<|user|>"],
        11,
        12,
        role["<|assistant|>"],
    ]


def test_word_tokenizer_needs_room_for_words(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        write_word_tokenizer(tmp_path, len(SPECIAL_TOKENS))


# ---- DeepSeek-V3 tiny checkpoint and conversion ----


def test_deepseek_v3_tiny_checkpoint_converts_with_its_routing_intact(tmp_path):
    """Routed experts quantized, everything else (MLA, the dense first layer, the shared expert, the router and
    its correction bias) left as it was; vLLM's DeepSeek fields kept in config.json."""
    import torch
    from safetensors import safe_open

    from moe_nvfp4.convert import ConvertOptions, QuantSettings, convert_checkpoint

    src = make_tiny_checkpoint("deepseek_v3", tmp_path / "bf16", seed=3)
    out = tmp_path / "nvfp4"
    convert_checkpoint(src, out, ConvertOptions(settings=QuantSettings(separate_gate_up_scales=True)), progress=False)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["topk_method"], cfg["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert cfg["routed_scaling_factor"] == DEEPSEEK_ROUTED_SCALING != 1
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["first_k_dense_replace"], cfg["n_shared_experts"]) == (
        512,
        64,
        1,
        1,
    )

    def tensors(d):
        t = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                t.update({k: h.get_tensor(k) for k in h.keys()})
        return t

    before, after = tensors(src), tensors(out)
    moe_layers = range(1, DEEPSEEK_LAYERS)
    scale_2 = sorted(k for k in after if k.endswith(".weight_scale_2"))
    assert scale_2 == sorted(
        f"model.layers.{layer}.mlp.experts.{e}.{p}.weight_scale_2"
        for layer in moe_layers
        for e in range(DEEPSEEK_EXPERTS)
        for p in ("gate_proj", "up_proj", "down_proj")
    )
    for name, t in before.items():
        if ".experts." not in name:
            assert torch.equal(after[name], t), f"{name} changed by the conversion"
    bias = before["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().max() > 0 and bias.unique().numel() > 1  # a bias that reorders experts, not HF's zeros
    ignore = set(cfg["quantization_config"]["ignore"])
    assert {
        "model.layers.0.mlp.gate_proj",
        "model.layers.1.mlp.shared_experts.down_proj",
        "model.layers.1.self_attn.kv_a_proj_with_mqa",
        "model.layers.2.mlp.gate",
        "lm_head",
    } <= ignore
    assert not any(".experts." in m and "shared_experts" not in m for m in ignore)


# ---- the request mix ----


def test_request_mix_covers_every_kind_and_counts_prompt_tokens(tokenizer):
    count = _count_chat(tokenizer)
    specs = request_mix(256, vocab=VOCAB, first_word=FIRST_WORD, max_model_len=256, count_chat_tokens=count, seed=5)
    assert len(specs) == 256 and [s.index for s in specs] == list(range(256))
    kinds = {(s.endpoint, s.stream, type(s.prompt).__name__) for s in specs}
    assert {
        ("completions", False, "list"),
        ("completions", True, "str"),
        ("chat", True, "list"),
        ("chat", False, "list"),
    } <= kinds
    assert {s.temperature for s in specs} == {0.0, 0.8}
    assert len({s.max_tokens for s in specs}) >= 4 and len({s.prompt_tokens for s in specs}) >= 4
    for s in specs:
        assert s.prompt_tokens + s.max_tokens <= 256, s  # fits the server's max_model_len
        if isinstance(s.prompt, str):
            assert len(tokenizer(s.prompt)["input_ids"]) == s.prompt_tokens
        elif s.endpoint == "completions":
            assert len(s.prompt) == s.prompt_tokens and all(FIRST_WORD <= i < VOCAB for i in s.prompt)
    groups = {}
    for s in specs:
        if s.group:
            groups.setdefault(s.group, []).append(s)
    assert len(groups) == GREEDY_GROUPS and all(len(g) == GREEDY_COPIES for g in groups.values())
    assert all(
        s.temperature == 0.0 and s.logprobs and len({json.dumps(x.prompt) for x in g}) == 1
        for g in groups.values()
        for s in g
    )
    again = request_mix(256, vocab=VOCAB, first_word=FIRST_WORD, max_model_len=256, count_chat_tokens=count, seed=5)
    assert again == specs


def test_request_body_carries_vllm_fields():
    spec = RequestSpec(3, "completions", True, [7, 8], 2, 5, 0.0, logprobs=2, group="g")
    body = request_body(spec, "m")
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    assert body["return_tokens_as_token_ids"] is True and body["logprobs"] == 2 and body["prompt"] == [7, 8]
    chat = request_body(RequestSpec(0, "chat", False, [{"role": "user", "content": "w7"}], 4, 1, 0.8), "m")
    assert "prompt" not in chat and "stream_options" not in chat and chat["messages"][0]["content"] == "w7"


# ---- answer checks on canned answers ----

COMPLETION = RequestSpec(0, "completions", False, [7, 8, 9], 3, 2, 0.0, logprobs=2)
GOOD_COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "text": " w9 w10",
            "finish_reason": "length",
            "logprobs": {
                "tokens": ["token_id:9", "token_id:10"],
                "token_logprobs": [-1.0, -2.0],
                "top_logprobs": [{"token_id:9": -1.0, "token_id:11": -1.5}, {"token_id:10": -2.0, "token_id:12": -2.5}],
            },
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}
CHAT = RequestSpec(1, "chat", False, [{"role": "user", "content": "w7"}], 3, 2, 0.8)
GOOD_CHAT = {
    "id": "chat-1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "w9 w10"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}
STREAM = RequestSpec(2, "chat", True, [{"role": "user", "content": "w7"}], 3, 2, 0.0)
GOOD_STREAM = [
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"delta": {"role": "assistant", "content": ""}}],
        "usage": None,
    },
    {"id": "c", "object": "chat.completion.chunk", "choices": [{"delta": {"content": "w9"}, "finish_reason": None}]},
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"delta": {"content": " w10"}, "finish_reason": "length"}],
    },
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    },
]


def _broken(answer, edit):
    a = copy.deepcopy(answer)
    edit(a)
    return a


@pytest.mark.parametrize("spec,answer", [(COMPLETION, GOOD_COMPLETION), (CHAT, GOOD_CHAT), (STREAM, GOOD_STREAM)])
def test_well_formed_answers_pass(spec, answer):
    assert response_problems(spec, answer, vocab=VOCAB) == []


@pytest.mark.parametrize(
    "spec,answer,edit,expect",
    [
        (COMPLETION, GOOD_COMPLETION, lambda a: a["usage"].update(completion_tokens=1), "completion_tokens 1"),
        (COMPLETION, GOOD_COMPLETION, lambda a: a["usage"].update(prompt_tokens=4), "prompt_tokens 4"),
        (COMPLETION, GOOD_COMPLETION, lambda a: a["choices"][0].update(finish_reason="stop"), "finish_reason"),
        (COMPLETION, GOOD_COMPLETION, lambda a: a.pop("usage"), "no usage"),
        (COMPLETION, GOOD_COMPLETION, lambda a: a["choices"][0].update(text=None), "not a string"),
        (COMPLETION, GOOD_COMPLETION, lambda a: a["choices"].append(a["choices"][0]), "2 choices"),
        (COMPLETION, GOOD_COMPLETION, lambda a: a["choices"][0]["logprobs"]["tokens"].pop(), "1 log-prob tokens"),
        (
            COMPLETION,
            GOOD_COMPLETION,
            lambda a: a["choices"][0]["logprobs"].update(tokens=["token_id:9", "token_id:999"]),
            "outside the vocabulary",
        ),
        (COMPLETION, GOOD_COMPLETION, lambda a: a["choices"][0]["logprobs"].update(tokens=["w9", "w10"]), "unreadable"),
        (CHAT, GOOD_CHAT, lambda a: a.update(object="text_completion"), "object"),
        (CHAT, GOOD_CHAT, lambda a: a["choices"][0]["message"].update(role="user"), "role"),
        (STREAM, GOOD_STREAM, lambda a: a.pop(), "no usage"),
        (STREAM, GOOD_STREAM, lambda a: a[2]["choices"][0].update(finish_reason=None), "finish reasons []"),
        (STREAM, GOOD_STREAM, lambda a: a[1].update(id="other"), "different ids"),
        (STREAM, GOOD_STREAM, lambda a: a[3]["usage"].update(completion_tokens=3), "completion_tokens 3"),
        (STREAM, GOOD_STREAM, lambda a: a[1].update(object="text_completion"), "chunk 1: object"),
    ],
)
def test_each_defect_is_reported(spec, answer, edit, expect):
    problems = response_problems(spec, _broken(answer, edit), vocab=VOCAB)
    assert any(expect in p for p in problems), problems


def test_greedy_divergence_allows_ties_only():
    assert greedy_divergence(GOOD_COMPLETION, GOOD_COMPLETION, tie=0.1) is None
    parted = _broken(GOOD_COMPLETION, lambda a: a["choices"][0]["logprobs"]["tokens"].__setitem__(1, "token_id:12"))
    assert "step 1" in greedy_divergence(GOOD_COMPLETION, parted, tie=0.1)  # margin 0.5: not a tie
    assert greedy_divergence(GOOD_COMPLETION, parted, tie=0.5) is None  # within the tie margin


def test_log_problems_flags_errors_but_not_the_unknown_model_line():
    clean = "INFO 11-26 22:00:01 [api_server.py:1] Starting vLLM API server\nINFO ... 200 OK"
    assert log_problems(clean) == []
    assert log_problems("ERROR 11-26 22:00:02 [serving.py:228] Error with model error=ErrorInfo(code=404)") == []
    bad = "Traceback (most recent call last):\n  File 'x'\nERROR 11-26 [core.py:1] EngineCore failed"
    assert len(log_problems(clean + "\n" + bad)) == 2


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


# ---- the client plumbing against a fake OpenAI server (the SDK's answers are what the checks read) ----


class _FakeVllm(BaseHTTPRequestHandler):
    """Answers /v1/completions and /v1/chat/completions as vLLM's server does, as far as the checks look: exact
    counts when ``ignore_eos`` arrives (else it stops early, as EOS would), 4xx for the server test's bad requests,
    server-sent events for streams.  ``count_chat`` is the chat template's prompt length."""

    count_chat = None
    max_model_len = 256

    def log_message(self, *args):  # keep pytest's output clean
        pass

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path.endswith("/chat/completions")
        if body.get("model") != "m":
            return self._json(404, {"error": {"message": "model does not exist", "type": "NotFoundError", "code": 404}})
        prompt = body["messages"] if chat else body["prompt"]
        n_prompt = (
            type(self).count_chat(prompt) if chat else len(prompt) if isinstance(prompt, list) else len(prompt.split())
        )
        ids = prompt if isinstance(prompt, list) and not chat else [n_prompt]
        if body.get("max_tokens", 16) < 1 or n_prompt >= self.max_model_len or any(i >= VOCAB for i in ids):
            return self._json(400, {"error": {"message": "bad request", "type": "BadRequestError", "code": 400}})
        n = body["max_tokens"] if body.get("ignore_eos") else 1
        tokens = [FIRST_WORD + (sum(ids) + k) % (VOCAB - FIRST_WORD) for k in range(n)]
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}
        finish = "length" if n == body["max_tokens"] else "stop"
        kind = "chat.completion" if chat else "text_completion"
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for k, t in enumerate(tokens):
                piece = {"delta": {"content": f" w{t}"}} if chat else {"text": f" w{t}"}
                choice = {"index": 0, **piece, "finish_reason": finish if k == n - 1 else None}
                chunk = {
                    "id": "x",
                    "object": f"{kind}.chunk" if chat else kind,
                    "created": 0,
                    "model": "m",
                    "choices": [choice],
                }
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            last = {
                "id": "x",
                "object": f"{kind}.chunk" if chat else kind,
                "created": 0,
                "model": "m",
                "choices": [],
                "usage": usage,
            }
            self.wfile.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
            return None
        text = "".join(f" w{t}" for t in tokens)
        choice = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            name = (lambda t: f"token_id:{t}") if body.get("return_tokens_as_token_ids") else (lambda t: f"w{t}")
            choice.update(
                text=text,
                logprobs=None
                if body.get("logprobs") is None
                else {
                    "tokens": [name(t) for t in tokens],
                    "token_logprobs": [-1.0] * n,
                    "text_offset": list(range(n)),
                    "top_logprobs": [{name(t): -1.0, name(t + 1): -1.5} for t in tokens],
                },
            )
        return self._json(
            200, {"id": "x", "object": kind, "created": 0, "model": "m", "choices": [choice], "usage": usage}
        )


@pytest.fixture
def fake_server(tokenizer):
    handler = type("Handler", (_FakeVllm,), {"count_chat": staticmethod(_count_chat(tokenizer))})
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def test_client_drives_a_server_and_the_checks_read_what_it_answers(fake_server, tokenizer):
    """The server test's pipeline end to end on the CPU: the openai client's answers, turned into dicts, pass the
    checks when the server is right; bad bodies come back as their status codes."""
    pytest.importorskip("openai")
    from helpers_engine import drive

    url, _ = fake_server
    specs = request_mix(
        48, vocab=VOCAB, first_word=FIRST_WORD, max_model_len=256, count_chat_tokens=_count_chat(tokenizer), seed=7
    )
    bad = [
        {"model": "m", "prompt": list(range(10, 300)), "max_tokens": 4},
        {"model": "m", "prompt": [10], "max_tokens": -1},
        {"model": "nope", "messages": [{"role": "user", "content": "w10"}], "max_tokens": 4},
        {"model": "m", "prompt": [10, VOCAB + 7], "max_tokens": 4},
    ]
    answers, statuses = asyncio.run(drive(url, "m", specs, bad, concurrency=8, timeout_s=60))
    assert statuses == [400, 400, 404, 400]
    problems = [(s.index, p) for s, a in zip(specs, answers) for p in response_problems(s, a, vocab=VOCAB)]
    assert problems == []
    greedy = [a for s, a in zip(specs, answers) if s.group == "greedy0"]
    assert len(greedy) == GREEDY_COPIES and all(greedy_divergence(greedy[0], g, tie=0.1) is None for g in greedy)


def test_checks_catch_a_server_that_drops_vllm_fields(fake_server, tokenizer, monkeypatch):
    """ignore_eos travels in extra_body; a server that never sees it stops early, and every answer says so."""
    pytest.importorskip("openai")
    import helpers_engine

    url, _ = fake_server
    real = helpers_engine.request_body
    monkeypatch.setattr(helpers_engine, "request_body", lambda spec, model: {**real(spec, model), "ignore_eos": False})
    specs = [
        s
        for s in request_mix(
            24, vocab=VOCAB, first_word=FIRST_WORD, max_model_len=256, count_chat_tokens=_count_chat(tokenizer), seed=8
        )
        if s.max_tokens > 1
    ]
    answers, _ = asyncio.run(helpers_engine.drive(url, "m", specs, concurrency=4, timeout_s=60))
    assert all(response_problems(s, a, vocab=VOCAB) for s, a in zip(specs, answers))
