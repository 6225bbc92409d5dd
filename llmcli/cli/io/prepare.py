"""Turning a parsed record into prompt token ids and SamplingParams, checked against the model."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import orjson

from llmcli.cli.io.records import FieldProblem, InputRecord
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
        self._params_cache: dict[tuple[bool, bytes], list[SamplingParams] | FieldProblem] = {}

    def prepare(self, rec: InputRecord) -> PreparedRequest | None:
        """The request for ``rec``, or None after recording the problem in ``rec.error``."""
        item = self.prepare_batch([rec])[0]
        return item if isinstance(item, PreparedRequest) else None

    def check(self, rec: InputRecord) -> None:
        """What needs no tokenizer, recorded in ``rec.error``: sampling values, and token-id prompts whole."""
        if rec.error is not None:
            return
        try:
            self._params(rec)
            if rec.kind == "prompt_token_ids":
                self._check_length(rec, self._check_ids(rec))
        except FieldProblem as problem:
            rec.fail(problem.field, problem.message)

    def prepare_batch(self, recs: list[InputRecord]) -> list[PreparedRequest | InputRecord]:
        """Each record's request, or the record itself with ``.error`` set; texts are encoded as one batch."""
        out: list[PreparedRequest | InputRecord] = list(recs)
        waiting: list[tuple[int, list[SamplingParams]]] = []
        texts: list[str] = []
        chats = [i for i, r in enumerate(recs) if r.error is None and r.kind == "messages"]
        rendered = self._render_batch([recs[i] for i in chats]) if self.tokenizer is not None else []
        rendered_of = dict(zip(chats, rendered))
        for i, rec in enumerate(recs):
            if rec.error is not None:
                continue
            try:
                params = self._params(rec)
                if rec.kind == "prompt_token_ids":
                    ids = self._check_ids(rec)
                    self._check_length(rec, ids)
                    out[i] = PreparedRequest(rec, ids, params)
                    continue
                if self.tokenizer is None:
                    raise FieldProblem(rec.prompt_field(), "the model has no tokenizer; give prompt_token_ids instead")
                text = rendered_of[i] if rec.kind == "messages" else rec.prompt
                if isinstance(text, FieldProblem):
                    raise text
            except FieldProblem as problem:
                rec.fail(problem.field, problem.message)
                continue
            waiting.append((i, params))
            texts.append(text)
        for (i, params), ids in zip(waiting, self._encode_texts(texts)):
            rec = recs[i]
            try:
                self._check_length(rec, ids)
            except FieldProblem as problem:
                rec.fail(problem.field, problem.message)
                continue
            out[i] = PreparedRequest(rec, ids, params)
        return out

    # -- sampling ---------------------------------------------------------------
    def _params(self, rec: InputRecord) -> list[SamplingParams]:
        # Most records carry the same sampling fields (often none): build their settings once. The engine
        # only reads SamplingParams, so records may share them.
        key = (rec.openai is not None, orjson.dumps(rec.sampling, option=orjson.OPT_SORT_KEYS))
        found = self._params_cache.get(key)
        if found is None:
            if len(self._params_cache) >= 4096:
                self._params_cache.clear()
            try:
                found = self._build_params(rec)
            except FieldProblem as problem:
                found = problem
            self._params_cache[key] = found
        if isinstance(found, FieldProblem):
            raise FieldProblem(found.field, found.message)
        return found

    def _build_params(self, rec: InputRecord) -> list[SamplingParams]:
        merged = {**self.defaults, **rec.sampling}
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
    def _check_ids(self, rec: InputRecord) -> list[int]:
        ids = list(rec.prompt)
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise FieldProblem(rec.prompt_field(), f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _check_length(self, rec: InputRecord, ids: list[int]) -> None:
        name = rec.prompt_field()
        if not ids:
            raise FieldProblem(name, "encodes to zero tokens")
        if len(ids) >= self.max_model_len:
            raise FieldProblem(name, f"prompt is {len(ids)} tokens, too long for max_model_len={self.max_model_len} "
                                     "(it must leave room for one generated token)")

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Token ids of whole prompts (no special tokens added: a chat template already wrote any it wants).

        A fast tokenizer's own batch encoding runs on several threads outside the GIL. It is called
        directly (not through ``tokenizer(...)``, which first resets truncation and padding on the shared
        Rust tokenizer and so cannot run while another thread decodes with it).
        """
        if not texts:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and backend.truncation is None and backend.padding is None:
            return [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=False)]
        return [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def _render_batch(self, recs: list[InputRecord]) -> list[str | FieldProblem]:
        """Chat templates rendered for many records at once; a failing one is found by rendering each."""
        if not recs:
            return []
        kwargs: dict[str, Any] = {"add_generation_prompt": True, "tokenize": False}
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        try:
            texts = self.tokenizer.apply_chat_template([r.prompt for r in recs], **kwargs)
            if isinstance(texts, list) and len(texts) == len(recs):
                return texts
        except Exception:  # jinja errors, or a tokenizer without a template: say which record
            pass
        found: list[str | FieldProblem] = []
        for rec in recs:
            try:
                found.append(self.tokenizer.apply_chat_template(rec.prompt, **kwargs))
            except Exception as exc:
                found.append(FieldProblem(rec.prompt_field(), f"the chat template failed: {exc}"))
        return found
