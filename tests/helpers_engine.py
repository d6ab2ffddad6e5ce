"""Run an engine subprocess until it has written its results file (tests/gpu/test_vllm_e2e.py); run ``vllm serve``
and check what it answers (tests/gpu/test_vllm_server.py, benchmarks/serve_bench.py).

The runner writes its results whole (write, then rename) once generation is done.  An engine that then
fails to shut down (vLLM 0.26.0 at TP=2 without NVLink multicast can hang in a symmetric-memory destructor)
gets ``exit_grace_s`` and is killed with a warning: the results are what the tests check.  The engine runs
in its own session, and its whole process group is killed on every way out, so no worker keeps the GPUs.

An engine that never writes its results is asked, before it is killed, which CUDA kernels are resident on
its GPUs (``cuda-gdb -p PID``, where cuda-gdb is installed): a GPU step that never finishes names its kernel
in the failure, which is how the TP=2 hang in vLLM's KV-cache write was found.

``MOE_NVFP4_ENGINE_LOGS=<dir>`` also writes each engine's stderr to ``<dir>/<tag>.log`` line by line, so it
survives a run that is killed from outside (a device call's time limit) before pytest reports anything.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import astuple, dataclass
from pathlib import Path

import pytest


KERNEL_ROW = re.compile(r"^\*?\s*\d+\s+\S+\s+\d+\s+\d+\s+\w+\s")  # `info cuda kernels`: Kernel Parent Dev Grid Status
MAX_ATTACHED = 4  # processes asked for their kernels (engine core and TP workers)


def process_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name: state, ppid, pgrp, ...; None once the process is gone.  A killed
    child not yet reaped shows state Z."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        fields = process_stat(int(entry.name))
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return sorted(pids)


def resident_cuda_kernels(pgid: int, timeout_s: float = 45.0) -> str:
    """``info cuda kernels`` of each live process in the group, one line per resident kernel, or why not."""
    gdb = shutil.which("cuda-gdb")
    if gdb is None:
        return "cuda-gdb not installed"
    report = []
    for pid in _group_pids(pgid)[:MAX_ATTACHED]:
        try:
            r = subprocess.run(
                [gdb, "-p", str(pid), "-batch", "-ex", "info cuda kernels", "-ex", "detach"],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            report.append(f"pid {pid}: cuda-gdb timed out after {timeout_s} s")
            continue
        rows = [line.strip() for line in r.stdout.splitlines() if KERNEL_ROW.match(line.strip())]
        report.extend(f"pid {pid}: {row}" for row in rows)
    return "\n".join(report) or "no resident CUDA kernels"


def run_until_written(
    cmd: list[str], env: dict[str, str], out: Path, *, tag: str, timeout_s: float, exit_grace_s: float
) -> str:
    """Start ``cmd``; return its stderr once ``out`` exists and the process has exited or was killed
    ``exit_grace_s`` later; ``pytest.fail`` with the stderr tail if ``out`` never appears (exit or ``timeout_s``)."""
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    stderr: list[str] = []  # read by a thread so a chatty engine cannot block on a full pipe
    log_dir = os.environ.get("MOE_NVFP4_ENGINE_LOGS")

    def read() -> None:
        if not log_dir:
            stderr.extend(proc.stderr)
            return
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(log_dir) / f"{tag}.log", "w", buffering=1) as log:  # line-buffered: kept if we are killed
            for line in proc.stderr:
                stderr.append(line)
                log.write(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    kernels = ""
    try:
        while proc.poll() is None and not out.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.wait(timeout=exit_grace_s if out.exists() else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        if out.exists():
            warnings.warn(f"{tag}: wrote its results but did not exit within {exit_grace_s} s; killed")
        else:
            kernels = f"\nresident CUDA kernels at the time limit:\n{resident_cuda_kernels(proc.pid)}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        reader.join(timeout=5)
    if not out.exists():
        pytest.fail(
            f"{tag}: no results (rc {proc.returncode}, limit {timeout_s} s):\n{''.join(stderr)[-6000:]}{kernels}"
        )
    if proc.returncode not in (0, -signal.SIGKILL):
        warnings.warn(f"{tag}: wrote its results, then exited with rc {proc.returncode}")
    return "".join(stderr)


# ---- an OpenAI-compatible vLLM server as a subprocess (tests/gpu/test_vllm_server.py, benchmarks/serve_bench.py) ----

VLLM_CLI = "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())"


def vllm_command() -> list[str]:
    """The ``vllm`` CLI: the console script where one is on PATH, else the same entry point through Python."""
    exe = shutil.which("vllm")
    return [exe] if exe else [sys.executable, "-c", VLLM_CLI]


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``vllm serve`` on 127.0.0.1:``port``, its stdout and stderr in ``log_path``; a context manager that always
    leaves no process of its group behind.

    ``start`` waits for ``/health`` to answer 200 and raises RuntimeError (with the log's tail) if the server
    exits or ``timeout_s`` passes first.  ``stop`` sends SIGINT, as Ctrl-C would, and returns the seconds the
    server took to exit, or None if it had to be killed after ``timeout_s``."""

    def __init__(self, serve_args: list[str], *, port: int, log_path: Path, env: dict[str, str]) -> None:
        self.cmd = vllm_command() + ["serve", *serve_args, "--host", "127.0.0.1", "--port", str(port)]
        self.port, self.log_path, self.env = port, Path(log_path), env
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, timeout_s: float) -> float:
        """Start and wait until healthy; return the seconds it took."""
        t0 = time.monotonic()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with rc {self.proc.returncode} before it was healthy:\n{self.log()[-6000:]}"
                )
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(1.0)
        self.kill()
        raise RuntimeError(f"vllm serve was not healthy after {timeout_s} s:\n{self.log()[-6000:]}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, timeout_s: float) -> float | None:
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        seconds = time.monotonic() - t0
        self.kill()  # workers the server left behind, if any
        return seconds

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def __enter__(self) -> "VllmServer":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


# Log lines a healthy server may print: vLLM 0.26 logs an ERROR line for each request naming an unknown model
# (``Error with model ...``, openai/chat_completion/serving.py) although it answers it with 404 as it should.
EXPECTED_ERROR_LINES = (re.compile(r"Error with model"),)
_BAD_LINE = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|\bCRITICAL\b|Exception in|illegal memory access")


def log_problems(log: str, expected: tuple[re.Pattern, ...] = EXPECTED_ERROR_LINES) -> list[str]:
    """Lines of a server log that report an error or a traceback, other than ``expected`` ones."""
    return [line for line in log.splitlines() if _BAD_LINE.search(line) and not any(p.search(line) for p in expected)]


# ---- the request mix and the checks of each answer ----


@dataclass(frozen=True)
class RequestSpec:
    """One request of the server test.  ``prompt`` is token ids (completions with an id prompt), words (a text
    completion) or chat messages; ``prompt_tokens`` is what the server must count for it; ``group`` names the
    greedy requests that must repeat each other (None for sampled requests)."""

    index: int
    endpoint: str  # "completions" | "chat"
    stream: bool
    prompt: list[int] | str | list[dict[str, str]]
    prompt_tokens: int
    max_tokens: int
    temperature: float
    logprobs: int | None = None
    group: str | None = None


PROMPT_LENS = (1, 3, 17, 64, 150)
OUTPUT_LENS = (1, 2, 7, 32, 96)
GREEDY_GROUPS = 4  # fixed prompts, each sent GREEDY_COPIES times across the run
GREEDY_COPIES = 4
GREEDY_MAX_TOKENS = 16
TOP_LOGPROBS = 2  # top-2 log-probabilities name the steps where greedy decoding is a tie


def request_mix(
    n: int, *, vocab: int, first_word: int, max_model_len: int, count_chat_tokens, seed: int = 0
) -> list[RequestSpec]:
    """``n`` requests: completions (token-id and text prompts) and chat, streamed and not, prompts of
    ``PROMPT_LENS`` tokens and outputs of ``OUTPUT_LENS``, greedy and sampled, in a shuffled order, plus
    ``GREEDY_GROUPS * GREEDY_COPIES`` greedy completions with log-probabilities that must repeat each other.

    Word ids run from ``first_word`` to ``vocab - 1``; ``count_chat_tokens(messages)`` is the prompt length the
    tokenizer's chat template gives; each request's prompt and output fit ``max_model_len``."""
    import random

    rng = random.Random(seed)
    copies = GREEDY_GROUPS * GREEDY_COPIES
    if n < copies + 4:
        raise ValueError(f"n must be at least {copies + 4} (the greedy groups and one of each kind), got {n}")

    def ids(k: int) -> list[int]:
        return [rng.randrange(first_word, vocab) for _ in range(k)]

    def text(k: int) -> str:
        return " ".join(f"w{i}" for i in ids(k))

    specs: list[RequestSpec] = []
    kinds = [("completions", "ids"), ("completions", "text"), ("chat", "messages")]
    for i in range(n - copies):
        endpoint, form = kinds[i % len(kinds)]
        stream = (i // len(kinds)) % 2 == 1
        plen = rng.choice(PROMPT_LENS)
        temperature = rng.choice((0.0, 0.8))
        if form == "ids":
            prompt, count = ids(plen), plen
        elif form == "text":
            prompt, count = text(plen), plen
        else:
            prompt = [{"role": "system", "content": text(max(1, plen // 4))}, {"role": "user", "content": text(plen)}]
            count = count_chat_tokens(prompt)
        olen = rng.choice([k for k in OUTPUT_LENS if count + k <= max_model_len])
        specs.append(RequestSpec(0, endpoint, stream, prompt, count, olen, temperature))
    for g in range(GREEDY_GROUPS):
        prompt = ids(rng.choice(PROMPT_LENS[1:]))
        for _ in range(GREEDY_COPIES):
            specs.append(
                RequestSpec(
                    0,
                    "completions",
                    False,
                    prompt,
                    len(prompt),
                    GREEDY_MAX_TOKENS,
                    0.0,
                    logprobs=TOP_LOGPROBS,
                    group=f"greedy{g}",
                )
            )
    rng.shuffle(specs)
    return [RequestSpec(i, *astuple(s)[1:]) for i, s in enumerate(specs)]


def request_body(spec: RequestSpec, model: str) -> dict:
    """The JSON body of one request (vLLM's extra sampling fields included)."""
    body = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "seed": spec.index,
        "stream": spec.stream,
        "ignore_eos": True,
    }
    if spec.stream:
        body["stream_options"] = {"include_usage": True}
    if spec.endpoint == "chat":
        body["messages"] = spec.prompt
    else:
        body["prompt"] = spec.prompt
    if spec.logprobs is not None:
        body["logprobs"] = spec.logprobs
        body["return_tokens_as_token_ids"] = True  # tokens as "token_id:N"
    return body


def _usage_problems(usage: dict | None, spec: RequestSpec) -> list[str]:
    if not usage:
        return ["no usage"]
    out = []
    if usage.get("completion_tokens") != spec.max_tokens:
        out.append(f"completion_tokens {usage.get('completion_tokens')}, requested {spec.max_tokens} (ignore_eos)")
    if usage.get("prompt_tokens") != spec.prompt_tokens:
        out.append(f"prompt_tokens {usage.get('prompt_tokens')}, expected {spec.prompt_tokens}")
    return out


def response_problems(spec: RequestSpec, response: dict | list[dict], *, vocab: int) -> list[str]:
    """What is wrong with the answer to ``spec``: a response body (dict) or, streamed, its chunks in order
    (each a dict; the last one carries the usage).  Empty when it is well formed with the requested counts."""
    chat = spec.endpoint == "chat"
    if spec.stream:
        chunks = response
        if not isinstance(chunks, list) or not chunks:
            return ["no chunks"]
        want = "chat.completion.chunk" if chat else "text_completion"
        out = [f"chunk {i}: object {c.get('object')!r}" for i, c in enumerate(chunks) if c.get("object") != want]
        if len({c.get("id") for c in chunks}) != 1:
            out.append("chunks carry different ids")
        finishes = [ch.get("finish_reason") for c in chunks for ch in c.get("choices", []) if ch.get("finish_reason")]
        if finishes != ["length"]:
            out.append(f"finish reasons {finishes}, expected one 'length'")
        pieces = [
            (ch.get("delta") or {}).get("content") if chat else ch.get("text")
            for c in chunks
            for ch in c.get("choices", [])
        ]
        if any(p is not None and not isinstance(p, str) for p in pieces):
            out.append("a chunk's text is not a string")
        if chunks[-1].get("choices"):
            out.append("the last chunk (usage) has choices")
        return out + _usage_problems(chunks[-1].get("usage"), spec)
    want = "chat.completion" if chat else "text_completion"
    out = [] if response.get("object") == want else [f"object {response.get('object')!r}, expected {want!r}"]
    choices = response.get("choices") or []
    if len(choices) != 1:
        return out + [f"{len(choices)} choices, expected 1"]
    choice = choices[0]
    if choice.get("finish_reason") != "length":
        out.append(f"finish_reason {choice.get('finish_reason')!r}, expected 'length'")
    content = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    if not isinstance(content, str):
        out.append(f"text is {type(content).__name__}, not a string")
    if chat and (choice.get("message") or {}).get("role") != "assistant":
        out.append("message role is not 'assistant'")
    if spec.logprobs is not None:
        try:
            tokens = greedy_tokens(response)
        except (KeyError, TypeError, ValueError) as e:
            out.append(f"log-probabilities unreadable: {e!r}")
        else:
            if len(tokens) != spec.max_tokens:
                out.append(f"{len(tokens)} log-prob tokens, requested {spec.max_tokens}")
            if any(not 0 <= t < vocab for t, _ in tokens):
                out.append("a token id outside the vocabulary")
    return out + _usage_problems(response.get("usage"), spec)


async def drive(
    base_url: str, model: str, specs: list[RequestSpec], bad: list[dict] = (), *, concurrency: int, timeout_s: float
) -> tuple[list, list]:
    """Send ``specs`` and the raw ``bad`` bodies through the ``openai`` client, ``concurrency`` at a time, within
    ``timeout_s``.  Returns the answers in order (a response dict, or a stream's chunk dicts) and, per bad body,
    the HTTP status it got (or "accepted")."""
    import asyncio

    from openai import APIStatusError, AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s)
    gate = asyncio.Semaphore(concurrency)

    async def good(spec: RequestSpec):
        body = request_body(spec, model)
        extra = {k: body.pop(k) for k in ("ignore_eos", "return_tokens_as_token_ids") if k in body}  # vLLM's fields
        create = client.chat.completions.create if spec.endpoint == "chat" else client.completions.create
        async with gate:
            result = await create(**body, extra_body=extra)
            if not spec.stream:
                return result.model_dump()
            return [chunk.model_dump() async for chunk in result]

    async def rejected(body: dict):
        endpoint = client.chat.completions if "messages" in body else client.completions
        async with gate:
            try:
                await endpoint.create(**body)
            except APIStatusError as e:
                return e.status_code
            return "accepted"

    async def everything():
        return await asyncio.gather(asyncio.gather(*map(good, specs)), asyncio.gather(*map(rejected, bad)))

    try:
        answers, statuses = await asyncio.wait_for(everything(), timeout_s)
    finally:
        await client.close()
    return list(answers), list(statuses)


def greedy_tokens(response: dict) -> list[tuple[int, dict[int, float]]]:
    """(token id, top log-probabilities by id) per step of a completion made with ``return_tokens_as_token_ids``."""
    lp = response["choices"][0]["logprobs"]
    as_id = lambda t: int(t.removeprefix("token_id:"))  # noqa: E731
    return [(as_id(t), {as_id(k): v for k, v in top.items()}) for t, top in zip(lp["tokens"], lp["top_logprobs"])]


def greedy_divergence(first: dict, other: dict, *, tie: float) -> str | None:
    """Where ``other`` departs from ``first`` (two greedy answers to one prompt) at a step that is not a tie, or
    None.  A tie: ``first``'s top-2 log-probabilities there are within ``tie`` (batch composition may round the
    other way); after one, the sequences are not comparable."""
    for step, ((a, top), (b, _)) in enumerate(zip(greedy_tokens(first), greedy_tokens(other))):
        if a == b:
            continue
        best = sorted(top.values(), reverse=True)
        if len(best) >= 2 and best[0] - best[1] <= tie:
            return None
        return (
            f"step {step}: token {b}, first answer {a} (top-2 margin {best[0] - best[1] if len(best) > 1 else 'n/a'})"
        )
    return None
