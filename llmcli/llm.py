"""LLM: the Python API, ``LLM(model, **knobs).generate(prompts, params)`` and ``.chat(messages, params)``."""
from __future__ import annotations

from typing import Any, Sequence as Seq

from llmcli.config import Config
from llmcli.engine.llm_engine import LLMEngine
from llmcli.engine.admission import truncate_prompt
from llmcli.engine.chat_messages import template_messages
from llmcli.engine.outputs import CompletionOutput, ModelFailure, RequestOutput
from llmcli.engine.prompt_encoding import encode_texts
from llmcli.engine.sequence import RequestRejected
from llmcli.engine.harmony import reasoning_effort_problem
from llmcli.engine.structured.grammar import GrammarError
from llmcli.sampling_params import SamplingParams
from llmcli.vllm_args import config_kwargs

Prompt = str | list[int] | dict[str, Any]  # text, token ids, {"prompt": text} or {"prompt_token_ids": ids}


def _is_single(prompts: Any) -> bool:
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts)
                                                and isinstance(prompts[0], int))


class LLM:
    """Offline generation over a batch of prompts (text or token ids, bare or in vLLM's dict forms)."""

    def __init__(self, model: str, **knobs: Any) -> None:
        """``knobs``: Config fields, or vLLM's names for them (docs/python-api.md, "Coming from vLLM")."""
        self.engine = LLMEngine(Config(model, **config_kwargs(knobs)))

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer the engine encodes and decodes with (vLLM's name)."""
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's name); ``llm.llm_engine.model_config.max_model_len`` as in vLLM."""
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams holding the model's generation_config.json values (none with generation_config='ignore')."""
        return SamplingParams(**self.engine.config.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in prompt order, each with ``n`` completions in ``.outputs``.

        ``use_tqdm`` is accepted for vLLM's callers and shows nothing: ``llmcli generate`` has the progress bar.
        """
        if _is_single(prompts):
            prompts = [prompts]
        # As vLLM's LLM.generate: the model's generation_config.json values apply only when no sampling
        # params are given; given ones run as written (their unset fields take the neutral values).
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = [p.with_defaults({}) for p in params]
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        texts, token_ids = [], []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            text, ids = self._prompt(prompt, i)
            texts.append(text)
            token_ids.append(truncate_prompt(ids, p, self.engine.config.max_model_len))
        # Every prompt is checked before any is queued, so a rejected one leaves the engine untouched.
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            try:
                self.engine.check_fits(ids, p)
            except RequestRejected as exc:
                raise RequestRejected(f"prompt {i}: {exc}") from None
            except GrammarError as exc:
                raise GrammarError(f"prompt {i}: structured_outputs: {exc}") from None
        for i, (ids, p) in enumerate(zip(token_ids, params)):
            for j in range(p.n):
                # the j-th completion of a seeded request uses seed + j, as the command line does
                one = p.replace(n=1, seed=None if p.seed is None else p.seed + j)
                self.engine.add_request(ids, one, request_id=(i, j))
        done: dict[tuple[int, int], RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                done[out.request_id] = out
        failed = next((rid for rid in sorted(done) if done[rid].error is not None), None)
        if failed is not None:
            if isinstance(done[failed].error, ModelFailure):
                raise RuntimeError(f"prompt {failed[0]}: {done[failed].error}")
            raise GrammarError(f"prompt {failed[0]}: structured_outputs: {done[failed].error}")
        return [self._gather(i, texts[i], [done[(i, j)] for j in range(p.n)]) for i, p in enumerate(params)]

    def chat(
        self,
        messages: list[dict[str, Any]] | Seq[list[dict[str, Any]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {role, content}) or a list of them (``use_tqdm`` as
        in ``generate``)."""
        if self.tokenizer is None:
            raise ValueError(f"model {self.engine.config.model} has no tokenizer, so no chat template")
        effort = (chat_template_kwargs or {}).get("reasoning_effort")
        if effort is not None and (why := reasoning_effort_problem(effort)):
            raise ValueError(f"chat_template_kwargs.reasoning_effort {why}")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [self.tokenizer.apply_chat_template(
            template_messages(conversation), tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, **(chat_template_kwargs or {})) for conversation in conversations]
        # chat=True: the template already wrote any special tokens it wants (no second BOS)
        prompts = [{"prompt": text, "prompt_token_ids": ids}
                   for text, ids in zip(texts, encode_texts(self.tokenizer, texts, chat=True))]
        return self.generate(prompts, sampling_params)

    def _prompt(self, prompt: Prompt, i: int) -> tuple[str | None, list[int]]:
        """The prompt's text (when given as text) and its token ids."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.engine.encode(prompt["prompt"])
            raise ValueError(f"prompt {i}: a dict prompt needs 'prompt' or 'prompt_token_ids', "
                             f"got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            return prompt, self.engine.encode(prompt)
        return None, list(prompt)

    @staticmethod
    def _gather(i: int, text: str | None, parts: list[RequestOutput]) -> RequestOutput:
        """The n single-completion outputs of prompt ``i`` as one RequestOutput."""
        first = parts[0]
        outputs = [CompletionOutput(j, o.text, o.token_ids, o.finish_reason, o.stop_reason, o.outputs[0].logprobs,
                                    o.outputs[0].cumulative_logprob) for j, o in enumerate(parts)]
        metrics = first.metrics
        metrics.first_token_time = min((o.metrics.first_token_time for o in parts
                                        if o.metrics.first_token_time is not None), default=None)
        metrics.finish_time = max(o.metrics.finish_time for o in parts)
        return RequestOutput(request_id=i, prompt=text, prompt_token_ids=first.prompt_token_ids, outputs=outputs,
                             prompt_logprobs=first.prompt_logprobs, metrics=metrics)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
