"""DP attention + expert parallelism against TP=1, as a user serves it: ``vllm serve --data-parallel-size 2
--enable-expert-parallel --quantization nvfp4_grouped`` on two GPUs must give the greedy tokens of a one-GPU server
on the same tiny NVFP4 checkpoint (issue 57).

    CUDA_VISIBLE_DEVICES=0,1 python benchmarks/dp_ep_check.py                       # DeepSeek-V3 and Qwen3-MoE
    CUDA_VISIBLE_DEVICES=0,1 python benchmarks/dp_ep_check.py --families qwen3_moe --all2all allgather_reducescatter

Per family: a tiny BF16 model built locally (tests/helpers_checkpoints.py, no download) and converted by our
converter (ModelOpt form, separate gate/up scales); a TP=1 server, then the DP=2 + EP server (each all2all backend
given, ``--all2all-backend``), each answering the same greedy requests concurrently (token-id prompts, logprobs
5).  Answers may differ only at a tie (the first answer's top-2 log-probabilities within ``--tie``: DP batches
tokens differently, so sums round in another order); any other divergence fails.  The DP server's log must show
our experts inside vLLM's modular kernel (``modular.make_moe_kernel``'s line), i.e. vLLM's all2all drove them.

Every server runs with the settings for hosts without NVLink multicast, always (docs/vllm-plugin.md):
VLLM_FLASHINFER_ALLREDUCE_BACKEND=trtllm, NCCL_NVLS_ENABLE=0 and ``--compilation-config
'{"pass_config": {"fuse_allreduce_rms": false}}'``.  Exits 0 and prints ``DP=2+EP matches TP=1`` per family and
backend when every answer agrees; 1 otherwise.  Logs go to --log-dir.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers_checkpoints import VOCAB, make_tiny_checkpoint, write_word_tokenizer  # noqa: E402
from helpers_engine import VllmServer, free_port, greedy_divergence  # noqa: E402

NO_MULTICAST_ENV = {"VLLM_FLASHINFER_ALLREDUCE_BACKEND": "trtllm", "NCCL_NVLS_ENABLE": "0"}
NO_MULTICAST_COMPILATION = json.dumps({"pass_config": {"fuse_allreduce_rms": False}})
MODULAR_LINE = "nvfp4_grouped: our experts in vLLM's modular kernel"  # modular.make_moe_kernel logs it
MODEL_NAME = "tiny"
START_S = 900.0


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--families", default="deepseek_v3,qwen3_moe", help="tiny model families (helpers_checkpoints)")
    p.add_argument(
        "--all2all",
        default="allgather_reducescatter",
        help="comma list of --all2all-backend values for the DP server (deepep_low_latency and "
        "deepep_high_throughput need DeepEP installed)",
    )
    p.add_argument("--requests", type=int, default=64, help="greedy requests per server")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--tie", type=float, default=0.1, help="top-2 log-probability gap counted as a tie")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    return p.parse_args(argv)


def build_model(family: str, root: Path) -> Path:
    from moe_nvfp4.convert import ConvertOptions, QuantSettings, convert_checkpoint

    src = make_tiny_checkpoint(family, root / f"{family}-bf16", seed=3)
    write_word_tokenizer(src, VOCAB)
    out = root / f"{family}-nvfp4"
    convert_checkpoint(src, out, ConvertOptions(settings=QuantSettings(separate_gate_up_scales=True)), progress=False)
    return out


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(57)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 24))] for _ in range(n)]


def complete(base_url: str, prompt: list[int], max_tokens: int) -> dict:
    body = dict(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        logprobs=5,
        return_tokens_as_token_ids=True,
    )
    request = urllib.request.Request(
        f"{base_url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())


def serve_and_ask(model: Path, extra: list[str], log: Path, args, env: dict) -> tuple[list[dict], str]:
    serve_args = [
        str(model),
        "--quantization",
        "nvfp4_grouped",
        "--served-model-name",
        MODEL_NAME,
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        str(args.concurrency),
        "--gpu-memory-utilization",
        "0.3",
        "--max-logprobs",
        "5",
        "--seed",
        "0",
        "--compilation-config",
        NO_MULTICAST_COMPILATION,
        *extra,
    ]
    with VllmServer(serve_args, port=free_port(), log_path=log, env=env) as server:
        seconds = server.start(START_S)
        print(f"   {' '.join(extra) or 'TP=1'}: healthy after {seconds:.0f} s", flush=True)
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(pool.map(lambda p: complete(server.base_url, p, args.max_tokens), prompts(args.requests)))
        server.stop(60.0)
        return answers, server.log()


def check_family(family: str, args, env: dict, root: Path, logs: Path) -> list[str]:
    """One family's TP=1 server against a DP=2 + EP server per all2all backend: what differs (empty: all agree)."""
    print(f"== {family}", flush=True)
    model = build_model(family, root)
    tp1, _ = serve_and_ask(model, [], logs / f"{family}-tp1.log", args, env)
    problems = []
    for backend in [b.strip() for b in args.all2all.split(",") if b.strip()]:
        extra = ["--data-parallel-size", "2", "--enable-expert-parallel", "--all2all-backend", backend]
        dp, log = serve_and_ask(model, extra, logs / f"{family}-dp2-ep-{backend}.log", args, env)
        found = [
            f"request {i}: {d}" for i, (a, b) in enumerate(zip(tp1, dp)) if (d := greedy_divergence(a, b, tie=args.tie))
        ]
        if MODULAR_LINE not in log:
            found.append(f"the DP server's log lacks {MODULAR_LINE!r}: vLLM's all2all did not drive our experts")
        if found:
            print(f"   FAIL {family} DP=2+EP ({backend}) vs TP=1:\n     " + "\n     ".join(found[:10]))
        else:
            print(f"   DP=2+EP matches TP=1: {family}, {backend}, {len(dp)} greedy requests", flush=True)
        problems += [f"{family} {backend}: {line}" for line in found]
    return problems


def server_env() -> dict[str, str]:
    """Every server's environment: no multicast, no autotune, this checkout's package and plugin first."""
    env = dict(os.environ, **NO_MULTICAST_ENV, MOE_NVFP4_AUTOTUNE="0", VLLM_USE_FLASHINFER_SAMPLER="0")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(REPO / "integrations"), env.get("PYTHONPATH", "")])
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    env = server_env()
    root = Path(tempfile.mkdtemp(prefix="dp_ep_check-"))
    logs = Path(args.log_dir) if args.log_dir else root / "logs"
    problems = []
    for family in [f.strip() for f in args.families.split(",") if f.strip()]:
        problems += check_family(family, args, env, root, logs)
    print(f"logs: {logs}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
