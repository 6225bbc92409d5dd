"""The ``triton`` attention backend: llmcli's own Triton kernels behind the AttentionBackend interface.

Per layer: store the new K/V into the paged cache (with q/k's RMSNorm and rotary in the same kernel when the
layer hands over a ``QKNormRotary``: ``triton_elementwise.qk_norm_rotary_store``), then either prefill
(paged, when some chunk has a cached prefix; plain varlen otherwise) or
split-KV paged decode. The per-step work that does not depend on the layer
(the decode split count and its scratch space) happens once in ``prepare``.
The split partials' scratch buffers only ever grow, are preallocated for the
largest graph batch in ``init_graph_buffers``, and outgrown ones are kept alive,
so captured graphs keep pointing at live memory.
"""
from __future__ import annotations

import torch

from llmcli.kernels import triton_elementwise
from llmcli.kernels.backend import AttentionBackend, AttentionMetadata, GraphInputs, KVScales, QKNormRotary
from llmcli.kernels.triton_decode import (
    DecodeTuning, choose_num_splits, default_tuning, paged_decode, scratch_numel,
)
from llmcli.kernels.triton_prefill import LARGE_TILES_FROM, LONG_TILES_FROM, prefill_paged, prefill_varlen
from llmcli.kernels.triton_store import store_kv

