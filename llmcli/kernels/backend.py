"""The attention backend interface: per-step metadata prepared once, forward per layer.

The model runner builds one ``AttentionMetadata`` per step and hands it to the
backend with ``prepare``; every attention layer then calls ``forward`` with its
own q/k/v and its own KV-cache views. Backends never look anything up in a
global: all they need for a step arrives through ``prepare``.

KV-cache layout (shared by every backend): per layer one key and one value
tensor of shape ``[num_blocks, block_size, num_kv_heads, head_dim]``; token
``t`` of a sequence lives in block ``block_table[t // block_size]`` at row
``t % block_size``; its flat slot is ``block * block_size + row``.

Fusing the q/k transform with the store: a model whose q and k need the rotary embedding (every family), with a
per-head RMSNorm before it or not (Qwen3: yes; Llama, Qwen2, Mistral: no), describes that work as a
``QKNormRotary``. A backend with
``fuses_qk_norm_rotary`` may be handed it with the un-normalised q and k and then does the transform and its
KV store in one pass; the attention layer decides when (``llmcli.layers.attention``) and otherwise applies
the transform itself, so the other backends only ever see finished q and k.

FP8 KV cache: caches of ``torch.float8_e4m3fn`` hold ``value / scale``, saturated at +-448, one key and one
value scale per layer (``KVScales``); every read multiplies by the scale. The attention layer passes
``kv_scales`` only with such a cache, so a backend that does not take the argument (flash-attn) is never
handed one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any

import torch

KVScales = tuple[float, float]  # (k_scale, v_scale) of one layer's FP8 cache


@dataclass
class AttentionMetadata:
    """What a step looks like to attention. All tensors live on the model's device.

    Prefill steps carry a batch of chunks: chunk ``i`` has queries
    ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]`` and attends causally over
    ``context_lens[i] = cu_seqlens_k[i+1] - cu_seqlens_k[i]`` keys, the last
    ``q_len`` of which are the chunk itself and the rest its cached prefix.
    Decode steps carry exactly one query token per sequence.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each new token (-1: don't store)
    context_lens: torch.Tensor  # [batch] int32, keys each sequence attends over (prefix + new)
    block_tables: torch.Tensor | None  # [batch, max_blocks] int32, -1 padded; None in a prefill with no prefix
    cu_seqlens_q: torch.Tensor | None = None  # [batch+1] int32 (prefill only)
    cu_seqlens_k: torch.Tensor | None = None  # [batch+1] int32 (prefill only)
    max_seqlen_q: int = 1
    max_seqlen_k: int = 0
    has_prefix: bool = False  # prefill: some chunk attends over keys already in the cache
    # prefill: the first ``num_decode`` chunks are single tokens over a cached prefix (the decode rows of a
    # mixed step), which a backend may send through its decode kernel; the other chunks' longest query and
    # whether any of them has a cached prefix
    num_decode: int = 0
    rest_max_seqlen_q: int = 0
    rest_has_prefix: bool = False
    # decode rows (a decode step's, a mixed step's first num_decode): int64, the rows longest context first, in
    # which order a backend may launch their work (None: as they come). Padding rows of a graph come last.
    row_order: torch.Tensor | None = None
    # [batch] int64: each entry's block-table row (the step plan's ``rows``), which is also the slot of any
    # per-sequence state a layer keeps (a recurrent state); -1 for a graph's padding rows
    rows: torch.Tensor | None = None
    # prefill: [batch] bool, the chunk continues a sequence whose state is cached (computed tokens > 0)
    has_initial_state: torch.Tensor | None = None
    # prefill of a hybrid model with prefix caching: where each chunk's linear-attention state comes from and the
    # snapshots to take inside chunks (layers/state_segments.py's StateSegments; None: each from its own row)
    state_segments: Any = None
    # prefill of a hybrid model: the decode rows its linear-attention layers split off, and the rest
    # (layers/state_segments.py's LinearStep; None: every chunk as a chunk)
    linear_step: Any = None
    # prefill of a hybrid model: its chunks on the host and fla's chunk indices, uploaded once for every layer
    # (layers/state_segments.py's Chunks; None: the layers derive them, reading the device)
    chunks: Any = None
    # a model with several KV groups (full and sliding-window layers, each kind its own block table per
    # sequence): ``slot_mapping`` and ``block_tables`` above are group 0's, these the other groups'
    group_slots: tuple[torch.Tensor, ...] = ()
    group_tables: tuple[torch.Tensor | None, ...] = ()

    @property
    def batch_size(self) -> int:
        return self.context_lens.numel()

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata a layer of KV group ``group`` reads: that group's slots and block tables (itself where
        it has no groups: start-up's dummy steps, before the pool exists)."""
        if group == 0 or not self.group_slots:
            return self
        return replace(self, slot_mapping=self.group_slots[group - 1], block_tables=self.group_tables[group - 1])


@dataclass
class GraphInputs:
    """Per-row buffers a decode graph's attention reads, [max batch] each, filled by the caller before a replay."""

    slot_mapping: torch.Tensor  # int64
    context_lens: torch.Tensor  # int32
    row_order: torch.Tensor  # int64
    rows: torch.Tensor  # int64 (AttentionMetadata.rows)
    group_slots: tuple[torch.Tensor, ...] = field(default=())  # int64, KV groups 1.. (AttentionMetadata.group_slots)


@dataclass
class QKNormRotary:
    """The transform q and k still need before attention: per-head RMSNorm (``weight * (x / rms(x)).to(dtype)``;
    none when the weights are None), then the rotate-half rotary embedding at ``positions`` from the
    ``[max_position, rotary_dim]`` cos/sin tables on the first ``rotary_dim`` dims of each head (partial rotary:
    Qwen3.5's ``partial_rotary_factor``; the rest pass through normed only).

    ``weight_offset`` != 0 is the zero-centred norm of Qwen3.5, Qwen3-Next and Gemma 3 (``1 + w``), computed as
    transformers does: ``(x / rms(x) * (weight_offset + weight))`` in float32, rounded once."""

    positions: torch.Tensor  # [num_tokens] int64
    q_weight: torch.Tensor | None  # [head_dim]; None: no q/k norm
    k_weight: torch.Tensor | None  # [head_dim]
    eps: float
    cos: torch.Tensor  # [max_position, rotary_dim] float32
    sin: torch.Tensor
    rotary_dim: int | None = None  # None: the tables' width (the whole head for most models)
    weight_offset: float = 0.0


def rotary_width(head_dim: int, cos: torch.Tensor, rotary_dim: int | None = None) -> int:
    """How many leading dims of each head the rotary embedding turns: ``rotary_dim``, else the tables' width.

    The tables must be exactly that wide (rotate-half pairs dim ``i`` with ``i + rotary_dim / 2``, so a table
    built for the whole head cannot serve a partial rotary)."""
    width = cos.shape[-1]
    dim = width if rotary_dim is None else rotary_dim
    if dim != width or dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"rotary_dim {rotary_dim} with cos/sin tables {width} wide and head_dim {head_dim}: the "
                         f"tables must be rotary_dim wide, an even number of dims up to head_dim")
    return dim


