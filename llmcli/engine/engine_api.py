"""The engine as the command line drives it: what `generate` needs of an ``LLMEngine`` or a ``DataParallelEngine``.

Both classes satisfy ``EngineAPI`` structurally, with real attributes of the same meaning (no fallbacks on the
caller's side); tests/test_engine_api.py checks each one, so neither can drift out of it unnoticed.
"""
from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from llmcli.engine.outputs import EngineStats, RequestOutput
from llmcli.sampling_params import SamplingParams


@runtime_checkable
class EngineAPI(Protocol):
    """Requests in by id, finished outputs out, one ``step`` at a time; checked before they are added."""

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer the engine encodes and decodes with; None for a model without one."""

    @property
    def stats(self) -> EngineStats:
        """Counters so far and the current queue and pool state (for progress and the summary)."""

    @property
    def startup_s(self) -> dict[str, float]:
        """Seconds per start-up phase this engine timed itself, in the order they ran (``--verbose``)."""

    @property
    def detokenize(self) -> bool:
        """Whether finished outputs carry their text; when not, the caller decodes them with ``fill_texts``."""

    def fill_texts(self, outs: list[RequestOutput]) -> None:
        """Decode, in place and in one batch, the texts ``step`` left as None; safe in another thread."""

    def check_fits(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected if this request can never run on this engine (its KV pool, its limits)."""

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: Any = None) -> object:
        """Queue one request; its output comes back from ``step`` under ``request_id``."""

    def has_unfinished(self) -> bool:
        """Whether any request added is not answered yet."""

    def step(self) -> list[RequestOutput]:
        """Advance the work; the outputs of the requests that finished."""

    def shutdown(self) -> None:
        """Release workers, replicas and device memory."""
