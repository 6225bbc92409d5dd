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
from llmcli.layers.activation import gated_activation
from llmcli.layers.attention import Attention
from llmcli.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from llmcli.layers.gated_delta_net import GatedDeltaNet, GatedDeltaNetSpec
from llmcli.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from llmcli.layers.norm import RMSNorm, ScaledRMSNorm, ZeroCentredRMSNorm, rms_norm_no_gain
from llmcli.layers.rotary import RopeSettings, RotaryEmbedding, rope_settings
from llmcli.layers.weight_shape import expect_shape
from llmcli.parallel import tp_rank, tp_size


def head_dim_of(config: Any) -> int:
    """``head_dim`` when config.json gives one (Qwen3, some Mistral), else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention")


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
    # per layer one of LAYER_KINDS (empty: every layer full attention); config.json's ``layer_types``
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a sliding layer's query sees (itself included)
    local_rope: RopeSettings | None = None  # the sliding layers' rotary where it differs (Gemma 3's local base)
    rotary_dim: int | None = None  # leading dims of a head the rotary turns (partial_rotary_factor; None: all)
    zero_centred_norms: bool = False  # every RMSNorm's gain is 1 + w (Gemma, Qwen3.5/Next)
    attn_output_gate: bool = False  # q_proj gives each head a sigmoid gate on its output too (Qwen3.5/Next)
    query_scale: float | None = None  # softmax scale when it is not head_dim ** -0.5 (query_pre_attn_scalar)
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden_size))
    hidden_act: str = "silu"  # the MLP's gate activation (silu: SwiGLU; gelu_pytorch_tanh: GeGLU)
    sandwich_norms: bool = False  # Gemma: a norm after attention, and before and after the MLP
    final_logit_softcap: float | None = None  # logits = c * tanh(logits / c)
    linear: GatedDeltaNetSpec | None = None  # the linear-attention layers' shape (Qwen3.5/Next)
    attention_sinks: bool = False  # a learned sink logit per head in every softmax (gpt-oss's self_attn.sinks)
    # Gemma 4's global (full-attention) layers: their own head size and KV heads, and K = V (no v_proj: v is the
    # k projection before k's norm and rotary)
    global_head_dim: int | None = None
    global_num_kv_heads: int | None = None
    global_k_eq_v: bool = False
    v_norm: bool = False  # v gets a gain-free per-head RMSNorm (Gemma 4)
    layer_scalar: bool = False  # each layer's output times its checkpoint ``layer_scalar`` (Gemma 4)

    @classmethod
    def from_config(cls, config: Any, **family: Any) -> DecoderSpec:
        """The fields every family spells the same way; ``family`` gives the ones that differ (or overrides)."""
        fields = dict(hidden_size=config.hidden_size, intermediate_size=getattr(config, "intermediate_size", 0),
                      num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
                      num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                      head_dim=head_dim_of(config), vocab_size=config.vocab_size, rms_norm_eps=config.rms_norm_eps,
                      rope=rope_settings(config), max_position_embeddings=config.max_position_embeddings,
                      tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))
        return cls(**{**fields, **family})

    @property
    def max_positions(self) -> int:
        """Positions the rotary tables must cover by default (YaRN reaches past max_position_embeddings)."""
        return self.rope.max_positions(self.max_position_embeddings)

    def layer_kind(self, index: int) -> str:
        return self.layer_types[index] if self.layer_types else "full_attention"

    def attention_shape(self, kind: str) -> tuple[int, int, bool]:
        """(head_dim, num_kv_heads, k_eq_v) of an attention layer of ``kind``."""
        if kind == "full_attention":
            return (self.global_head_dim or self.head_dim, self.global_num_kv_heads or self.num_kv_heads,
                    self.global_k_eq_v)
        return self.head_dim, self.num_kv_heads, False


def layer_types_of(config: Any) -> tuple[str, ...]:
    """config.json's ``layer_types``, checked against the kinds llmcli runs."""
    kinds = tuple(getattr(config, "layer_types", None) or ())
    unknown = sorted(set(kinds) - set(LAYER_KINDS))
    if unknown:
        raise UnsupportedModelError(f"config.json layer_types has {', '.join(map(repr, unknown))}; llmcli runs "
                                    f"{', '.join(LAYER_KINDS)}")
    if kinds and len(kinds) != config.num_hidden_layers:
        raise UnsupportedModelError(f"config.json layer_types lists {len(kinds)} layers, num_hidden_layers is "
                                    f"{config.num_hidden_layers}")
    return kinds