_DEFAULT_SMS = 132  # H200; used when the device cannot be asked (CPU interpreter)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it if it does not start on a 16-byte boundary."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    fuses_qk_norm_rotary = True
    prefill_variant_lengths = (16, LARGE_TILES_FROM, LONG_TILES_FROM)

    @classmethod
    def block_size_problem(cls, block_size: int) -> str | None:
        # the decode and prefill kernels tile a block as one power-of-two range of rows
        if block_size & (block_size - 1) or not 16 <= block_size <= 256:
            return "the triton backend needs a power of two from 16 to 256"
        return None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        if head_dim & (head_dim - 1) or head_dim < 16:
            raise ValueError(f"the triton backend needs a power-of-two head_dim >= 16, got {head_dim}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_splits = 1
        self.force_num_splits: int | None = None  # tests and benchmarks pin the split count with this
        self.decode_tuning: DecodeTuning = default_tuning(head_dim)  # and the decode launch settings with this
        self._tuned_head_dim = head_dim  # decode_tuning's; the model runner may widen head_dim (Gemma 4)
        self._num_sms: int | None = None
        self._part_out: torch.Tensor | None = None
        self._part_lse: torch.Tensor | None = None
        self._outgrown: list[torch.Tensor] = []  # replaced scratch a captured graph may still point at
        self._rest_cu_q: torch.Tensor | None = None
        self._rest_lens: torch.Tensor | None = None
        self._rest_tables: torch.Tensor | None = None
        # this step's decode rows and longest context, and the split count of each sliding window seen in it
        self._decode_shape: tuple[int, int, torch.device] | None = None
        self._window_splits: dict[int, int] = {}

    # -- per-step ----------------------------------------------------------------
    def _sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            if device.type == "cuda":
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = _DEFAULT_SMS
        return self._num_sms

    def _splits_for(self, batch: int, max_seqlen_k: int, device: torch.device) -> int:
        if self.force_num_splits is not None:
            return self.force_num_splits
        return choose_num_splits(batch, self.num_kv_heads, max_seqlen_k, self._sms(device))

    def _ensure_scratch(self, batch: int, num_splits: int, device: torch.device) -> None:
        n_out, n_lse = scratch_numel(batch, self.num_heads, self.head_dim, num_splits)
        if self._part_out is None or self._part_out.numel() < n_out or self._part_out.device != device:
            self._retire(self._part_out)
            self._part_out = torch.empty(max(n_out, 1), dtype=torch.float32, device=device)
        if self._part_lse is None or self._part_lse.numel() < n_lse or self._part_lse.device != device:
            self._retire(self._part_lse)
            self._part_lse = torch.empty(max(n_lse, 1), dtype=torch.float32, device=device)

    def _retire(self, old: torch.Tensor | None) -> None:
        if old is not None and old.device.type == "cuda":
            self._outgrown.append(old)

    def prepare(self, metadata: AttentionMetadata) -> None:
        super().prepare(metadata)
        if metadata.is_prefill:
            if metadata.num_decode:  # a mixed step: its decode rows go through the split-KV decode kernel
                nd = metadata.num_decode
                device = metadata.context_lens.device
                self._set_decode_shape(nd, metadata.max_seqlen_k, device)
                self.num_splits = self._splits_for(nd, metadata.max_seqlen_k, device)
                self._ensure_scratch(nd, self.num_splits, device)
                self._rest_cu_q = metadata.cu_seqlens_q[nd:] - nd
                # Triton compiles one kernel per 16-byte alignment of each pointer: views that start at row nd
                # would need (and compile, mid-run) other variants than a prefill step's whenever nd % 4 != 0
                self._rest_lens = _aligned(metadata.context_lens[nd:])
                tables = metadata.block_tables
                self._rest_tables = None if tables is None else _aligned(tables[nd:])
                self._rest_by_group = {0: self._rest_tables}
            return
        batch = metadata.batch_size
        max_seqlen_k = metadata.max_seqlen_k
        if max_seqlen_k <= 0 and metadata.block_tables is not None:
            # not filled in by the caller: the table width bounds every context (a host-side shape)
            max_seqlen_k = metadata.block_tables.shape[1] * self.block_size
        device = metadata.context_lens.device
        self._set_decode_shape(batch, max_seqlen_k, device)
        self.num_splits = self._splits_for(batch, max_seqlen_k, device)
        self._ensure_scratch(batch, self.num_splits, device)

    def use_group(self, group: int) -> None:
        super().use_group(group)
        meta = self.metadata
        if meta is not None and meta.is_prefill and meta.num_decode:  # the mixed step's chunks' tables too
            rest = self._rest_by_group.get(group)
            if rest is None and meta.block_tables is not None:
                rest = self._rest_by_group[group] = _aligned(meta.block_tables[meta.num_decode:])
            self._rest_tables = rest

    def _set_decode_shape(self, batch: int, max_seqlen_k: int, device: torch.device) -> None:
        self._decode_shape = (batch, max_seqlen_k, device)
        self._window_splits = {}

    def _decode_splits(self, window: int | None) -> int:
        """The decode split count of a layer: a sliding-window layer splits only the window's keys (never more
        splits than the step's full-attention layers, so the scratch sized in ``prepare`` holds them). Host ints
        only, so a captured graph gets the same count every replay."""
        if window is None or self._decode_shape is None:
            return self.num_splits
        if window not in self._window_splits:
            batch, max_seqlen_k, device = self._decode_shape
            self._window_splits[window] = min(self.num_splits,
                                              self._splits_for(batch, min(max_seqlen_k, window), device))
        return self._window_splits[window]

    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device,
                           inputs: GraphInputs | None = None, groups: int = 1) -> None:
        super().init_graph_buffers(max_batch_size, max_blocks_per_seq, device, inputs, groups)
        # Size the scratch for the hungriest graph batch now, so capture never allocates it.
        max_len = max_blocks_per_seq * self.block_size
        worst = max(range(1, max_batch_size + 1), key=lambda b: b * self._splits_for(b, max_len, device))
        self._ensure_scratch(worst, self._splits_for(worst, max_len, device), device)

    # -- per-layer ---------------------------------------------------------------
    writes_out = True  # forward(..., out=) writes a prefill or mixed step's attention where the caller says

    def forward(self, q, k, v, k_cache, v_cache, qk_norm: QKNormRotary | None = None,
                out: torch.Tensor | None = None, kv_scales: KVScales = (1.0, 1.0), window: int | None = None,
                sinks: torch.Tensor | None = None):
        meta = self.metadata
        assert meta is not None, "prepare() must run before forward()"
        has_cache = k_cache is not None and k_cache.numel()
        if qk_norm is not None:
            # looked up at call time: a test may reload the kernel module under the interpreter
            te, n = triton_elementwise, qk_norm
            if has_cache:
                q, k = te.qk_norm_rotary_store(q, k, v, n.positions, n.q_weight, n.k_weight, n.eps, n.cos, n.sin,
                                               k_cache, v_cache, meta.slot_mapping, kv_scales=kv_scales,
                                               rotary_dim=n.rotary_dim, weight_offset=n.weight_offset)
            else:  # start-up's warm-up pass, before the pool exists
                q, k = te.qk_norm_rotary(q, k, n.positions, n.q_weight, n.k_weight, n.eps, n.cos, n.sin,
                                         rotary_dim=n.rotary_dim, weight_offset=n.weight_offset)
        elif has_cache:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        if meta.is_prefill and meta.num_decode:
            return self._mixed(q, k, v, k_cache, v_cache, meta, out, kv_scales, window, sinks)
        if meta.is_prefill:
            assert meta.cu_seqlens_q is not None
            if meta.has_prefix:
                assert meta.block_tables is not None and k_cache is not None
                return prefill_paged(q, k, v, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                     meta.context_lens, meta.max_seqlen_q, self.scale, out=out,
                                     kv_scales=kv_scales, window=window, sinks=sinks)
            return prefill_varlen(q, k, v, meta.cu_seqlens_q, meta.max_seqlen_q, self.scale, out=out, window=window,
                                  sinks=sinks)
        assert meta.block_tables is not None and k_cache is not None
        return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.context_lens, self.scale,
                            num_splits=self._decode_splits(window), part_out=self._part_out, part_lse=self._part_lse,
                            tuning=self.decode_tuning_for(q.shape[-1]), row_order=self._order(meta, q.shape[-1]),
                            kv_scales=kv_scales, window=window, sinks=sinks)

    def decode_tuning_for(self, head_dim: int) -> DecodeTuning:
        """A layer's decode launch settings: ``decode_tuning`` at the model's head dim, the default of a layer of
        another (Gemma 4's 512-wide global layers beside 256-wide local ones)."""
        return self.decode_tuning if head_dim == self._tuned_head_dim else default_tuning(head_dim)

    def _order(self, meta: AttentionMetadata, head_dim: int) -> torch.Tensor | None:
        """The decode rows' launch order (longest first), where the launch settings take one."""
        return meta.row_order if self.decode_tuning_for(head_dim).heads_fastest else None

    def _mixed(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, out: torch.Tensor | None = None,
               kv_scales: KVScales = (1.0, 1.0), window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Decode rows (the first ``num_decode``) by the decode kernel, the prompt chunks after them by prefill."""
        nd, head_dim = meta.num_decode, q.shape[-1]
        out = torch.empty_like(q) if out is None else out
        assert meta.block_tables is not None and k_cache is not None
        paged_decode(q[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.context_lens[:nd], self.scale,
                     num_splits=self._decode_splits(window), part_out=self._part_out, part_lse=self._part_lse,
                     out=out[:nd], tuning=self.decode_tuning_for(head_dim), row_order=self._order(meta, head_dim),
                     kv_scales=kv_scales, window=window, sinks=sinks)
        if nd < q.shape[0]:
            if meta.rest_has_prefix:
                prefill_paged(q[nd:], k[nd:], v[nd:], k_cache, v_cache, self._rest_tables, self._rest_cu_q,
                              self._rest_lens, meta.rest_max_seqlen_q, self.scale, out=out[nd:],
                              kv_scales=kv_scales, window=window, sinks=sinks)
            else:
                prefill_varlen(q[nd:], k[nd:], v[nd:], self._rest_cu_q, meta.rest_max_seqlen_q, self.scale,
                               out=out[nd:], window=window, sinks=sinks)
        return out
