"""The decoder every supported family shares (pre-norm, GQA attention with rotary, SwiGLU MLP), parameterised by
a ``DecoderSpec``: what differs between families is data, not code, so a family module is a config reader.

Parameter names follow the HuggingFace checkpoints (``model.layers.N.self_attn.q_proj`` ...), with q/k/v and
gate/up fused (``packed_modules_mapping``): each fused parameter's ``weight_loader`` places a checkpoint tensor
in its slot and takes this rank's tensor-parallel shard, biases included.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from llmcli.kernels.backend import AttentionBackend, QKNormRotary
from llmcli.layers.activation import SiluAndMul
from llmcli.layers.attention import Attention
from llmcli.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llmcli.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmcli.layers.norm import RMSNorm
from llmcli.layers.rotary import RopeSettings, RotaryEmbedding, rope_settings


def head_dim_of(config: Any) -> int:
    """``head_dim`` when config.json gives one (Qwen3, some Mistral), else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class DecoderSpec:
    """What one family's decoder layers look like; ``DecoderForCausalLM.spec`` reads it from config.json."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeSettings
    max_position_embeddings: int
    qk_norm: bool = False  # per-head RMSNorm of q and k before the rotary (Qwen3)
    qkv_bias: bool = False  # q/k/v projections carry a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # the output projection carries one (Llama's attention_bias)
    mlp_bias: bool = False  # gate/up/down carry one (Llama's mlp_bias)
    tie_word_embeddings: bool = False

    @classmethod
    def from_config(cls, config: Any, **family: Any) -> DecoderSpec:
        """The fields every family spells the same way; ``family`` gives the ones that differ."""
        return cls(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                   num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                   num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                   head_dim=head_dim_of(config), vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps,
                   rope=rope_settings(config), max_position_embeddings=config.max_position_embeddings,
                   tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)), **family)

    @property
    def max_positions(self) -> int:
        """Positions the rotary tables must cover by default (YaRN reaches past max_position_embeddings)."""
        return self.rope.max_positions(self.max_position_embeddings)


class DecoderAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = spec.head_dim
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads,
                                          bias=spec.qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=spec.o_bias)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.eps = spec.rms_norm_eps
        self.rotary = rotary
        self.attn = Attention(self.num_heads, self.num_kv_heads, spec.head_dim, backend)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        # the q/k transform (optional per-head norm, then rotary) goes with the attention call: the triton backend
        # fuses it with its KV store (one kernel; layers/attention.py), the others get it applied first
        transform = QKNormRotary(positions, self.q_norm.weight if self.qk_norm else None,
                                 self.k_norm.weight if self.qk_norm else None, self.eps,
                                 self.rotary.cos, self.rotary.sin)
        out = self.attn(q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                        v.view(-1, self.num_kv_heads, self.head_dim), transform)
        return self.o_proj(out.flatten(1, 2))


class DecoderMLP(nn.Module):
    def __init__(self, spec: DecoderSpec) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [size, size], bias=spec.mlp_bias)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, backend: AttentionBackend,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = DecoderAttention(spec, rotary, backend)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = mlp if mlp is not None else DecoderMLP(spec)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, backend: AttentionBackend, max_positions: int,
                 make_mlp: Callable[[int], nn.Module] | None = None) -> None:
        """``make_mlp(layer_index)``: the MLP of each layer (default: the dense SwiGLU ``DecoderMLP``)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size)
        # one cos/sin table shared by every layer, as long as the engine may go (max_model_len can pass
        # max_position_embeddings under YaRN)
        rotary = RotaryEmbedding(spec.head_dim, max_positions, spec.rope.theta, spec.rope,
                                 spec.max_position_embeddings)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(spec, rotary, backend, make_mlp(i) if make_mlp else None)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(nn.Module):
    """A family is a subclass that says how to read its config (``spec``) and what it refuses (``check``)."""

    # checkpoint name fragment -> (our fused parameter fragment, slot in it)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, object]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    @classmethod
    def spec(cls, config: Any) -> DecoderSpec:
        raise NotImplementedError

    @classmethod
    def check(cls, config: Any, max_model_len: int) -> None:
        """Raise ``UnsupportedModelError`` for a config this family cannot run exactly (default: a sliding window
        that a sequence of ``max_model_len`` tokens would reach past)."""
        check_no_sliding_window(config, max_model_len)

    def __init__(self, config: Any, backend: AttentionBackend, max_model_len: int | None = None) -> None:
        super().__init__()
        spec = self.spec(config)
        self.model = self.make_model(spec, backend, max_model_len or spec.max_positions)
        self.lm_head = ParallelLMHead(spec.vocab_size, spec.hidden_size)
        self.tie_word_embeddings = spec.tie_word_embeddings
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_model(self, spec: DecoderSpec, backend: AttentionBackend, max_positions: int) -> nn.Module:
        """The decoder stack (a family with another MLP, e.g. MoE, passes its own ``make_mlp``)."""
        return DecoderModel(spec, backend, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.compute_logits(hidden)


class UnsupportedModelError(ValueError):
    """config.json describes a model llmcli cannot run exactly; the message names the field and what is supported."""


def check_no_sliding_window(config: Any, max_model_len: int) -> None:
    """Sliding-window attention is not implemented: refuse a window a sequence could reach past, rather than
    silently attend to everything (a window no shorter than max_model_len never cuts anything off)."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return
    if window < max_model_len:
        field = "use_sliding_window=true with sliding_window" if hasattr(config, "use_sliding_window") \
            else "sliding_window"
        raise UnsupportedModelError(
            f"config.json {field}={window}: llmcli has no sliding-window attention and runs this model only with "
            f"max_model_len <= {window} (got {max_model_len}); pass --max-model-len {window}")