class DecoderAttention(nn.Module):
    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, backend: AttentionBackend,
                 sliding_window: int | None = None, kind: str = "full_attention") -> None:
        super().__init__()
        head_dim, num_kv_heads, self.k_eq_v = spec.attention_shape(kind)
        self.head_dim = head_dim
        # a gated output doubles q_proj: per head its q rows, then its gate rows (so a rank's heads stay whole)
        self.gated = spec.attn_output_gate
        q_heads = spec.num_heads * (2 if self.gated else 1)
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, head_dim, q_heads, num_kv_heads, bias=spec.qkv_bias,
                                          with_v=not self.k_eq_v)
        self.num_heads = self.qkv_proj.num_heads // (2 if self.gated else 1)
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(spec.num_heads * head_dim, spec.hidden_size, bias=spec.o_bias)
        # the backend scales by spec.head_dim ** -0.5 (the model runner builds it so); another scale (a query
        # scale, or a layer of another head size) is folded into q's norm gain (rotary is linear)
        wanted = spec.query_scale or head_dim ** -0.5
        q_gain = wanted / spec.head_dim ** -0.5 if wanted != spec.head_dim ** -0.5 else 1.0
        if spec.qk_norm:
            self.q_norm = make_norm(spec, head_dim, gain=q_gain)
            self.k_norm = make_norm(spec, head_dim)
        elif q_gain != 1.0:
            raise UnsupportedModelError("a query scale other than head_dim ** -0.5 needs a q norm to fold it into")
        self.qk_norm = spec.qk_norm
        self.v_norm = spec.v_norm
        self.eps = spec.rms_norm_eps
        self.rotary = rotary
        self.rotary_dim = spec.rotary_dim if spec.rotary_dim is not None and spec.rotary_dim < head_dim else None
        self.sinks = None
        if spec.attention_sinks:  # this rank's heads' logits, [num_heads / tp]
            self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        self.attn = Attention(self.num_heads, self.num_kv_heads, head_dim, backend, sliding_window=sliding_window,
                              sinks=self.sinks)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = self.num_heads
        expect_shape(loaded, (n * tp_size(),))
        param.data.copy_(loaded.narrow(0, tp_rank() * n, n))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size * (2 if self.gated else 1), kv_size,
                                               0 if self.k_eq_v else kv_size], dim=-1)
        if self.k_eq_v:
            v = k
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.v_norm:
            v = rms_norm_no_gain(v, self.eps)
        gate = None
        if self.gated:  # strided views, each head contiguous: the q/k transform and the gate read them in place
            q, gate = q.view(-1, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        q, k = q.reshape(-1, self.num_heads, self.head_dim), k.reshape(-1, self.num_kv_heads, self.head_dim)
        q_w, k_w = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
        # the q/k transform (optional per-head norm, then rotary, partial where rotary_dim < head_dim) goes with the
        # attention call: the triton backend fuses it with its KV store (one kernel; layers/attention.py), the
        # others get it applied first. A zero-centred norm's 1 + w (and a query scale) is in its stored gain
        # (ZeroCentredRMSNorm), so the transform's weight_offset stays 0.
        transform = QKNormRotary(positions, q_w, k_w, self.eps, self.rotary.cos, self.rotary.sin,
                                 rotary_dim=self.rotary_dim)
        out = self.attn(q, k, v, transform)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.flatten(1, 2))


def make_norm(spec: DecoderSpec, size: int, gain: float = 1.0) -> RMSNorm:
    if spec.zero_centred_norms:
        return ZeroCentredRMSNorm(size, spec.rms_norm_eps, gain)
    if gain != 1.0:
        return ScaledRMSNorm(size, spec.rms_norm_eps, gain)
    return RMSNorm(size, spec.rms_norm_eps)


