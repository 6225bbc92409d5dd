"""Plain data the engine hands out: finished requests, running statistics, the memory plan."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    """One finished request."""

    request_id: Any
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None only from an engine with ``detokenize`` off: ``engine.text_of(out)`` decodes it
    finish_reason: str  # "stop" (EOS, stop string or stop token) | "length" (max_tokens or max_model_len)
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float = 0.0
    stop_reason: str | int | None = None  # the stop string or token id that ended it, if any
    skip_special_tokens: bool = True  # how ``text`` is (or is to be) decoded

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __getitem__(self, key: str) -> Any:  # outs[i]["text"] as in the public contract
        return getattr(self, key)


@dataclass
class EngineStats:
    """Cumulative counters since the engine started, plus the current queue and cache state."""

    num_running: int = 0
    num_waiting: int = 0
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
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
