"""LLM: the Python API, ``LLM(model, **knobs).generate(prompts, params)``."""
from __future__ import annotations

from typing import Any, Sequence as Seq

from llmcli.config import Config
from llmcli.engine.llm_engine import LLMEngine
from llmcli.engine.outputs import RequestOutput
from llmcli.engine.sequence import RequestRejected
from llmcli.engine.structured.grammar import GrammarError
from llmcli.sampling_params import SamplingParams


class LLM:
    """Offline generation over a batch of prompts (text or token ids)."""

    def __init__(self, model: str, **knobs: Any) -> None:
        self.engine = LLMEngine(Config(model, **knobs))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Seq[str] | Seq[list[int]] | str,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in prompt order; each has ``text``, ``token_ids`` and ``finish_reason``."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        # Every prompt is checked before any is queued, so a rejected one leaves the engine untouched.
        token_ids = [self.engine.encode(prompt) for prompt in prompts]
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            try:
                self.engine.check_fits(ids, p)
            except RequestRejected as exc:
                raise RequestRejected(f"prompt {i}: {exc}") from None
            except GrammarError as exc:
                raise GrammarError(f"prompt {i}: structured_outputs: {exc}") from None
        results: dict[int, RequestOutput] = {}
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            self.engine.add_request(ids, p, request_id=i)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                results[out.request_id] = out
        return [results[i] for i in range(len(prompts))]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
