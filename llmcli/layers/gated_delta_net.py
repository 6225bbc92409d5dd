"""The Gated DeltaNet layer (linear attention of Qwen3.5 / Qwen3.6 / Qwen3-Next): a recurrent state per sequence
instead of a KV cache.

in_proj -> q, k, v (through a causal depthwise conv1d + SiLU whose last K-1 inputs are carried), z (the output
gate), b (beta = sigmoid(b)) and a (decay g = -exp(A_log) * softplus(a + dt_bias)) -> the gated delta rule over
the recurrent state -> per-head RMSNorm gated by silu(z) -> out_proj.

Per-sequence state lives in a pool (``conv_state`` [rows, C, K-1], ``ssm_state`` [rows, Hv, Dk, Dv]) that the
engine attaches, one slot per block-table row (``AttentionMetadata.rows``); a chunk starts from a zero state
when it has no computed prefix (``AttentionMetadata.has_initial_state`` false), else from its slot. Tensor
parallelism splits the key and value heads (and the conv channels with them) across ranks; out_proj sums the partials.

Kernels: on CUDA, decode runs ``kernels/triton_gated_delta.py`` (the conv and the delta rule reading and writing
each row's states in place in the pool, graph-safe) and prefill its varlen conv plus fla-core's chunked rule;
elsewhere, or with ``LLMCLI_GDN=torch``, the torch reference (``kernels/gated_delta_torch.py``).

Checkpoint layouts: Qwen3.5 has ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``; Qwen3-Next fuses
them per key head (``in_proj_qkvz``: [q, k, v-group, z-group] per key head; ``in_proj_ba``). Each reaches its
slots of the one fused ``in_proj`` through the weight loader.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmcli.kernels.backend import AttentionBackend
from llmcli.kernels.gated_delta_torch import (causal_conv1d, causal_conv1d_step, gated_delta_rule_chunked,
                                              gated_delta_rule_step)
from llmcli.layers.linear import RowParallelLinear
from llmcli.layers.norm import gated_rms_norm
from llmcli.layers.state_segments import chunks_of
from llmcli.layers.weight_shape import expect_shape
from llmcli.parallel import tp_rank, tp_size

SLOTS = ("q", "k", "v", "z", "b", "a")
GDN_BACKENDS = ("auto", "torch")


@dataclass(frozen=True)
class GatedDeltaNetSpec:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    state_dtype: torch.dtype | None = None  # the recurrent state's dtype (None: float32)


class GatedDeltaNet(nn.Module):
    def __init__(self, hidden_size: int, spec: GatedDeltaNetSpec, eps: float,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        for name, n in (("linear_num_key_heads", spec.num_k_heads), ("linear_num_value_heads", spec.num_v_heads)):
            if n % self.tp_size:
                raise ValueError(f"{name} ({n}) is not divisible by tensor_parallel_size ({self.tp_size})")
        self.spec = spec
        self.hk, self.hv = spec.num_k_heads // self.tp_size, spec.num_v_heads // self.tp_size
        self.dk, self.dv = spec.head_k_dim, spec.head_v_dim
        key, value = self.hk * self.dk, self.hv * self.dv
        self.sizes = (key, key, value, value, self.hv, self.hv)  # this rank's q, k, v, z, b, a
        self.conv_dim = 2 * key + value
        self.in_proj = nn.Module()  # named like a linear layer's weight, for the loader's fused names
        self.in_proj.weight = nn.Parameter(torch.empty(sum(self.sizes), hidden_size), requires_grad=False)
        self.in_proj.weight.weight_loader = self.load_in_proj
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, spec.conv_kernel), requires_grad=False)
        self.conv1d.weight.weight_loader = self.load_conv
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        for p in (self.dt_bias, self.A_log):
            p.weight_loader = self.load_heads
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.dv), requires_grad=False)
        self.eps = eps
        self.out_proj = RowParallelLinear(spec.num_v_heads * self.dv, hidden_size)
        self.backend = backend  # the step's metadata (rows, lengths) comes through it
        self.conv_state: torch.Tensor | None = None  # [rows, conv_dim, K-1], attached by the engine
        self.ssm_state: torch.Tensor | None = None  # [rows, hv, dk, dv]

    # -- loading ---------------------------------------------------------------
    def _rank_part(self, t: torch.Tensor, total_heads: int) -> torch.Tensor:
        """This rank's heads of ``t`` (rows grouped by head, ``total_heads`` of them)."""
        per = t.shape[0] // total_heads * (total_heads // self.tp_size)
        return t.narrow(0, self.tp_rank * per, per)

    def load_in_proj(self, param: nn.Parameter, loaded: torch.Tensor, shard: str) -> None:
        spec = self.spec
        key, value, hv = spec.num_k_heads * spec.head_k_dim, spec.num_v_heads * spec.head_v_dim, spec.num_v_heads
        rows = {"qkv": 2 * key + value, "qkvz": 2 * key + 2 * value, "ba": 2 * hv, "q": key, "k": key, "v": value,
                "z": value, "b": hv, "a": hv}[shard]
        expect_shape(loaded, (rows, param.shape[1]))
        parts: dict[str, torch.Tensor]
        if shard == "qkv":
            key = spec.num_k_heads * spec.head_k_dim
            parts = dict(zip("qkv", loaded.split([key, key, spec.num_v_heads * spec.head_v_dim])))
        elif shard == "qkvz":  # per key head: q, k, then its group's v and z heads
            group = spec.num_v_heads // spec.num_k_heads
            per_head = loaded.view(spec.num_k_heads, -1, loaded.shape[-1])
            q, k, v, z = per_head.split([spec.head_k_dim, spec.head_k_dim, group * spec.head_v_dim,
                                         group * spec.head_v_dim], dim=1)
            parts = {n: t.reshape(-1, loaded.shape[-1]) for n, t in zip("qkvz", (q, k, v, z))}
        elif shard == "ba":
            group = spec.num_v_heads // spec.num_k_heads
            b, a = loaded.view(spec.num_k_heads, 2 * group, -1).split(group, dim=1)
            parts = {"b": b.reshape(-1, loaded.shape[-1]), "a": a.reshape(-1, loaded.shape[-1])}
        else:
            parts = {shard: loaded}
        for name, tensor in parts.items():
            slot = SLOTS.index(name)
            heads = spec.num_k_heads if name in "qk" else spec.num_v_heads
            param.data.narrow(0, sum(self.sizes[:slot]), self.sizes[slot]).copy_(self._rank_part(tensor, heads))

    def load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        spec = self.spec
        key, value = spec.num_k_heads * spec.head_k_dim, spec.num_v_heads * spec.head_v_dim
        expect_shape(loaded, (2 * key + value, 1, spec.conv_kernel))
        q, k, v = loaded.split([key, key, value])
        mine = [self._rank_part(q, spec.num_k_heads), self._rank_part(k, spec.num_k_heads),
                self._rank_part(v, spec.num_v_heads)]
        param.data.copy_(torch.cat(mine))

    def load_heads(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        expect_shape(loaded, (self.spec.num_v_heads,))
        param.data.copy_(self._rank_part(loaded, self.spec.num_v_heads))

    # -- state -----------------------------------------------------------------
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per slot: the conv state's and the recurrent state's shapes."""
        return (self.conv_dim, self.spec.conv_kernel - 1), (self.hv, self.dk, self.dv)

    # -- forward ---------------------------------------------------------------
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        meta = self.backend.metadata if self.backend is not None else None
        assert meta is not None and meta.rows is not None, "a linear-attention layer needs the step's rows"
        proj = F.linear(hidden, self.in_proj.weight)
        q, k, v, z, b, a = proj.split(self.sizes, dim=-1)
        mixed = proj[:, :self.conv_dim]  # q, k, v: the conv's channels
        weight = self.conv1d.weight[:, 0]
        split = meta.linear_step if meta.is_prefill else None
        if not meta.is_prefill:
            out = self._decode_rows(mixed, a, b, weight, meta.rows)
        elif split is None:
            out = self._chunks(mixed, *self._decay_beta(a, b), weight, meta)
        else:  # a mixed step: its decode rows in place, then the chunks (layers/state_segments.py)
            k = split.num_decode
            parts = [self._decode_rows(mixed[:k], a[:k], b[:k], weight, meta.rows[:k])] if k else []
            if split.rest is not None:
                parts.append(self._chunks(mixed[k:], *self._decay_beta(a[k:], b[k:]), weight, split.rest))
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        out = gated_rms_norm(out, z.reshape(-1, self.hv, self.dv), self.norm.weight, self.eps)
        return self.out_proj(out.reshape(hidden.shape[0], -1))

    def _decay_beta(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token decay (log space) and write strength from the raw projections."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float()), torch.sigmoid(b)

    def _decode_rows(self, mixed, a, b, weight, rows) -> torch.Tensor:
        """One token per row, each continuing its own row's state: the Triton kernels in place on CUDA."""
        if use_cuda_kernels(mixed):
            return self._decode_in_place(mixed, a, b, weight, rows)
        return self._decode(mixed, *self._decay_beta(a, b), weight, rows)

    def _split_heads(self, mixed: torch.Tensor):
        key = self.hk * self.dk
        q, k, v = mixed.split([key, key, self.hv * self.dv], dim=-1)
        return q.reshape(-1, self.hk, self.dk), k.reshape(-1, self.hk, self.dk), v.reshape(-1, self.hv, self.dv)

    def _chunks(self, mixed, g, beta, weight, meta) -> torch.Tensor:
        """Each chunk of a varlen step (prompt chunks and, in a mixed step, decode rows): the conv per chunk, then
        the delta rule per chunk (torch) or over the whole varlen batch at once (fla on CUDA). With prefix
        caching on a hybrid model, ``meta.state_segments`` says which slot each chunk starts from (a snapshot's,
        for a prefix hit) and where to cut chunks to store snapshots (layers/state_segments.py). On CUDA nothing
        here reads a device value back: ``meta.chunks`` holds the chunks' host values."""
        pool = self.conv_state is not None  # none yet in the start-up warm-up: nothing read or kept
        chunks = chunks_of(meta, pool)
        cu, rows, fresh = chunks.cu, chunks.rows, chunks.fresh
        segments = meta.state_segments if pool else None
        sources = segments.sources if segments is not None else rows
        cuts = segments.cuts if segments is not None else {}
        width = weight.shape[1] - 1

        def start(i: int) -> torch.Tensor | None:  # the conv state chunk i continues (None: zeros)
            return None if fresh[i] else self.conv_state[sources[i]]

        for i, offsets in cuts.items():  # the conv state after a cut: the K-1 inputs before it
            before = start(i) if not fresh[i] else self.conv_state.new_zeros(self.conv_dim, width)
            window = torch.cat([before, mixed[cu[i]:cu[i + 1]].t().to(before.dtype)], dim=1)
            for offset, slot in offsets:
                self.conv_state[slot].copy_(window[:, offset:offset + width])
        if use_cuda_kernels(mixed):  # every chunk's conv in one launch, the conv states updated in place
            from llmcli.kernels.triton_gated_delta import conv_varlen_

            if pool and chunks.moved is not None:  # chunks starting from a snapshot: its conv state into their rows
                into, source = chunks.moved
                self.conv_state.index_copy_(0, into, self.conv_state.index_select(0, source))
            x = conv_varlen_(mixed, weight, self.conv_state, meta.rows, chunks.carried, meta.cu_seqlens_q)
        else:
            x = torch.empty_like(mixed)
            for i, row in enumerate(rows):
                x[cu[i]:cu[i + 1]], new_conv = causal_conv1d(mixed[cu[i]:cu[i + 1]], weight, start(i))
                if pool:
                    self.conv_state[row].copy_(new_conv)
        q, k, v = self._split_heads(x)
        if use_cuda_kernels(mixed):
            from llmcli.kernels.gated_delta_fla import chunked_varlen  # CUDA only: fla queries the driver

            if pool:
                index = torch.remainder(meta.rows, self.ssm_state.shape[0])
                initial = self.ssm_state[segments.source if segments is not None else index].float()
                initial.masked_fill_(~chunks.carried.view(-1, 1, 1, 1), 0.0)
            else:
                initial = q.new_zeros(len(rows), self.hv, self.dk, self.dv, dtype=torch.float32)
            if segments is None:
                out, final = chunked_varlen(q, k, v, g, beta, initial, chunks.cu_seqlens, chunks.chunk_indices)
            else:
                out, final = self._chunk_passes(q, k, v, g, beta, initial, chunks, segments)
            if pool:
                self.ssm_state.index_copy_(0, index, final.to(self.ssm_state.dtype))
            return out
        out = v.new_empty(v.shape)
        for i, row in enumerate(rows):
            lo, hi = cu[i], cu[i + 1]
            state = None if fresh[i] else self.ssm_state[sources[i]]
            ends = dict(cuts.get(i, ()))
            bounds = [lo, *sorted(lo + o for o in ends if o < hi - lo), hi]
            for a, b in zip(bounds, bounds[1:]):
                out[a:b], state = gated_delta_rule_chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state)
                if b - lo in ends:
                    self.ssm_state[ends[b - lo]].copy_(state)
            if pool:
                self.ssm_state[row].copy_(state)
        return out

    def _chunk_passes(self, q, k, v, g, beta, state, chunks, segments):
        """fla's varlen delta rule in the passes ``segments`` cuts the chunks into, storing the snapshots."""
        from llmcli.kernels.gated_delta_fla import chunked_varlen

        out = None
        for p in segments.passes:
            if p.tokens is None:
                out, state = chunked_varlen(q, k, v, g, beta, state, chunks.cu_seqlens, chunks.chunk_indices)
                final = state
            else:
                start = state if p.entries is None else state.index_select(0, p.entries)
                part, final = chunked_varlen(q[p.tokens], k[p.tokens], v[p.tokens], g[p.tokens], beta[p.tokens],
                                             start, p.cu_seqlens, p.chunk_indices)
                if out is None:
                    out = part.new_empty(v.shape)
                out[p.tokens] = part
                if p.entries is None:
                    state = final
                else:
                    state.index_copy_(0, p.entries, final.to(state.dtype))
            for j, slot in p.snapshots:
                self.ssm_state[slot].copy_(final[j])
        return out, state

    def _decode(self, mixed, g, beta, weight, rows) -> torch.Tensor:
        """One token per row, batched, in torch (padding rows of a graph batch have a scratch slot)."""
        rows = torch.remainder(rows, self.ssm_state.shape[0])  # a graph's padding rows (-1): the scratch slot
        x, conv = causal_conv1d_step(mixed, weight, self.conv_state[rows])
        q, k, v = self._split_heads(x)
        out, ssm = gated_delta_rule_step(q, k, v, g, beta, self.ssm_state[rows])
        self.conv_state.index_copy_(0, rows, conv.to(self.conv_state.dtype))
        self.ssm_state.index_copy_(0, rows, ssm.to(self.ssm_state.dtype))
        return out

    def _decode_in_place(self, mixed, a, b, weight, rows) -> torch.Tensor:
        """One token per row through the Triton kernels, each row's states updated where they live in the pool
        (padding rows, -1: none read or written); decay and beta computed in the kernel from the raw a and b."""
        from llmcli.kernels.triton_gated_delta import conv_step_, gated_delta_step_

        q, k, v = self._split_heads(conv_step_(mixed, weight, self.conv_state, rows))
        return gated_delta_step_(q, k, v, a, b, self.A_log, self.dt_bias, self.ssm_state, rows)


def use_cuda_kernels(x: torch.Tensor) -> bool:
    """On CUDA: the Triton kernels (decode, the prefill conv) and fla-core's chunked rule (prefill);
    ``LLMCLI_GDN=torch`` keeps the torch reference there too."""
    mode = os.environ.get("LLMCLI_GDN", "auto") or "auto"
    if mode not in GDN_BACKENDS:
        raise ValueError(f"LLMCLI_GDN={mode!r}: expected one of {', '.join(GDN_BACKENDS)}")
    return x.is_cuda and mode != "torch"