class AttentionBackend(ABC):
    """One implementation of paged attention. One instance serves every layer of a model."""

    name: str = "abstract"
    # Whether ``forward`` takes ``qk_norm`` (un-normalised q/k: it normalises, rotates and stores them in one go).
    fuses_qk_norm_rotary: bool = False
    # Chunk lengths that between them reach every compiled prefill variant; the runner runs each at start-up.
    prefill_variant_lengths: tuple[int, ...] = (16,)
    # KV block size when the user leaves it unset; None: the engine's default (config.DEFAULT_KVCACHE_BLOCK_SIZE).
    default_block_size: int | None = None

    @classmethod
    def block_size_problem(cls, block_size: int) -> str | None:
        """Why this backend cannot page with ``block_size``-token KV blocks, or None: it can. Config asks at
        validation, before anything is built."""
        return None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size
        self.metadata: AttentionMetadata | None = None

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Called once per step before the forward pass."""
        self.metadata = metadata
        self._by_group: dict[int, AttentionMetadata] = {0: metadata}

    def use_group(self, group: int) -> None:
        """Read KV group ``group``'s slots and block tables from now on (the attention layer of a model with
        several groups calls it before ``forward``; a one-group model never does)."""
        meta = self._by_group.get(group)
        if meta is None:
            meta = self._by_group[group] = self._by_group[0].for_group(group)
        self.metadata = meta

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads, head_dim]; None before the pool exists
        v_cache: torch.Tensor | None,
        qk_norm: QKNormRotary | None = None,
        kv_scales: KVScales = (1.0, 1.0),
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store the new k/v in the cache, then attend. Runs once per layer.

        ``qk_norm`` comes only to a backend with ``fuses_qk_norm_rotary``: q and k are then still to be
        transformed by it, and the cache gets the transformed k (with v as it is). ``kv_scales``: the layer's
        FP8 cache scales (see the module docstring). ``window``: the layer's sliding window (transformers'
        semantics: the query at position p sees the keys at p - window + 1 .. p; None: every earlier key).
        ``sinks`` [num_heads] float32: the layer's attention-sink logits (gpt-oss: one more logit per head in the
        softmax's denominator, weighing no value); None: none. Like the window, passed only when set."""

    # -- CUDA-graph support (decode only) -------------------------------------
    def init_graph_buffers(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device,
                           inputs: GraphInputs | None = None, groups: int = 1) -> None:
        """Allocate the static metadata buffers that captured graphs read from. ``inputs``: the per-row
        buffers the caller fills before each replay (``llmcli.engine.cuda_graphs`` stages them with the step's
        other inputs in one copy); the backend reads them in place of its own. The block tables stay the
        backend's: ``gather_graph_tables`` fills them, one per KV group (``groups``)."""
        if inputs is None:
            inputs = GraphInputs(torch.zeros(max_batch_size, dtype=torch.int64, device=device),
                                 torch.zeros(max_batch_size, dtype=torch.int32, device=device),
                                 torch.arange(max_batch_size, dtype=torch.int64, device=device),
                                 torch.full((max_batch_size,), -1, dtype=torch.int64, device=device))
        if len(inputs.group_slots) < groups - 1:
            inputs = replace(inputs, group_slots=tuple(
                torch.full((max_batch_size,), -1, dtype=torch.int64, device=device) for _ in range(groups - 1)))
        self._graph_slots, self._graph_lens = inputs.slot_mapping, inputs.context_lens
        self._graph_order, self._graph_rows = inputs.row_order, inputs.rows
        self._graph_group_slots = inputs.group_slots[:groups - 1]
        self._graph_tables = torch.zeros(max_batch_size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self._graph_group_tables = tuple(torch.zeros_like(self._graph_tables) for _ in range(groups - 1))

    def gather_graph_tables(self, table: torch.Tensor, rows: torch.Tensor,
                            group_tables: tuple[torch.Tensor, ...] = ()) -> None:
        """The graph's block tables for a step of ``len(rows)`` entries: rows ``rows`` of ``table`` (the runner's
        device copy of every live table) and of each other KV group's ``group_tables``, gathered into the static
        buffers."""
        torch.index_select(table, 0, rows, out=self._graph_tables[:rows.numel()])
        for src, out in zip(group_tables, self._graph_group_tables):
            torch.index_select(src, 0, rows, out=out[:rows.numel()])

    def prepare_for_capture(self, batch_size: int) -> None:
        """Point the metadata at the static buffers for a graph of ``batch_size`` sequences."""
        self.prepare(AttentionMetadata(
            is_prefill=False,
            slot_mapping=self._graph_slots[:batch_size],
            context_lens=self._graph_lens[:batch_size],
            block_tables=self._graph_tables[:batch_size],
            max_seqlen_k=self._graph_tables.shape[1] * self.block_size,
            row_order=self._graph_order[:batch_size],
            rows=self._graph_rows[:batch_size],
            group_slots=tuple(slots[:batch_size] for slots in self._graph_group_slots),
            group_tables=tuple(tables[:batch_size] for tables in self._graph_group_tables),
        ))

    def prepare_for_replay(self, metadata: AttentionMetadata, batch_size: int) -> None:
        """Copy a real decode step's metadata into the static buffers (padding rows get slot -1, length 0)."""
        n = metadata.batch_size
        self._graph_slots[:batch_size].fill_(-1)
        self._graph_lens[:batch_size].zero_()
        self._graph_rows[:batch_size].fill_(-1)
        self._graph_slots[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self._graph_lens[:n].copy_(metadata.context_lens, non_blocking=True)
        if metadata.rows is not None:
            self._graph_rows[:n].copy_(metadata.rows, non_blocking=True)
        assert metadata.block_tables is not None
        width = metadata.block_tables.shape[1]
        self._graph_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        for slots, tables, src_slots, src_tables in zip(self._graph_group_slots, self._graph_group_tables,
                                                        metadata.group_slots, metadata.group_tables):
            slots[:batch_size].fill_(-1)
            slots[:n].copy_(src_slots, non_blocking=True)
            assert src_tables is not None
            tables[:n, :src_tables.shape[1]].copy_(src_tables, non_blocking=True)
        # longest first over all rows (the padding rows, of length 0, sort last)
        self._graph_order[:batch_size].copy_(torch.argsort(self._graph_lens[:batch_size], descending=True, stable=True))
        self.prepare_for_capture(batch_size)
