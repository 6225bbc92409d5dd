"""Build tiny random checkpoints of every supported family for tests (and the bundled example model).

``write_tiny_model(path, family)`` writes a complete HuggingFace-style model folder (``write_tiny_qwen3(path)``
is the Qwen3 one):

* ``config.json``            a real transformers config of the family (``FAMILIES``: Qwen3, Qwen3 with YaRN,
                             Llama 3.1-style with llama3 rope scaling, biases and head_dim derived, Qwen2 with
                             q/k/v bias and tied embeddings, Mistral v0.3-style, Qwen3-MoE top-2 and top-8)
* ``model.safetensors``      seeded random weights, biases included (or several shards plus
                             ``model.safetensors.index.json`` with ``sharded=True``)
* ``generation_config.json`` whose ``eos_token_id`` lists the family's EOS ids (Llama 3: three)
* tokenizer files            a byte-level BPE trained here with ``tokenizers`` on a small built-in English
                             corpus with the family's special tokens, wrapped in ``PreTrainedTokenizerFast`` with
                             a chat template in the family's format (written for these tests); Llama's and
                             Mistral's put their BOS before a plain text, as the published ones do

The weights are initialised with a large ``initializer_range`` so that the
logits are well spread: greedy decoding then varies across prompts and
positions instead of collapsing into one repeated token, and near-ties between
the two best logits (which would make a float32 comparison with another
implementation flaky) are rare.

Command line: ``python tests/tiny_qwen3.py OUTDIR [--family F] [--tied] [--sharded] [--seed N]``.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The same ChatML with Qwen3's thinking switch: enable_thinking=false writes an empty think block after the
# assistant header, so the model answers at once (written for these tests, in the spirit of Qwen3's template).
THINK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{% endif %}"
)

# A few paragraphs of plain English, written for these tests; enough for the
# BPE trainer to learn a few hundred merges of common words and word pieces.
_CORPUS_PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the gate.",
    "A small boat drifted across the lake at dawn, and the fisherman counted the clouds above the hills.",
    "In the morning the market opens early; traders bring apples, bread, cheese, fish and fresh flowers.",
    "Reading a good book on a rainy afternoon is one of the simplest pleasures of a quiet life.",
    "The engineer measured the bridge twice before she wrote the report for the city council.",
    "Children played in the park until the street lights came on and their parents called them home.",
    "Water boils at one hundred degrees at sea level, but at a lower temperature high in the mountains.",
    "The library keeps old maps of the river, the railway and the roads that connect the northern towns.",
    "Please write a short story about a robot who learns to paint pictures of the ocean.",
    "What is the capital of France? The capital of France is Paris, a city on the river Seine.",
    "Explain how a computer stores numbers in memory using bits, bytes and words of fixed size.",
    "The teacher asked the students to summarize the chapter in three sentences and one question.",
    "Every winter the birds fly south, following the coast where the weather stays warm and mild.",
    "He opened the window, listened to the wind in the trees, and decided to walk to the station.",
    "Good software is tested often, reviewed carefully, and written so that other people can read it.",
    "The recipe needs two cups of flour, one egg, a spoon of sugar, some milk and a pinch of salt.",
    "Scientists observe the stars with large telescopes and record the light they collect each night.",
    "Once upon a time there was a king who loved music more than gold, silver or precious stones.",
    "The train to the coast leaves at seven o'clock and arrives before noon if there are no delays.",
    "Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in many texts, dates, prices and addresses.",
    "She said: \"Thank you for your help!\" and he answered, \"You are welcome; see you tomorrow.\"",
    "Questions, answers, lists and tables: a language model sees all of them during its training.",
    "The garden was full of roses, tulips and sunflowers, and bees moved from one flower to the next.",
    "When the meeting ended, everyone agreed to share their notes and to meet again next Thursday.",
]


def training_corpus() -> list[str]:
    """The text the tokenizer is trained on (also handy for making test prompts)."""
    return list(_CORPUS_PARAGRAPHS)


# Llama 3's chat format (header tokens, <|eot_id|> closing each turn), written for these tests.
LLAMA3_CHAT_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_SPECIAL_TOKENS = ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eot_id|>", "<|eom_id|>"]

# Mistral's instruction format ([INST] ... [/INST], answers closed by </s>), written for these tests.
MISTRAL_CHAT_TEMPLATE = (
    "{{ '<s>' }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + message['content'] + '</s>' }}{% endif %}"
    "{% endfor %}"
)
MISTRAL_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]


# Harmony, gpt-oss's chat format (written for these tests from the published format): a system message with the
# reasoning effort and the channels, the caller's system prompt as the developer's instructions, earlier answers
# on the final channel (their analysis dropped, as the format asks), and the assistant's header to generate from.
HARMONY_CHAT_TEMPLATE = (
    "{%- set effort = reasoning_effort if reasoning_effort is defined and reasoning_effort else 'medium' -%}"
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: {{ effort }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{%- for m in messages -%}"
    "{%- if m['role'] in ['system', 'developer'] -%}"
    "<|start|>developer<|message|># Instructions\n\n{{ m['content'] }}<|end|>"
    "{%- elif m['role'] == 'user' -%}<|start|>user<|message|>{{ m['content'] }}<|end|>"
    "{%- elif m['role'] == 'tool' -%}"
    "<|start|>functions.{{ m['name'] }} to=assistant<|channel|>commentary<|message|>{{ m['content'] }}<|end|>"
    "{%- elif m['role'] == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)
HARMONY_SPECIAL_TOKENS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                          "<|start|>", "<|end|>", "<|message|>", "<|call|>"]


def build_tokenizer(vocab_size: int = 600, special_tokens: list[str] | None = None, eos: str = "<|im_end|>",
                    pad: str = "<|endoftext|>", chat_template: str = CHAT_TEMPLATE, bos: str | None = None):
    """A byte-level BPE tokenizer wrapped in ``PreTrainedTokenizerFast`` (ChatML and its tokens by default).

    With ``bos`` (one of ``special_tokens``), ``tokenizer(text)`` puts it first, through a post-processor as
    the published Llama 3 and Mistral tokenizers do; without, it adds nothing (Qwen)."""
    special_tokens = special_tokens or SPECIAL_TOKENS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus a few times so frequent pieces clear min_frequency.
    tok.train_from_iterator(training_corpus() * 3, trainer=trainer)
    if bos is not None:
        bos_id = tok.token_to_id(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=None,
        additional_special_tokens=[t for t in special_tokens if t not in (eos, pad)],
        model_max_length=1 << 20,
    )
    fast.chat_template = chat_template
    return fast


@dataclass(frozen=True)
class Family:
    """How to write a tiny checkpoint of one family: its transformers classes, config values, tokens."""

    config_class: str
    model_class: str
    config: dict = field(default_factory=dict)  # family-specific config values (over the shared tiny sizes)
    special_tokens: tuple[str, ...] = tuple(SPECIAL_TOKENS)
    eos: str = "<|im_end|>"
    pad: str = "<|endoftext|>"
    generation_eos: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")  # generation_config.json's eos_token_id
    chat_template: str = CHAT_TEMPLATE
    bos: str | None = None  # the token the tokenizer puts before a plain text (its chat template writes its own)
    # config.json entries removed after writing, as published checkpoints leave them out (head_dim: derived)
    unwritten: tuple[str, ...] = ()
    # a multimodal wrapper: the family's values become its text_config beside this (tiny) vision_config
    vision_config: dict | None = None


HYBRID = {"head_dim": 16, "num_hidden_layers": 4,
          "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
          "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
          "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5,
                              "mrope_section": [2, 1, 1], "mrope_interleaved": True}}
GEMMA3 = {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 24, "query_pre_attn_scalar": 24,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
          "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": False,
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                              "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}}
# gpt-oss: sliding (24 keys) and full layers, 8 experts top-2, YaRN stretching 256 positions 4x (its frequencies
# and attention factor act at every position), no truncation of its correction range (as published: "truncate":
# false)
GPT_OSS = {"head_dim": 16, "num_hidden_layers": 2, "sliding_window": 24,
           "layer_types": ["sliding_attention", "full_attention"], "num_local_experts": 8,
           "num_experts_per_tok": 2, "intermediate_size": 32, "attention_bias": True, "max_position_embeddings": 1024,
           "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 256, "rope_theta": 150_000.0}}
# Gemma 4: 16-wide local heads (4 KV heads) and 32-wide global ones (2 KV heads, K = V), proportional rotary turning
# a quarter of the global angles, final-logit softcapping; no per-layer inputs (the E2B/E4B feature llmcli refuses)
GEMMA4 = {"head_dim": 16, "num_key_value_heads": 4, "global_head_dim": 32, "num_global_key_value_heads": 2,
          "attention_k_eq_v": True, "num_hidden_layers": 2, "sliding_window": 24, "hidden_size_per_layer_input": 0,
          "layer_types": ["sliding_attention", "full_attention"],
          "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": False, "final_logit_softcapping": 30.0,
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1_000_000.0}}}
GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32}
HYBRID_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 48}

FAMILIES: dict[str, Family] = {
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM",
                    {"head_dim": 16, "attention_bias": False, "use_sliding_window": False}),
    # max_position_embeddings 128 stretched 4x: the tests run past position 128, where YaRN is what makes it work
    "qwen3-yarn": Family("Qwen3Config", "Qwen3ForCausalLM",
                         {"head_dim": 16, "attention_bias": False, "use_sliding_window": False,
                          "max_position_embeddings": 128,
                          "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1_000_000.0,
                                              "original_max_position_embeddings": 128}}),
    # Llama 3.1's rope scaling at a small original window (64, theta 10k) so that it changes short contexts;
    # head_dim left out (derived: 64 / 4); both bias switches on so that their shards and loaders are exercised
    "llama": Family("LlamaConfig", "LlamaForCausalLM",
                    {"head_dim": None, "attention_bias": True, "mlp_bias": True, "bos_token_id": 1,
                     "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                         "rope_theta": 10_000.0}},
                    tuple(LLAMA3_SPECIAL_TOKENS), eos="<|eot_id|>", pad="<|end_of_text|>",
                    generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
                    chat_template=LLAMA3_CHAT_TEMPLATE, bos="<|begin_of_text|>", unwritten=("head_dim",)),
    "qwen2": Family("Qwen2Config", "Qwen2ForCausalLM",
                    {"tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 4096,
                     "max_window_layers": 2}),
    # Qwen3-MoE: top-2 of 8 experts unnormalised with layer 1 of 3 dense (mlp_only_layers); top-8 of 16
    # normalised with every other layer dense (decoder_sparse_step=2: of 2 layers, layer 0 dense, 1 sparse)
    "qwen3-moe-top2": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                             {"head_dim": 16, "attention_bias": False, "use_sliding_window": False,
                              "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 32, "norm_topk_prob": False, "mlp_only_layers": [1],
                              "decoder_sparse_step": 1}),
    "qwen3-moe-top8": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                             {"head_dim": 16, "attention_bias": False, "use_sliding_window": False,
                              "num_experts": 16, "num_experts_per_tok": 8, "moe_intermediate_size": 32,
                              "norm_topk_prob": True, "mlp_only_layers": [], "decoder_sparse_step": 2}),
    # Mistral 7B v0.1-style: every layer a sliding window (24 keys), so that test prompts run several windows long
    "mistral-window": Family("MistralConfig", "MistralForCausalLM",
                             {"head_dim": None, "sliding_window": 24, "num_key_value_heads": 1, "bos_token_id": 1},
                             tuple(MISTRAL_SPECIAL_TOKENS), eos="</s>", pad="<unk>", generation_eos=("</s>",),
                             chat_template=MISTRAL_CHAT_TEMPLATE, bos="<s>", unwritten=("head_dim",)),
    # Gemma 3 text: local layers with a 24-key window and their own rope base around a global one, a query
    # scale that is not head_dim ** -0.5, GeGLU, zero-centred norms (jittered off zero); untied, as tied ones with
    # the sqrt(hidden) embedding scale make a tiny random model repeat its input
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", dict(GEMMA3)),
    # Gemma 4 31B-like and 26B-A4B-like (a routed mixture of experts beside each dense MLP)
    # the dense one with local and global layers alternating, two of each, and one global KV
    # head: its global layers' KV is half a local layer's, as on gemma-4-31B (KV groups pack two in a block's slab)
    "gemma4": Family("Gemma4TextConfig", "Gemma4ForCausalLM",
                     {**GEMMA4, "num_global_key_value_heads": 1, "num_hidden_layers": 4,
                      "layer_types": ["sliding_attention", "full_attention"] * 2}),
    "gemma4-moe": Family("Gemma4TextConfig", "Gemma4ForCausalLM", {**GEMMA4, **GEMMA4_MOE}),
    # Qwen3.5: Gated DeltaNet layers (2 key heads grouping 4 value heads) around a gated full-attention layer
    # with a half-head rotary; Qwen3.5-MoE and Qwen3-Next with the shared expert (Next: one dense layer)
    "qwen3.5": Family("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(HYBRID)),
    "qwen3.5-moe": Family("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
                          {**HYBRID, "intermediate_size": None, **HYBRID_MOE}),
    "qwen3-next": Family("Qwen3NextConfig", "Qwen3NextForCausalLM",
                         {**HYBRID, **HYBRID_MOE, "norm_topk_prob": True, "decoder_sparse_step": 1,
                          "mlp_only_layers": [1]}),
    # the multimodal wrappers of Qwen3.5 and Gemma 3 (a one-block vision tower llmcli must skip)
    "qwen3.5-vl": Family("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(HYBRID),
                         vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                                        "out_hidden_size": 64}),
    "gemma3-vl": Family("Gemma3Config", "Gemma3ForConditionalGeneration", dict(GEMMA3),
                        vision_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                                       "num_attention_heads": 2, "image_size": 28, "patch_size": 14}),
    # gpt-oss speaks Harmony: its special tokens, its template, generation ending at <|return|> or <|call|>
    "gpt-oss": Family("GptOssConfig", "GptOssForCausalLM", dict(GPT_OSS), tuple(HARMONY_SPECIAL_TOKENS),
                      eos="<|return|>", pad="<|endoftext|>", generation_eos=("<|return|>", "<|endoftext|>", "<|call|>"),
                      chat_template=HARMONY_CHAT_TEMPLATE),
    "gemma4-vl": Family("Gemma4Config", "Gemma4ForConditionalGeneration", dict(GEMMA4),
                        vision_config={"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
                                       "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8,
                                       "patch_size": 4, "position_embedding_size": 64}),
    "mistral": Family("MistralConfig", "MistralForCausalLM",
                      {"head_dim": None, "sliding_window": None, "num_key_value_heads": 1, "bos_token_id": 1},
                      tuple(MISTRAL_SPECIAL_TOKENS), eos="</s>", pad="<unk>", generation_eos=("</s>",),
                      chat_template=MISTRAL_CHAT_TEMPLATE, bos="<s>", unwritten=("head_dim",)),
}


def build_family_tokenizer(family: str):
    spec = FAMILIES[family]
    return build_tokenizer(special_tokens=list(spec.special_tokens), eos=spec.eos, pad=spec.pad,
                           chat_template=spec.chat_template, bos=spec.bos)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def write_tiny_model(
    path,
    family: str = "qwen3",
    *,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    sharded: bool = False,
    dtype: torch.dtype = torch.float32,
    initializer_range: float = 0.2,
    rope_theta: float = 1_000_000.0,  # the real Qwen3 value, not the 10000 a reader might default to
    **config_overrides,
) -> Path:
    """Write a tiny random model folder of ``family`` (a key of ``FAMILIES``) at ``path``; return it as a Path."""
    import transformers
    from transformers import GenerationConfig

    spec = FAMILIES[family]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = build_family_tokenizer(family)
    n_tok = len(tokenizer)
    if vocab_size is None:
        vocab_size = _round_up(n_tok, 64)
    if vocab_size < n_tok:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({n_tok} tokens)")
    eos_id = tokenizer.convert_tokens_to_ids(spec.eos)
    pad_id = tokenizer.convert_tokens_to_ids(spec.pad)

    values = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        hidden_act="silu",
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        rms_norm_eps=1e-6,
        rope_theta=rope_theta,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    values.update(spec.config)
    if values.get("intermediate_size", 0) is None:  # a config without a dense MLP (every layer's is MoE)
        del values["intermediate_size"]
    if "max_window_layers" in values:
        values["max_window_layers"] = num_hidden_layers
    if tie_word_embeddings is not None:
        values["tie_word_embeddings"] = tie_word_embeddings
    values.update(config_overrides)
    if values.get("rope_parameters"):
        values.pop("rope_theta")
    if spec.vision_config is not None:
        text = {k: v for k, v in values.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
        config = getattr(transformers, spec.config_class)(
            text_config=text, vision_config=dict(spec.vision_config),
            tie_word_embeddings=values["tie_word_embeddings"], eos_token_id=eos_id, pad_token_id=pad_id)
    else:
        config = getattr(transformers, spec.config_class)(**values)
    config.architectures = [spec.model_class]

    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = getattr(transformers, spec.model_class)(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                # The RMSNorm weights start at exactly 1 and biases at 0; jitter them so that a norm or a bias
                # that is dropped or applied to the wrong tensor shows up.
                if name.endswith("norm.weight"):
                    param.mul_(1.0 + 0.1 * torch.randn_like(param))
                    if not param.any():  # a zero-centred norm (gain 1 + w) starts at w = 0
                        param.normal_(0.0, 0.1)
                elif name.endswith((".bias", "_bias")):  # gpt-oss's experts: gate_up_proj_bias, down_proj_bias
                    param.normal_(0.0, initializer_range)
                elif name.endswith(".sinks"):  # gpt-oss's sink logits: around the scores' size, so they matter
                    param.normal_(0.0, 1.0)
                elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's router gains, at 1
                    param.mul_(1.0 + 0.3 * torch.randn_like(param))
            for name, buf in model.named_buffers():
                if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale, stored at 1
                    buf.uniform_(0.5, 1.5)
    finally:
        torch.random.set_rng_state(state)
    model = model.to(dtype)
    model.eval()

    save_kwargs = {}
    if sharded:
        # Small enough that even the tiny default model gets several shards.
        n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        save_kwargs["max_shard_size"] = max(n_bytes // 4, 16 * 1024)
    model.save_pretrained(out, safe_serialization=True, **save_kwargs)

    # config.json is left as transformers writes it (transformers 5 keeps rope_theta inside rope_parameters), so
    # the engine's reading of that form is what the tests exercise; less what published checkpoints leave out
    if spec.unwritten:
        written = json.loads((out / "config.json").read_text())
        for key in spec.unwritten:
            written.pop(key, None)
        (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")

    gen = GenerationConfig(
        bos_token_id=values.get("bos_token_id"),
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in spec.generation_eos],
        pad_token_id=pad_id,
        do_sample=False,
    )
    gen.save_pretrained(out)

    tokenizer.save_pretrained(out)
    return out


def write_tiny_qwen3(path, *, head_dim: int = 16, **kwargs) -> Path:
    """Write a tiny random Qwen3 model folder at ``path`` and return it as a Path."""
    return write_tiny_model(path, "qwen3", head_dim=head_dim, **kwargs)


def write_random_published(config_json, path, *, norm_gain: float = 8.0, device: str = "cuda",
                           dtype: torch.dtype = torch.bfloat16, overrides: dict | None = None,
                           mxfp4: bool = False) -> Path:
    """A full-size random checkpoint of any family from a published config.json (e.g. configs/Qwen3-0.6B or
    configs/Llama-3.2-1B), for GPU tests; ``overrides`` replace config fields (fewer layers of a large model).

    A multimodal wrapper (Qwen3.5, Gemma 3, Gemma 4: ``text_config`` inside) is written as its text model alone
    (``Qwen3_5ForCausalLM``, ``Gemma3ForCausalLM``, ``Gemma4ForCausalLM``), the overrides applied to the text
    config: transformers' ``AutoModelForCausalLM`` maps gemma3/gemma4 to the wrapper, which would want a vision
    tower (llmcli's reading of wrappers is tested on CPU: tiny_qwen3's ``-vl`` families). ``layer_types`` is cut
    to ``num_hidden_layers`` (its first ones, so the published pattern starts as it does). The published
    ``quantization_config`` (gpt-oss: MXFP4) is dropped: the experts are drawn in ``dtype``; with ``mxfp4`` they
    are instead random MXFP4 codes and scales (gpt-oss's checkpoint layout) and the config says so.

    ``norm_gain`` scales the final norm (and so every logit) without touching the residual stream. It does
    not make bf16 near-ties rarer (rounding is relative): with random weights the logits are ~Gaussian over
    151,936 tokens, and on an H200 about a fifth of transformers' own greedy steps had their two best
    logits within 2% of the largest (benchmarks/RESULTS.md, run 4).
    """
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out = Path(path)
    # built from the JSON with the overrides in, not set on a built config: Gemma 4 derives its global layers'
    # per_layer_config (head dim 512, 4 KV heads) from layer_types and num_hidden_layers as it is constructed
    raw = json.loads(Path(config_json).read_text())
    raw = raw.get("text_config") or raw
    quant = raw.pop("quantization_config", None)
    raw.update(overrides or {})
    if len(raw.get("layer_types") or ()) > raw["num_hidden_layers"]:
        raw["layer_types"] = raw["layer_types"][:raw["num_hidden_layers"]]
    config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        model.model.norm.weight.fill_(norm_gain)
    if not mxfp4:
        model.save_pretrained(out, safe_serialization=True)
        return out
    from safetensors.torch import save_file

    if quant is None or quant.get("quant_method") != "mxfp4":
        raise ValueError(f"{config_json}: mxfp4=True needs a published MXFP4 quantization_config")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    g = torch.Generator(device=device).manual_seed(1)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = state.pop(key).shape  # stored 16-bit as [E, in, out]; MXFP4 as [E, out, in/32, 16]
        # every e2m1 code, scales 2^-9..2^-6: about the spread of the 16-bit init (0.02)
        state[key + "_blocks"] = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=g,
                                               dtype=torch.uint8, device=device)
        state[key + "_scales"] = torch.randint(118, 122, (experts, rows, cols // 32), generator=g,
                                               dtype=torch.uint8, device=device)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.cpu() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = quant
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a tiny random checkpoint of one family.")
    parser.add_argument("outdir")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3")
    parser.add_argument("--tied", action="store_true", help="tie lm_head to the embeddings")
    parser.add_argument("--sharded", action="store_true", help="write several safetensors shards")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = write_tiny_model(args.outdir, args.family, tie_word_embeddings=args.tied or None, sharded=args.sharded,
                           seed=args.seed)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
