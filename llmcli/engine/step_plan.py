"""The step plan: what the scheduler decided for one step, as plain data the model runner reads.

The scheduler side (``engine/plan_builder.py``) writes one ``StepPlan`` per step from its ``Sequence``
objects; the runner side (``model_runner.py``, ``step_inputs.py``, ``cuda_graphs.py``, ``parallel/``) reads
only this. One rank and every tensor-parallel rank read the same plan: it is also the control plane's wire
format (rank 0 sends it without ``extras``, which only the sampling rank needs).

Everything per sequence is keyed by its block-table row (``rows``): the runner's row table
(``engine/row_table.py``) keeps what a row needs across steps (block table, sampling settings) and is
refreshed from ``new_rows`` / ``blocks`` / ``freed`` only when a row changes hands or grows. A model with
several KV groups (full and sliding-window layers: engine/kv_groups.py) sends the other groups' tables in
``group_blocks``; a released window block is never re-sent (the kernels read no block before the window). A
new cache kind is one more field here, keyed by row the same way.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from llmcli.sampling_params import SamplingParams


@dataclass
class RowSettings:
    """A row's sampling settings, built once from ``SamplingParams`` when a sequence takes the row."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    num_prompt_tokens: int  # a sampled token's step (its seed stream's counter) is its index past the prompt
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @classmethod
    def of(cls, params: SamplingParams, seed: int, num_prompt_tokens: int) -> "RowSettings":
        return cls(params.temperature, params.top_p, params.top_k, params.min_p, seed, num_prompt_tokens,
                   params.repetition_penalty, params.presence_penalty, params.frequency_penalty)


@dataclass
class ExtrasPlan:
    """Penalties, logit biases, min_tokens and logprobs of one step, as lists the runner uploads.

    Logit rows count the step's sampled rows; penalty and bias rows are rows of the device token tables,
    which are the sequences' block-table rows (filled afresh when a row changes hands, ``engine/extras_plan.py``;
    the penalty values are in the runner's row table, set with ``new_rows``); ``*_inputs`` are rows of the
    step's input tokens (an in-flight token is counted from the device).
    """

    # penalties: (logit rows, table rows); rows taken afresh and their prompt (row, id) pairs; host-known
    # (row, id) pairs; (row, input row) of tokens read on the device
    pen_logit_rows: list[int] = field(default_factory=list)
    pen_rows: list[int] = field(default_factory=list)
    pen_start: tuple[list[int], list[int], list[int]] = field(default_factory=lambda: ([], [], []))
    pen_known: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    pen_from_input: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    # logit biases: logit rows and bias-table slots; new slots: closed flag, allowed (slot, id), logit_bias
    # (slot, id, value), banned (slot, id)
    bias_logit_rows: list[int] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)
    bias_start: tuple[list[int], ...] = ()
    bias_values: list[float] = field(default_factory=list)
    hold: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # min_tokens: (logit row, token id) pairs held back
    lp_rows: list[int] = field(default_factory=list)  # sampled rows that want logprobs, and their k
    lp_ks: list[int] = field(default_factory=list)
    # prompt logprobs: per entry (entry index, first target position, count, k); hidden rows and targets
    prompt_parts: list[tuple[int, int, int, int]] = field(default_factory=list)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    pen_slots: int = 0  # the device tables must hold this many rows
    bias_slots: int = 0


@dataclass
class StepPlan:
    """One step. Entries are in input order (a mixed step's decode entries, one token each, first).

    Per entry: ``rows`` (block-table row), ``computed`` (tokens whose K/V is in the cache already),
    ``scheduled`` (tokens computed now), ``pending`` (row of its in-flight last token in the previous
    step's output, or -1) and ``samples`` (the chunk reaches its last known token: it gets a new token this
    step). ``tokens``: every input token of the step, flat in entry order (0 where ``pending`` fills it in
    on the device).
    """

    is_prefill: bool  # False: one token per entry (a decode step)
    rows: np.ndarray  # int64
    computed: np.ndarray  # int64
    scheduled: np.ndarray  # int64
    pending: np.ndarray  # int64
    samples: np.ndarray  # bool
    tokens: np.ndarray  # int64, sum(scheduled)
    new_rows: list[tuple[int, RowSettings]] = field(default_factory=list)  # rows that changed hands
    blocks: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (row, first index, new block ids)
    freed: list[int] = field(default_factory=list)  # rows given back since the last plan
    # a decode step of the previous plan's entries, each one token further, its token in flight in row i
    follows: bool = False
    extras: ExtrasPlan | None = None
    # hybrid models' prefix hits (engine/state_snapshots.py): (entry, snapshot) pairs whose chunk starts from
    # that snapshot's state instead of its row's, and (entry, token offset in its chunk, snapshot) of the
    # snapshots to take after that many of the chunk's tokens
    state_reads: list[tuple[int, int]] = field(default_factory=list)
    state_writes: list[tuple[int, int, int]] = field(default_factory=list)
    # ``blocks`` for the other KV groups' tables (engine/kv_groups.py): (group >= 1, row, first index, block ids)
    group_blocks: list[tuple[int, int, int, list[int]]] = field(default_factory=list)

    @property
    def num_entries(self) -> int:
        return len(self.rows)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_sampled(self) -> int:
        return len(self.rows) if not self.is_prefill else int(self.samples.sum())

    def for_workers(self) -> "StepPlan":
        """The plan as the other tensor-parallel ranks need it: nothing that only sampling reads. Prompt
        logprobs' rows stay: their logits are gathered from every rank, chunk by chunk."""
        if self.extras is None and not self.new_rows:
            return self
        prompt = self.extras.prompt_rows if self.extras is not None else None
        return replace(self, new_rows=[], extras=ExtrasPlan(prompt_rows=prompt) if prompt else None)
