"""Plain data the engine hands out: finished requests, running statistics, the memory plan."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Logprob:
    """One token's log probability under the model's raw distribution, and its rank there (1 = likeliest)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position: {token id: Logprob} holding the chosen token and the top-k alternatives (vLLM's shape).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a request (``SamplingParams.n`` of them per request)."""

    index: int
    text: str | None  # None only from an engine with ``detokenize`` off, until ``engine.fill_texts`` decodes it
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop string or stop token) | "length" (max_tokens or max_model_len)
    stop_reason: str | int | None = None  # the stop string or token id that ended it, if any
    logprobs: list[PositionLogprobs] | None = None  # one entry per generated token when asked for
    cumulative_logprob: float | None = None  # sum of the generated tokens' logprobs, when asked for
    skip_special_tokens: bool = True  # how ``text`` is (or is to be) decoded


@dataclass
class RequestMetrics:
    """When the request arrived, got its first token and finished (``time.perf_counter`` seconds)."""

    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float = 0.0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache


class ModelFailure(str):
    """The error of a request the model could not compute (its logits were not finite): not its fields' fault."""


@dataclass
class RequestOutput:
    """A finished request: its prompt and its completions, shaped like vLLM's.

    The engine emits one per sequence (one completion); ``LLM.generate`` gathers the
    ``n`` completions of a prompt into one. ``out["text"]``, ``out.text``,
    ``out.token_ids`` and ``out.finish_reason`` read the first completion.
    """

    request_id: Any
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # first entry None (no context), as vLLM
    finished: bool = True
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: str | None = None  # the request could not run (its constraint failed, or a ModelFailure); no completion

    @classmethod
    def single(cls, request_id: Any, prompt_token_ids: list[int], token_ids: list[int], text: str,
               finish_reason: str | None, stop_reason: str | int | None = None, **metrics: Any) -> "RequestOutput":
        """One completion, built from the flat fields this class had before it was vLLM-shaped."""
        return cls(request_id, None, list(prompt_token_ids),
                   [CompletionOutput(0, text, list(token_ids), finish_reason, stop_reason)],
                   metrics=RequestMetrics(**metrics))

    # -- the first completion and the metrics, under the names this class had before --------------
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[PositionLogprobs] | None:
        return self.outputs[0].logprobs

    @property
    def num_cached_prompt_tokens(self) -> int:
        return self.metrics.num_cached_prompt_tokens

    @property
    def num_cached_tokens(self) -> int:  # vLLM's name
        return self.metrics.num_cached_prompt_tokens

    @property
    def arrival_time(self) -> float:
        return self.metrics.arrival_time

    @property
    def first_token_time(self) -> float | None:
        return self.metrics.first_token_time

    @property
    def finish_time(self) -> float:
        return self.metrics.finish_time

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __getitem__(self, key: str) -> Any:  # outs[i]["text"] as in the public contract
        return getattr(self, key)


@dataclass
class EngineStats:
    """Cumulative counters since the engine started, plus the current queue and cache state."""

    num_running: int = 0
    num_waiting: int = 0
    peak_running: int = 0  # the most sequences running (decoding, or sampled their first token) at once
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    prefill_tokens_computed: int = 0  # tokens run through prefill (recompute after preemption included)
    generated_tokens: int = 0
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    num_finished: int = 0
    # hybrid models' prefix cache (engine/state_snapshots.py): snapshot slots and their bytes (per rank),
    # snapshots taken, hits from one
    state_snapshot_slots: int = 0
    state_snapshot_bytes: int = 0
    state_snapshots_taken: int = 0
    state_snapshot_hits: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0


@dataclass
class MemoryReport:
    """What start-up measured and decided about memory (bytes are per tensor-parallel rank)."""

    device: str
    device_name: str
    total_bytes: int
    budget_bytes: int  # total * gpu_memory_utilization on CUDA, the KV budget on CPU
    weights_bytes: int
    activation_peak_bytes: int
    cuda_graph_bytes: int
    other_bytes: int  # memory in use that is neither weights nor KV (CUDA context, allocator slack)
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    block_size: int
    num_blocks: int
    cache_tokens: int
    max_model_len: int
    max_concurrent_full_seqs: float
    dtype: str
    kv_cache_dtype: str = ""  # the KV pool's element type (float8_e4m3fn with kv_cache_dtype='fp8')
    # a hybrid model's linear-attention states (engine/state_pages.py): the pages reserved for them whatever
    # runs (shared pool: the snapshot and scratch rows; static: every row) in bytes, of which the prefix cache's
    # snapshot rows (how many, bytes); one sequence's states (bytes); the rows' plan
    state_pool_bytes: int = 0
    num_state_snapshots: int = 0
    state_snapshot_bytes: int = 0
    state_row_bytes: int = 0
    state_pages: Any = None  # StatePages
    # per KV group (engine/kv_groups.py): window (None: full), layers, the most blocks and bytes one sequence of
    # max_model_len holds at once in it
    kv_groups: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
