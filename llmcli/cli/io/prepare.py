"""Turning a parsed record into prompt token ids and SamplingParams, checked against the model."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from llmcli.cli.io.records import FieldProblem, InputRecord
from llmcli.cli.io.structured_fields import NO_CONSTRAINT
from llmcli.cli.io.structured_fields import check as check_constraint
from llmcli.sampling_params import SamplingParams, SamplingParamsError


@dataclass
class PreparedRequest:
    """A record ready for the engine: its prompt ids and one SamplingParams per completion."""

    record: InputRecord
    prompt_token_ids: list[int]
    params: list[SamplingParams]  # n entries, each with n=1 (the i-th seeded seed+i)


class Preparer:
    """Encodes prompts and builds sampling settings: CLI defaults overridden by per-record fields."""

    def __init__(self, tokenizer: Any | None, max_model_len: int, vocab_size: int,
                 defaults: dict[str, Any], chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.defaults = defaults
        self.chat_template = chat_template

    def prepare(self, rec: InputRecord) -> PreparedRequest | None:
        """The request for ``rec``, or None after recording the problem in ``rec.error``."""
        if rec.error is not None:
            return None
        try:
            params = self._params(rec)
            ids = self._encode(rec)
        except FieldProblem as problem:
            rec.fail(problem.field, problem.message)
            return None
        return PreparedRequest(rec, ids, params)

    # -- sampling ---------------------------------------------------------------
    def _params(self, rec: InputRecord) -> list[SamplingParams]:
        merged = {**self.defaults, **rec.sampling}
        if merged.get("structured_outputs") == NO_CONSTRAINT:
            merged["structured_outputs"] = None
        elif "structured_outputs" in rec.sampling:
            check_constraint(rec.sampling["structured_outputs"], rec.structured_field)
        try:
            base = SamplingParams(**merged)
        except SamplingParamsError as exc:
            match = re.match(r"SamplingParams\.(\w+)", str(exc))
            name = match.group(1) if match else None
            why = str(exc).split(": ", 1)[-1]
            raise FieldProblem(rec.field_name(name) if name else None, why) from None
        seeds = [None if base.seed is None else base.seed + i for i in range(base.n)]
        return [dataclasses.replace(base, n=1, seed=seed) for seed in seeds]

    # -- prompt -----------------------------------------------------------------
    def _encode(self, rec: InputRecord) -> list[int]:
        name = rec.prompt_field()
        if rec.kind == "prompt_token_ids":
            ids = list(rec.prompt)
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise FieldProblem(name, f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        elif self.tokenizer is None:
            raise FieldProblem(name, "the model has no tokenizer; give prompt_token_ids instead")
        elif rec.kind == "messages":
            ids = self._chat(rec.prompt, name)
        else:
            # As the engine does: the text is the whole prompt, no special tokens added around it.
            ids = list(self.tokenizer.encode(rec.prompt, add_special_tokens=False))
        if not ids:
            raise FieldProblem(name, "encodes to zero tokens")
        if len(ids) >= self.max_model_len:
            raise FieldProblem(name, f"prompt is {len(ids)} tokens, too long for max_model_len={self.max_model_len} "
                                     "(it must leave room for one generated token)")
        return ids

    def _chat(self, messages: list[dict[str, Any]], name: str) -> list[int]:
        kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": False}
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        try:
            text = self.tokenizer.apply_chat_template(messages, **kwargs)
        except Exception as exc:  # jinja errors, or a tokenizer without a template
            raise FieldProblem(name, f"the chat template failed: {exc}") from None
        # The template already wrote any BOS it wants; do not let encode add another.
        return list(self.tokenizer.encode(text, add_special_tokens=False))
