"""Qwen3 as a pure function of (input_ids, positions); batching and paging live elsewhere."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmcli.kernels.backend import AttentionBackend, QKNormRotary
from llmcli.layers.activation import SiluAndMul
from llmcli.layers.attention import Attention
from llmcli.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llmcli.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmcli.layers.norm import RMSNorm
from llmcli.layers.rotary import RotaryEmbedding, rope_settings


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Qwen3Attention(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        # q/k's per-head norm and rotary go with the attention call: the triton backend fuses them with its KV
        # store (one kernel; layers/attention.py), the others get them applied first
        qk_norm = QKNormRotary(positions, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                               self.rotary.cos, self.rotary.sin)
        out = self.attn(q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                        v.view(-1, self.num_kv_heads, self.head_dim), qk_norm)
        return self.o_proj(out.flatten(1, 2))


class Qwen3MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size])
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, rotary, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, positions, hidden, residual):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen3Model(nn.Module):
    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings, *rope_settings(config))
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, rotary, backend)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter fragment, slot in it)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, backend: AttentionBackend) -> None:
        super().__init__()
        self.model = Qwen3Model(config, backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.compute_logits(hidden)
