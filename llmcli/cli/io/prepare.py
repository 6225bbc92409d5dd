"""Turning a parsed record into prompt token ids and SamplingParams, checked against the model."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from llmcli.cli.io.field_problem import FieldProblem
from llmcli.cli.io.records import InputRecord
from llmcli.cli.io.score_fields import SCORE_PARAMS
from llmcli.cli.io.structured_fields import NO_CONSTRAINT
from llmcli.cli.io.structured_fields import check as check_constraint
from llmcli.cli.io.time_limit import TimeLimitExceeded, time_limit
from llmcli.engine.admission import bad_word_ids, truncate_prompt
from llmcli.engine.harmony import BUDGET_NEEDS_HARMONY, HarmonyTokens
from llmcli.engine.prompt_encoding import encode_texts
from llmcli.engine.sequence import RequestRejected
from llmcli.sampling_params import SamplingParams, SamplingParamsError

# max_tokens of a record that sets none, when --max-tokens is not given either. OpenAI lines follow OpenAI's
# API: a chat request runs until it stops or the context is full, a completions request stops at 16.
PLAIN_MAX_TOKENS = 256
OPENAI_COMPLETIONS_MAX_TOKENS = 16
# A chat template is code that comes with the model: one that does not finish in this long (per render of a
# batch, then per record) is that record's error, not a hung run.
TEMPLATE_TIMEOUT_ENV = "LLMCLI_TEMPLATE_TIMEOUT_S"
DEFAULT_TEMPLATE_TIMEOUT_S = 10.0


def template_time_limit() -> float:
    from llmcli.config import env_number

    return float(env_number(TEMPLATE_TIMEOUT_ENV, DEFAULT_TEMPLATE_TIMEOUT_S))


def default_max_tokens(rec: InputRecord) -> int | None:
    """The built-in max_tokens of a record that sets none (None: until stop or the context is full)."""
    if rec.openai is None:
        return PLAIN_MAX_TOKENS
    return None if rec.openai.chat else OPENAI_COMPLETIONS_MAX_TOKENS


@dataclass
class PreparedRequest:
    """A record ready for the engine: its prompt ids and one SamplingParams per completion."""

    record: InputRecord
    prompt_token_ids: list[int]
    params: list[SamplingParams]  # n entries, each with n=1 (the i-th seeded seed+i)
    limit_set: bool = True  # max_tokens came from the record or --max-tokens; False: the built-in default
    prompts: list[list[int]] | None = None  # a score record's: one prompt per request (None: all run the one)

    def prompt_of(self, i: int) -> list[int]:
        """The token ids the ``i``-th engine request of this record runs."""
        return self.prompt_token_ids if self.prompts is None else self.prompts[i]


# A score is the prompt logprobs of a request that generates one token: cutting the text would change it.
SCORE_LENGTH_HINT = "(a score needs fewer tokens than max_model_len: raise --max-model-len)"


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
        self.template_kwargs = template_kwargs or {}  # --chat-template-kwargs; a record's own keys win
        self._longest_token: int | None = None
        self._is_harmony: bool | None = None
        self._params_cache: dict[tuple, list[SamplingParams] | FieldProblem] = {}
        self._cached_params = 0

    def _harmony(self) -> bool:
        """Whether the model's tokenizer has Harmony's tokens (found once: it reads the whole vocabulary)."""
        if self._is_harmony is None:
            self._is_harmony = HarmonyTokens.of(self.tokenizer) is not None
        return self._is_harmony

    def prepare(self, rec: InputRecord) -> PreparedRequest | None:
        """The request for ``rec``, or None after recording the problem in ``rec.error``."""
        item = self.prepare_batch([rec])[0]
        return item if isinstance(item, PreparedRequest) else None

    def prepare_all(self, records: list[InputRecord]) -> list[PreparedRequest | InputRecord]:
        """``prepare`` for each record (the request, or the record with its error), in one batch."""
        return self.prepare_batch(records)

    def check(self, rec: InputRecord) -> None:
        """What needs no encoding, recorded in ``rec.error``: sampling values and constraints, token-id prompts
        whole, and text too long in bytes to ever fit."""
        if rec.error is not None:
            return
        try:
            self._params(rec)
            if rec.sampling.get("thinking_token_budget") is not None and not self._harmony():
                raise FieldProblem(rec.field_name("thinking_token_budget"), BUDGET_NEEDS_HARMONY)
            if rec.kind == "prompt_token_ids":
                self._check_length(rec, self._check_ids(rec))
            elif self.tokenizer is not None:
                self._check_bytes(rec)
        except FieldProblem as problem:
            rec.fail(problem.field, problem.message)

    def prepare_batch(self, recs: list[InputRecord]) -> list[PreparedRequest | InputRecord]:
        """Each record's request, or the record itself with ``.error`` set; texts are encoded as one batch."""
        out: list[PreparedRequest | InputRecord] = list(recs)
        waiting: list[tuple[int, list[SamplingParams]]] = []
        texts: list[str] = []
        rendered: list[bool] = []  # texts[k] came from a chat template
        chats = [i for i, r in enumerate(recs) if r.error is None and r.kind == "messages"]
        rendered_of: dict[int, str | FieldProblem] = {}
        if self.tokenizer is not None:
            # Only text that can fit is rendered and encoded (a 10 MB prompt takes seconds and GBs to encode).
            chats = [i for i in chats if self._fits_in_bytes(recs[i])]
            rendered_of = dict(zip(chats, self._render_batch([recs[i] for i in chats])))
        for i, rec in enumerate(recs):
            if rec.error is not None:
                continue
            try:
                params = self._params(rec)
                if rec.kind == "prompt_token_ids":
                    ids = self._check_length(rec, self._check_ids(rec))
                    out[i] = self._request(rec, ids, params)
                    continue
                if self.tokenizer is None:
                    raise FieldProblem(rec.prompt_field(), "the model has no tokenizer; give prompt_token_ids instead")
                self._check_bytes(rec)
                text = rendered_of[i] if rec.kind == "messages" else rec.prompt
                if isinstance(text, FieldProblem):
                    raise text
            except FieldProblem as problem:
                rec.fail(problem.field, problem.message)
                continue
            waiting.append((i, params))
            texts.append(text)
            rendered.append(rec.kind == "messages")
        for (i, params), ids in zip(waiting, self._encode_texts(texts, rendered)):
            rec = recs[i]
            try:
                self._check_tokenizer_ids(rec, ids)
                out[i] = self._request(rec, self._check_length(rec, ids), params)
            except FieldProblem as problem:
                rec.fail(problem.field, problem.message)
        return out

    def _request(self, rec: InputRecord, ids: list[int], params: list[SamplingParams]) -> PreparedRequest:
        """The record's request; a score record's runs each continuation after the prompt (or the prompt alone,
        for its perplexity) with SCORE_PARAMS."""
        if rec.score is None:
            return PreparedRequest(rec, ids, params, self._limit_set(rec))
        if rec.score.kind == "perplexity":
            if len(ids) < 2:
                raise FieldProblem(rec.prompt_field(), "needs at least 2 tokens for a perplexity (the first has no "
                                                       "context)")
            return PreparedRequest(rec, ids, [SCORE_PARAMS], True)
        texts = [c for c in rec.score.continuations if isinstance(c, str)]
        if texts and self.tokenizer is None:
            raise FieldProblem("continuations", "the model has no tokenizer; give token ids instead")
        encoded = iter(encode_texts(self.tokenizer, texts, chat=True) if texts else [])  # no special tokens
        conts = [next(encoded) if isinstance(c, str) else list(c) for c in rec.score.continuations]
        for j, cont in enumerate(conts):
            if not cont:
                raise FieldProblem(f"continuations[{j}]", "encodes to zero tokens")
            if len(ids) + len(cont) >= self.max_model_len:
                raise FieldProblem(f"continuations[{j}]", f"prompt and continuation are {len(ids) + len(cont)} "
                                                          f"tokens, too long for max_model_len={self.max_model_len}"
                                                          f" {SCORE_LENGTH_HINT}")
            if max(cont) >= self.vocab_size:
                raise FieldProblem(f"continuations[{j}]", f"token ids must be in [0, {self.vocab_size})")
        rec.score.continuation_ids = conts
        # only the continuations' tokens are scored: the prompt they share may come from the prefix cache
        params = SCORE_PARAMS.replace(prompt_logprobs_start=len(ids))
        return PreparedRequest(rec, ids, [params] * len(conts), True, prompts=[ids + c for c in conts])

    # -- sampling ---------------------------------------------------------------
    def _params(self, rec: InputRecord) -> list[SamplingParams]:
        # Most records carry the same sampling fields (often none): build their settings (and compile-check
        # their constraint) once. The engine only reads SamplingParams, so records may share them.
        try:
            key = (rec.openai.url if rec.openai is not None else None, rec.structured_field,
                   orjson.dumps(rec.sampling, option=orjson.OPT_SORT_KEYS))
        except TypeError:  # not serializable as is: built for this record alone
            return self._build_params(rec)
        found = self._params_cache.get(key)
        if found is None:
            # Bounded by settings held, not records: a record of n=16384 holds that many.
            if len(self._params_cache) >= 4096 or self._cached_params > 65536:
                self._params_cache.clear()
                self._cached_params = 0
            try:
                found = self._build_params(rec)
                self._cached_params += len(found)
            except FieldProblem as problem:
                found = problem
            self._params_cache[key] = found
        if isinstance(found, FieldProblem):
            raise FieldProblem(found.field, found.message)
        return found

    def _build_params(self, rec: InputRecord) -> list[SamplingParams]:
        merged = {"max_tokens": default_max_tokens(rec), **self.defaults, **rec.sampling}
        if merged.get("structured_outputs") == NO_CONSTRAINT:
            merged["structured_outputs"] = None
        elif "structured_outputs" in rec.sampling:
            check_constraint(rec.sampling["structured_outputs"], rec.structured_field)
        try:
            base = SamplingParams(**merged)
        except SamplingParamsError as exc:
            match = re.match(r"SamplingParams\.(\w+)", str(exc))
            name = match.group(1) if match else None
            # Said in JSON's words: a record writes null, not Python's None.
            why = re.sub(r"\bNone\b", "null", str(exc).split(": ", 1)[-1])
            raise FieldProblem(rec.field_name(name) if name else None, why) from None
        for name, ids in (("logit_bias", base.logit_bias or ()), ("allowed_token_ids", base.allowed_token_ids or ())):
            bad = next((t for t in ids if t >= self.vocab_size), None)
            if bad is not None:
                raise FieldProblem(rec.field_name(name), f"token id {bad} is outside the vocabulary [0, "
                                                         f"{self.vocab_size})")
        try:
            bad_word_ids(self.tokenizer, base.bad_words)
        except RequestRejected as exc:
            raise FieldProblem(rec.field_name("bad_words"), str(exc).removeprefix("bad_words: ")) from None
        seeds = [None if base.seed is None else base.seed + i for i in range(base.n)]
        # replace() keeps unset fields unset: the engine fills them from the model's generation config
        return [base.replace(n=1, seed=seed) for seed in seeds]

    def _limit_set(self, rec: InputRecord) -> bool:
        return "max_tokens" in rec.sampling or "max_tokens" in self.defaults

    # -- prompt -----------------------------------------------------------------
    def _check_ids(self, rec: InputRecord) -> list[int]:
        ids = list(rec.prompt)
        bad = next((t for t in ids if t >= self.vocab_size), None)
        if bad is not None:
            raise FieldProblem(rec.prompt_field(), f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _check_tokenizer_ids(self, rec: InputRecord, ids: list[int]) -> None:
        """A text the tokenizer turns into ids past the model's vocabulary: the two do not belong together."""
        bad = max(ids, default=0)
        if bad >= self.vocab_size:
            raise FieldProblem(rec.prompt_field(), f"the tokenizer produced token id {bad}, but the model's "
                                                   f"vocab_size is {self.vocab_size}: the tokenizer and the model "
                                                   "do not match")

    def _check_length(self, rec: InputRecord, ids: list[int]) -> list[int]:
        """``ids`` as the engine will run them (cut by truncate_prompt_tokens), checked against max_model_len."""
        ids = truncate_prompt(ids, self._params(rec)[0], self.max_model_len)
        name = rec.prompt_field()
        if not ids:
            raise FieldProblem(name, "encodes to zero tokens")
        if len(ids) >= self.max_model_len:
            room = SCORE_LENGTH_HINT if rec.score is not None else ("(it must leave room for one generated token; "
                                                                     "truncate_prompt_tokens: -1 keeps its end)")
            raise FieldProblem(name, f"prompt is {len(ids)} tokens, too long for max_model_len={self.max_model_len} "
                                     f"{room}")
        return ids

    def _byte_limit(self) -> int:
        # No token stands for more bytes than its own vocabulary entry spells, so text longer than
        # max_model_len times the longest entry is too long whatever it holds.
        if self._longest_token is None:
            self._longest_token = max((len(t.encode()) for t in self.tokenizer.get_vocab()), default=1)
        return self.max_model_len * max(self._longest_token, 1)

    @staticmethod
    def _text_bytes(rec: InputRecord) -> int:
        if rec.kind == "messages":
            # Every string of a conversation may be rendered (roles, extra keys, template variables), not
            # only the contents.
            return _string_bytes(rec.prompt) + _string_bytes(rec.chat_template_kwargs)
        return len(rec.prompt.encode())

    def _truncated(self, rec: InputRecord) -> bool:
        return rec.sampling.get("truncate_prompt_tokens", self.defaults.get("truncate_prompt_tokens")) is not None

    def _too_big(self, rec: InputRecord) -> str | None:
        """Why ``rec``'s text can never fit, known without rendering or tokenizing it; None if it may (a record
        that asks for truncate_prompt_tokens always may)."""
        if self._truncated(rec):
            return None
        if rec.kind == "messages" and len(rec.prompt) > self.max_model_len:
            # No template worth using renders a message as less than one token.
            return (f"holds {len(rec.prompt)} messages, more than max_model_len={self.max_model_len} tokens "
                    "can hold")
        size = self._text_bytes(rec)
        if size > self._byte_limit():
            what = "the conversation's strings are" if rec.kind == "messages" else "prompt is"
            return (f"{what} {size} bytes, too long for max_model_len={self.max_model_len} "
                    f"at any tokenization (no token is longer than {self._longest_token} bytes)")
        return None

    def _fits_in_bytes(self, rec: InputRecord) -> bool:
        return self._too_big(rec) is None

    def _check_bytes(self, rec: InputRecord) -> None:
        """Refuse text that can never fit before tokenizing it (a 10 MB prompt takes seconds and GBs to encode)."""
        why = self._too_big(rec)
        if why is not None:
            raise FieldProblem(rec.prompt_field(), why)

    def _encode_texts(self, texts: list[str], rendered: list[bool]) -> list[list[int]]:
        """Token ids of whole prompts, in order: plain texts with the tokenizer's special tokens (as vLLM adds
        them), chat renders with none (their template wrote its own), each kind as one batch."""
        ids: list[list[int]] = [[] for _ in texts]
        for chat in (False, True):
            where = [k for k, r in enumerate(rendered) if r == chat]
            for k, enc in zip(where, encode_texts(self.tokenizer, [texts[k] for k in where], chat=chat)):
                ids[k] = enc
        return ids

    # -- chat templates ---------------------------------------------------------
    def _kwargs_of(self, rec: InputRecord) -> dict[str, Any]:
        return {**self.template_kwargs, **(rec.chat_template_kwargs or {})}

    def _template_args(self, extra: dict[str, Any]) -> dict[str, Any]:
        # The template's own variables go in as keyword arguments (enable_thinking=False, ...), after ours.
        kwargs: dict[str, Any] = {**extra, "add_generation_prompt": True, "tokenize": False}
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs

    def _render_batch(self, recs: list[InputRecord]) -> list[str | FieldProblem]:
        """Chat templates rendered a batch per distinct set of template kwargs; in a batch the template fails
        on, each record is rendered alone, so the error names its line."""
        found: list[str | FieldProblem | None] = [None] * len(recs)
        groups: dict[str, list[int]] = {}
        for i, rec in enumerate(recs):
            groups.setdefault(repr(sorted(self._kwargs_of(rec).items())), []).append(i)
        limit = template_time_limit()
        for members in groups.values():
            kwargs = self._template_args(self._kwargs_of(recs[members[0]]))
            try:
                with time_limit(limit):
                    texts = self.tokenizer.apply_chat_template([recs[i].prompt for i in members], **kwargs)
                if isinstance(texts, list) and len(texts) == len(members):
                    for i, text in zip(members, texts):
                        found[i] = text
                    continue
            except (Exception, TimeLimitExceeded):  # noqa: BLE001 - jinja errors, no template, a slow one: say which
                pass
            for i in members:
                try:
                    with time_limit(limit):
                        found[i] = self.tokenizer.apply_chat_template(recs[i].prompt, **kwargs)
                except TimeLimitExceeded:
                    found[i] = FieldProblem(recs[i].prompt_field(), f"the chat template did not finish within "
                                                                    f"{limit:g} s ({TEMPLATE_TIMEOUT_ENV})")
                except Exception as exc:  # noqa: BLE001
                    found[i] = FieldProblem(recs[i].prompt_field(), f"the chat template failed: {exc}")
        return found  # type: ignore[return-value]


def _string_bytes(value: Any) -> int:
    """UTF-8 bytes of every string (keys too) in nested dicts and lists (walked without recursion)."""
    total, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node.encode(errors="surrogatepass"))
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return total