class DecoderMLP(nn.Module):
    def __init__(self, spec: DecoderSpec, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [size, size], bias=spec.mlp_bias)
        self.act = gated_activation(spec.hidden_act)
        self.down_proj = RowParallelLinear(size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm: a token mixer (attention, windowed or not, or a Gated DeltaNet) and an MLP, each over a
    residual; with ``sandwich_norms`` (Gemma) also a norm after the mixer and around the MLP."""

    def __init__(self, spec: DecoderSpec, rotary: RotaryEmbedding, backend: AttentionBackend,
                 mlp: nn.Module | None = None, kind: str = "full_attention") -> None:
        super().__init__()
        self.kind = kind
        self.input_layernorm = make_norm(spec, spec.hidden_size)
        if kind == "linear_attention":
            assert spec.linear is not None, "a linear_attention layer needs DecoderSpec.linear"
            self.linear_attn = GatedDeltaNet(spec.hidden_size, spec.linear, spec.rms_norm_eps, backend)
        else:
            window = spec.sliding_window if kind == "sliding_attention" else None
            self.self_attn = DecoderAttention(spec, rotary, backend, window, kind)
        self.post_attention_layernorm = make_norm(spec, spec.hidden_size)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = make_norm(spec, spec.hidden_size)
            self.post_feedforward_layernorm = make_norm(spec, spec.hidden_size)
        self.mlp = mlp if mlp is not None else DecoderMLP(spec)
        self.mlp_takes_stream = getattr(self.mlp, "takes_stream", False)  # Gemma 4's MoE reads the stream too
        if spec.layer_scalar:
            self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
            self.layer_scalar.dummy_value = 1.0
        else:
            self.layer_scalar = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.kind == "linear_attention":
            hidden = self.linear_attn(hidden)
        else:
            hidden = self.self_attn(positions, hidden)
        if not self.sandwich:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        hidden = self.mlp(hidden, residual) if self.mlp_takes_stream else self.mlp(hidden)
        hidden = self.post_feedforward_layernorm(hidden)
        if self.layer_scalar is not None:  # (hidden + residual) * s, with the sum left to the next norm
            return hidden * self.layer_scalar, residual * self.layer_scalar
        return hidden, residual


class DecoderModel(nn.Module):
    def __init__(self, spec: DecoderSpec, backend: AttentionBackend, max_positions: int,
                 make_mlp: Callable[[int], nn.Module | None] | None = None) -> None:
        """``make_mlp(layer_index)``: the MLP of each layer (default, or None: the dense gated ``DecoderMLP``)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size)
        self.embed_scale = spec.embed_scale
        # one cos/sin table shared by every layer of a kind, as long as the engine may go (max_model_len can
        # pass max_position_embeddings under YaRN)
        dim = spec.rotary_dim or spec.head_dim
        rotary = RotaryEmbedding(spec.rotary_dim or spec.global_head_dim or spec.head_dim, max_positions,
                                 spec.rope.theta, spec.rope, spec.max_position_embeddings)
        self.rotary = rotary
        local = rotary
        if spec.local_rope is not None or spec.global_head_dim:
            local_rope = spec.local_rope or spec.rope
            local = RotaryEmbedding(dim, max_positions, local_rope.theta, local_rope, spec.max_position_embeddings)
            self.rotary_local = local
        kinds = [spec.layer_kind(i) for i in range(spec.num_layers)]
        self.layers = nn.ModuleList(
            DecoderLayer(spec, local if kind == "sliding_attention" else rotary, backend,
                         make_mlp(i) if make_mlp else None, kind)
            for i, kind in enumerate(kinds))
        self.norm = make_norm(spec, spec.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:  # as Gemma: the scale rounded to the model dtype first
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
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
        self.final_logit_softcap = spec.final_logit_softcap
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def make_model(self, spec: DecoderSpec, backend: AttentionBackend, max_positions: int) -> nn.Module:
        """The decoder stack (a family with another MLP, e.g. MoE, passes its own ``make_mlp``)."""
        return DecoderModel(spec, backend, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head.compute_logits(hidden)
        if logits is not None and self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits


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
