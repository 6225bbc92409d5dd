"""Turning a parsed record into prompt token ids and SamplingParams, checked against the model."""
from __future__ import annotations

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
                 defaults: dict[str, Any], chat_template: str | None = None,
                 template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.defaults = defaults
        self.chat_template = chat_template
        self._longest_token: int | None = None
        self.template_kwargs = template_kwargs or {}  # --chat-template-kwargs; a record's own keys win
        self._rendered: dict[int, list[int]] = {}  # id(record) -> chat prompt ids rendered in a batch

    def prepare_all(self, records: list[InputRecord]) -> list[PreparedRequest | InputRecord]:
        """``prepare`` for each record (the request, or the record with its error), chat templates in batches."""
        self._render_chats([r for r in records if r.error is None and r.kind == "messages"])
        try:
            return [self.prepare(r) or r for r in records]
        finally:
            self._rendered.clear()

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
        # replace() keeps unset fields unset: the engine fills them from the model's generation config
        return [base.replace(n=1, seed=seed) for seed in seeds]

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
            self._check_bytes(sum(len(m["content"].encode()) for m in rec.prompt), name)
            ids = self._rendered.get(id(rec)) or self._chat(rec.prompt, name, self._kwargs_of(rec))
        else:
            self._check_bytes(len(rec.prompt.encode()), name)
            # As the engine does: the text is the whole prompt, no special tokens added around it.
            ids = list(self.tokenizer.encode(rec.prompt, add_special_tokens=False))
        if not ids:
            raise FieldProblem(name, "encodes to zero tokens")
        if len(ids) >= self.max_model_len:
            raise FieldProblem(name, f"prompt is {len(ids)} tokens, too long for max_model_len={self.max_model_len} "
                                     "(it must leave room for one generated token)")
        return ids

    def _check_bytes(self, size: int, name: str) -> None:
        """Refuse text that can never fit before tokenizing it (a 10 MB prompt takes seconds and GBs to encode).

        No token stands for more bytes than its own vocabulary entry spells, so text longer than
        max_model_len times the longest entry is too long whatever it holds."""
        if self._longest_token is None:
            self._longest_token = max((len(t.encode()) for t in self.tokenizer.get_vocab()), default=1)
        limit = self.max_model_len * max(self._longest_token, 1)
        if size > limit:
            raise FieldProblem(name, f"prompt is {size} bytes, too long for max_model_len={self.max_model_len} "
                                     f"at any tokenization (no token is longer than {self._longest_token} bytes)")

    def _kwargs_of(self, rec: InputRecord) -> dict[str, Any]:
        return {**self.template_kwargs, **(rec.chat_template_kwargs or {})}

    def _template_args(self, extra: dict[str, Any]) -> dict[str, Any]:
        # The template's own variables go in as keyword arguments (enable_thinking=False, ...), after ours.
        kwargs: dict[str, Any] = {**extra, "add_generation_prompt": True, "tokenize": False}
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs

    def _chat(self, messages: list[dict[str, Any]], name: str, extra: dict[str, Any]) -> list[int]:
        try:
            text = self.tokenizer.apply_chat_template(messages, **self._template_args(extra))
        except Exception as exc:  # jinja errors, or a tokenizer without a template
            raise FieldProblem(name, f"the chat template failed: {exc}") from None
        # The template already wrote any BOS it wants; do not let encode add another.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _render_chats(self, records: list[InputRecord]) -> None:
        """Render and encode chat prompts a batch per distinct set of template kwargs.

        A batch the template fails on is left to ``_chat``, record by record, so the error names its line.
        """
        if self.tokenizer is None or not records:
            return
        groups: dict[str, list[InputRecord]] = {}
        for rec in records:
            groups.setdefault(repr(sorted(self._kwargs_of(rec).items())), []).append(rec)
        for group in groups.values():
            try:
                texts = self.tokenizer.apply_chat_template([r.prompt for r in group],
                                                           **self._template_args(self._kwargs_of(group[0])))
                encoded = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
            except Exception:  # noqa: BLE001 - one bad record; each is tried alone in prepare()
                continue
            for rec, ids in zip(group, encoded):
                self._rendered[id(rec)] = list(ids)
