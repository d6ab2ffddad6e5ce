"""Tiny random-weight HF MoE checkpoints (Mixtral, Qwen3-MoE) made with transformers, for converter/vLLM tests.

transformers 5.17 holds experts stacked in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, gate rows
first, and ``mlp.experts.down_proj`` ``[E, H, I]``) but ``save_pretrained`` writes the classic per-expert names
(Mixtral ``block_sparse_moe.experts.E.w1/w2/w3``, Qwen3-MoE ``mlp.experts.E.gate_proj/up_proj/down_proj``).
``stacked=True`` writes the in-memory ``state_dict`` instead, as a raw dump would.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch

Family = Literal["mixtral", "qwen3_moe"]

HIDDEN = 64
EXPERT_INTERMEDIATE = 64
EXPERTS = 4
TOP_K = 2
LAYERS = 2
VOCAB = 256
KV_HEADS = 2
# At least a warp's width per KV head: vLLM 0.26.0's reshape_and_cache_flash launches kv_heads_per_rank *
# head_dim threads per token, and its strided-heads path steps through heads by (threads // 32), so a rank
# with fewer than 32 threads loops forever.  Head dim 16 did that at TP=2 (one KV head of 16 per rank).
HEAD_DIM = 32


def tiny_config(family: Family):
    """The transformers config of the tiny model (hidden 64, 4 experts of intermediate 64, 2 layers, vocab 256,
    4 attention heads and 2 KV heads of dim 32)."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if family == "mixtral":
        return MixtralConfig(intermediate_size=EXPERT_INTERMEDIATE, num_local_experts=EXPERTS, **common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            intermediate_size=2 * EXPERT_INTERMEDIATE, moe_intermediate_size=EXPERT_INTERMEDIATE, num_experts=EXPERTS, **common
        )
    raise ValueError(f"family must be 'mixtral' or 'qwen3_moe', got {family!r}")


def kv_cache_threads_per_rank(config, tp: int) -> int:
    """Threads vLLM's reshape_and_cache_flash gives each token on one of ``tp`` ranks (KV heads are split, or
    replicated once there are more ranks than heads); under 32 it never finishes (see ``HEAD_DIM``)."""
    return max(1, config.num_key_value_heads // tp) * config.head_dim


def make_tiny_checkpoint(
    family: Family, out_dir: str | Path, *, shards: int = 1, seed: int = 0, stacked: bool = False
) -> Path:
    """Write a random BF16 model to ``out_dir`` (about ``shards`` safetensors shards) and return the path.

    Weights are drawn with std 0.02 like the HF initializer, so they resemble a real checkpoint's range.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family)).to(torch.bfloat16)
    if not stacked:
        total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        model.save_pretrained(out, max_shard_size=max(total // shards, 1) if shards > 1 else "5GB")
        return out
    _save_state_dict(model, out, shards)
    return out


def _save_state_dict(model: torch.nn.Module, out: Path, shards: int) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    groups = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k] for k in group}, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in group})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
