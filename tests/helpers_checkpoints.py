"""Tiny random-weight HF MoE checkpoints (Mixtral, Qwen3-MoE, DeepSeek-V3, NemotronH, Llama-4 text, gpt-oss) made with
transformers, and a word-level tokenizer with a chat template made offline, for converter/vLLM tests.

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

Family = Literal["mixtral", "qwen3_moe", "deepseek_v3", "nemotron_h", "llama4_text", "gpt_oss"]
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "nemotron_h", "llama4_text", "gpt_oss")

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
# DeepSeek-V3: MLA with the real model's latent and per-head sizes (kv_lora_rank 512 and rope dim 64 are what
# FlashMLA-class backends accept), 8 routed experts in 4 groups (noaux_tc: 2 groups kept, top-2 inside them), one
# shared expert, a dense first layer and a routed scaling factor != 1; 3 layers so two MoE layers follow each other.
DEEPSEEK_LAYERS = 3
DEEPSEEK_EXPERTS = 8
DEEPSEEK_GROUPS = 4
DEEPSEEK_ROUTED_SCALING = 2.5
# Router weights wide enough that sigmoid scores spread over (0, 1) (router logits of std ~1 on unit-RMS hidden
# states), and a correction bias that reorders some of them: HF's init (std 0.02, bias 0) routes every token alike.
DEEPSEEK_ROUTER_STD = 0.125
DEEPSEEK_BIAS_STD = 0.1
# NemotronH: ReLU² experts without a gate, sigmoid routing with a correction bias (spread like DeepSeek's), a shared
# expert; layers "*E" (attention, then MoE): no Mamba layer, the config allows none and vLLM then needs no Mamba
# kernels.  Small Mamba sizes all the same: vLLM sizes the attention page from the (unused) Mamba state.
NEMOTRON_LAYERS = ("full_attention", "moe")
# gpt-oss: head dim 64 (its attention sinks run on backends that take 64, not 32); expert biases drawn like the
# weights (HF initializes them to zero, which would test nothing).
GPT_OSS_HEAD_DIM = 64
GPT_OSS_BIAS_STD = 0.02


def tiny_config(family: Family):
    """The transformers config of the tiny model (hidden 64, 4 experts of intermediate 64, 2 layers, vocab 256,
    4 attention heads and 2 KV heads of dim 32; DeepSeek-V3: see ``DEEPSEEK_*``, 8 MLA heads; NemotronH:
    ``NEMOTRON_LAYERS``; Llama-4: top-1, router weight on the input, a shared expert; gpt-oss: ``GPT_OSS_*``)."""
    from transformers import (
        DeepseekV3Config,
        GptOssConfig,
        Llama4TextConfig,
        MixtralConfig,
        NemotronHConfig,
        Qwen3MoeConfig,
    )

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
            intermediate_size=2 * EXPERT_INTERMEDIATE,
            moe_intermediate_size=EXPERT_INTERMEDIATE,
            num_experts=EXPERTS,
            **common,
        )
    if family == "deepseek_v3":
        # topk_method and scoring_func are not DeepseekV3Config fields in transformers 5, but vLLM 0.26 reads them
        # (without them it builds no correction bias and scores with softmax): they go to config.json as extras.
        return DeepseekV3Config(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * EXPERT_INTERMEDIATE,
            moe_intermediate_size=EXPERT_INTERMEDIATE,
            num_hidden_layers=DEEPSEEK_LAYERS,
            num_attention_heads=8,
            num_key_value_heads=8,
            n_routed_experts=DEEPSEEK_EXPERTS,
            n_shared_experts=1,
            num_experts_per_tok=TOP_K,
            n_group=DEEPSEEK_GROUPS,
            topk_group=2,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=DEEPSEEK_ROUTED_SCALING,
            first_k_dense_replace=1,
            q_lora_rank=64,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
    if family == "nemotron_h":
        return NemotronHConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            layers_block_type=list(NEMOTRON_LAYERS),
            num_attention_heads=4,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            n_routed_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=EXPERT_INTERMEDIATE,
            moe_shared_expert_intermediate_size=EXPERT_INTERMEDIATE,
            n_shared_experts=1,
            intermediate_size=2 * EXPERT_INTERMEDIATE,
            n_group=1,
            topk_group=1,
            norm_topk_prob=True,
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=1,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
    if family == "llama4_text":
        return Llama4TextConfig(
            intermediate_size=EXPERT_INTERMEDIATE,
            intermediate_size_mlp=2 * EXPERT_INTERMEDIATE,
            num_local_experts=EXPERTS,
            **{**common, "num_experts_per_tok": 1},
        )
    if family == "gpt_oss":
        return GptOssConfig(
            intermediate_size=EXPERT_INTERMEDIATE, num_local_experts=EXPERTS, **{**common, "head_dim": GPT_OSS_HEAD_DIM}
        )
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def kv_cache_threads_per_rank(config, tp: int) -> int:
    """Threads vLLM's reshape_and_cache_flash gives each token on one of ``tp`` ranks (KV heads are split, or
    replicated once there are more ranks than heads); under 32 it never finishes (see ``HEAD_DIM``)."""
    return max(1, config.num_key_value_heads // tp) * config.head_dim


def make_tiny_checkpoint(
    family: Family, out_dir: str | Path, *, shards: int = 1, seed: int = 0, stacked: bool = False
) -> Path:
    """Write a random BF16 model to ``out_dir`` (about ``shards`` safetensors shards) and return the path.

    Weights are drawn with std 0.02 like the HF initializer, so they resemble a real checkpoint's range; DeepSeek's
    routers get ``DEEPSEEK_ROUTER_STD`` and a random correction bias.
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family)).to(torch.bfloat16)
    if family in ("deepseek_v3", "nemotron_h"):  # sigmoid routers with spread scores and a correction bias
        _redraw(
            model,
            seed + 1,
            {
                (".mlp.gate.weight", ".mixer.gate.weight"): DEEPSEEK_ROUTER_STD,
                "gate.e_score_correction_bias": DEEPSEEK_BIAS_STD,
            },
        )
    if family == "gpt_oss":
        _redraw(model, seed + 2, {("experts.gate_up_proj_bias", "experts.down_proj_bias"): GPT_OSS_BIAS_STD})
    if not stacked:
        total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        model.save_pretrained(out, max_shard_size=max(total // shards, 1) if shards > 1 else "5GB")
        return out
    _save_state_dict(model, out, shards)
    return out


def _redraw(model: torch.nn.Module, seed: int, stds: dict) -> None:
    """Each tensor whose name ends with a key of ``stds`` (a suffix or a tuple of them) drawn again as normal noise
    of that std, in state-dict order from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            std = next((v for suffixes, v in stds.items() if name.endswith(suffixes)), None)
            if std is not None:
                t.copy_(torch.randn(t.shape, generator=g) * std)


# A word-level tokenizer: id i < len(SPECIAL_TOKENS) is that special token, every other id i is the word f"w{i}",
# split on whitespace only (so the chat template's role markers are single tokens).
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def word(token_id: int) -> str:
    """The word of a non-special token id."""
    if token_id < len(SPECIAL_TOKENS):
        raise ValueError(f"token_id {token_id} is a special token ({SPECIAL_TOKENS[token_id]})")
    return f"w{token_id}"


def write_word_tokenizer(out_dir: str | Path, vocab_size: int):
    """Save a ``PreTrainedTokenizerFast`` of ``vocab_size`` ids (``SPECIAL_TOKENS``, then words) with
    ``CHAT_TEMPLATE`` into ``out_dir`` (beside a checkpoint, so ``vllm serve DIR`` finds it); return it.

    No BOS/EOS is added on encode: a text of n words is n prompt tokens.  Decoding joins words with spaces."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({word(i): i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        additional_special_tokens=list(SPECIAL_TOKENS[3:]),
        chat_template=CHAT_TEMPLATE,
    )
    tok.save_pretrained(str(out_dir))
    return tok


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
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
        "weight_map": weight_map,
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
