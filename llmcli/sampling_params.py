"""Per-request sampling settings, validated when they are made."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any


class SamplingParamsError(ValueError):
    """A sampling setting is out of range; the message names the field."""


# Fields a model's generation_config.json may supply when the request leaves them unset, and the neutral
# value each takes when neither sets it.
MODEL_DEFAULTABLE = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
MAX_LOGPROBS = 20
# Limits (README, reliability): integers travel to the device as int64 (seeds) or are counted in int32 tensors,
# and a request's completions are all held at once.
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
MAX_N = 16384
# The sampler works in float32: a temperature below MIN_TEMPERATURE is greedy (dividing logits by it would
# overflow to inf), one above MAX_TEMPERATURE would flatten them to zero; a top_p below MIN_TOP_P keeps only the
# top token (as any top_p under the top token's probability does: no vocabulary holds 10^6 tokens), while in
# float32 a smaller one would round to 0 and keep none.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-5, 1e4
MIN_TOP_P = 1e-6
MIN_PENALTY, MAX_PENALTY = 1e-4, 1e4  # repetition_penalty divides or multiplies logits in float32
# llguidance numbers a grammar's symbols in 16 bits: a choice of 70,000 strings panics at compile time, and
# compile time grows with the size; these keep a constraint well inside both (README, structured outputs).
MAX_CHOICES = 16384
MAX_CONSTRAINT_BYTES = 1 << 20


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the completion's text; give exactly one field (vLLM's name and fields).

    ``json``: a JSON schema (dict or JSON text); ``json_object=True``: any JSON object; ``regex``: the whole
    completion matches it; ``choice``: the completion is one of these strings; ``grammar``: a Lark grammar
    (llguidance's dialect; ``start`` is the top rule). Plain data, so it travels to data-parallel replicas.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise SamplingParamsError("SamplingParams.structured_outputs: give exactly one of json, regex, choice, "
                                      f"grammar, json_object (got {', '.join(given) or 'none'})")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as exc:
                raise SamplingParamsError(f"SamplingParams.structured_outputs: json is not valid JSON ({exc})") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise SamplingParamsError("SamplingParams.structured_outputs: json must be a JSON schema object")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise SamplingParamsError("SamplingParams.structured_outputs: choice must be a non-empty list of "
                                          "non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
            if len(self.choice) > MAX_CHOICES:
                raise SamplingParamsError(f"SamplingParams.structured_outputs: choice holds {len(self.choice)} "
                                          f"strings; at most {MAX_CHOICES} are supported")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(f"SamplingParams.structured_outputs: {name} must be a non-empty string")
        size = len(self.key.encode())
        if size > MAX_CONSTRAINT_BYTES:
            raise SamplingParamsError(f"SamplingParams.structured_outputs: the {self.kind.replace('_', ' ')} is "
                                      f"{size} bytes; at most {MAX_CONSTRAINT_BYTES} (1 MiB) are supported")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"

    @property
    def key(self) -> str:
        """Canonical text of the constraint: equal constraints share one compiled grammar."""
        value = True if self.json_object else getattr(self, self.kind)
        return self.kind + ":" + json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


@dataclass
class SamplingParams:
    """How one request is decoded.

    ``temperature=0`` is greedy (argmax) and deterministic. ``top_k=-1`` (or 0) and
    ``top_p=1`` and ``min_p=0`` switch those filters off. ``max_tokens=None``
    generates until EOS, a stop condition or ``max_model_len``. ``seed`` makes a
    request reproducible whatever it is batched with.

    ``temperature``, ``top_p``, ``top_k``, ``min_p`` and ``repetition_penalty`` left
    unset (``None``) take the neutral values above in ``LLM.generate`` (as in vLLM, the
    model's generation_config.json values apply there only when no SamplingParams are
    given: ``LLM.get_default_sampling_params()``); a request added to the engine directly,
    as the command line adds each record, takes the model's values for them when the
    engine runs with ``generation_config="auto"``. Reading them gives the neutral value. ``logprobs=k`` / ``prompt_logprobs=k`` (0-20)
    return each generated / prompt token's log probability and the k likeliest
    alternatives, from the model's raw distribution (before penalties and temperature).
    ``repetition_penalty`` scales the logits of tokens seen in the prompt or output
    (HF semantics); ``presence_penalty`` / ``frequency_penalty`` subtract from tokens
    generated so far (OpenAI semantics).

    ``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled, and stop strings do not
    end the completion, before this many tokens. ``logit_bias`` ({token id: -100 to 100})
    is added to the logits, ``allowed_token_ids`` keeps only those tokens, ``bad_words``
    bans words that are one token (with or without a leading space; a longer one is an
    error: banning it would need the previous tokens). ``truncate_prompt_tokens=k`` keeps
    the last k prompt tokens (-1: as many as leave room for one generated token).
    ``detokenize=False``: completions carry token ids and an empty ``text`` (vLLM's meaning).
    ``thinking_token_budget=k`` (a Harmony model: gpt-oss) ends the analysis after at most k tokens and goes on
    to the final answer, which a structured-output constraint then shapes (docs/cli.md).
    ``skip_reading_prefix_cache=True`` computes the whole prompt even where the prefix cache holds it (its
    blocks are still cached for others); None, the default, skips it only with ``prompt_logprobs``, whose
    cached positions would have no logits (so False with ``prompt_logprobs`` is an error), unless
    ``prompt_logprobs_start=s`` says only prompt tokens ``s`` onwards need theirs: ``prompt_logprobs[j]`` is
    None for ``j < s``, and the prefix cache may serve the prompt up to the position whose logits give token
    ``s`` (scoring continuations of a shared context).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    structured_outputs: StructuredOutputsParams | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True  # False: completions' text stays "" (token ids only), as in vLLM
    skip_reading_prefix_cache: bool | None = None
    prompt_logprobs_start: int | None = None  # the first prompt token whose prompt logprob is wanted
    thinking_token_budget: int | None = None  # a Harmony model's analysis, at most this many tokens (vLLM's name)
    unset: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logit_bias, dict):
            # JSON objects (OpenAI's logit_bias) have string keys
            self.logit_bias = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                               for k, v in self.logit_bias.items()}
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if type(self.top_k) is int and self.top_k == 0:
            self.top_k = -1  # vLLM and HF read 0 as off too; one spelling for the sampler
        self.unset = frozenset(name for name in MODEL_DEFAULTABLE if getattr(self, name) is None)
        for name in self.unset:
            setattr(self, name, MODEL_DEFAULTABLE[name])
        self._check()
        # Values past what float32 can tell apart from the limit behave as the limit (see MIN_TEMPERATURE).
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        if self.top_p < MIN_TOP_P:
            self.top_p = MIN_TOP_P

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with ``changes``; fields still unset here stay unset (``dataclasses.replace`` would set them)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        values.update({name: None for name in self.unset})
        values.update(changes)
        return SamplingParams(**values)

    def with_defaults(self, defaults: dict[str, Any]) -> "SamplingParams":
        """Unset fields take ``defaults`` (the model's generation config); the result has none unset."""
        chosen = {name: defaults[name] for name in self.unset if name in defaults}
        if not chosen and not self.unset:
            return self
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        values.update(chosen)
        return SamplingParams(**values)

    @property
    def has_token_bias(self) -> bool:
        """Whether the request changes logits token by token (logit_bias, allowed_token_ids, bad_words)."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether the request may start from prompt blocks the prefix cache holds."""
        return self.max_cached_prompt_tokens != 0

    @property
    def max_cached_prompt_tokens(self) -> int | None:
        """How many leading prompt tokens the prefix cache may serve (None: as many as it holds). The logprob
        of prompt token j comes from the logits at position j - 1, which must be computed, not cached."""
        if self.skip_reading_prefix_cache:
            return 0
        if self.prompt_logprobs is None:
            return None
        return max(0, (self.prompt_logprobs_start or 0) - 1)

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def _check(self) -> None:
        def bad(field_name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"SamplingParams.{field_name}: {why} (got {getattr(self, field_name)!r})")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):  # NaN passes every range check
                raise bad(f.name, "must be a finite number")
        if not is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 means greedy)")
        if self.temperature > MAX_TEMPERATURE:
            raise bad("temperature", f"must be from 0 to {MAX_TEMPERATURE:g} (0 and anything below "
                                     f"{MIN_TEMPERATURE:g} mean greedy)")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1) or self.top_k > INT32_MAX:
            raise bad("top_k", f"must be -1 or 0 (off) or an integer from 1 to {INT32_MAX}")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1, or None for 'until the context is full'")
        if self.max_tokens is not None and self.max_tokens > INT32_MAX:
            raise bad("max_tokens", f"must be an integer from 1 to {INT32_MAX}, or None for 'until the context "
                                    "is full'")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"must be an integer from 1 to {MAX_N}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= INT64_MAX):
            raise bad("seed", f"must be an integer from 0 to {INT64_MAX} (2^63 - 1)")
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            raise bad("seed", f"with n={self.n} must be at most {INT64_MAX - self.n + 1}: completion i uses "
                              f"seed + i, and seeds end at 2^63 - 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if any(not is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be an integer from 0 to {MAX_LOGPROBS}, or None for none")
        if not is_number(self.repetition_penalty) or not MIN_PENALTY <= self.repetition_penalty <= MAX_PENALTY:
            raise bad("repetition_penalty", f"must be a number from {MIN_PENALTY:g} to {MAX_PENALTY:g} (1 is off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(name, "must be a number from -2 to 2 (0 is off)")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.thinking_token_budget is not None and (not is_int(self.thinking_token_budget)
                                                       or not 0 <= self.thinking_token_budget <= INT32_MAX):
            raise bad("thinking_token_budget", "must be an integer >= 0 (0: answer without reasoning), or None")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(not is_int(k) or k < 0 for k in self.logit_bias):
                raise bad("logit_bias", "must map token ids (integers >= 0) to numbers")
            if any(not is_number(v) or not -100 <= v <= 100 for v in self.logit_bias.values()):
                raise bad("logit_bias", "values must be numbers from -100 to 100")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                or any(not is_int(t) or t < 0 for t in self.allowed_token_ids)):
            raise bad("allowed_token_ids", "must be a non-empty list of non-negative token ids")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple))
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            raise bad("bad_words", "must be a list of non-empty strings")
        if self.truncate_prompt_tokens is not None and (not is_int(self.truncate_prompt_tokens) or (
                self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 for what max_model_len allows")
        if not (self.skip_reading_prefix_cache is None or isinstance(self.skip_reading_prefix_cache, bool)):
            raise bad("skip_reading_prefix_cache", "must be true, false or None")
        if self.prompt_logprobs_start is not None:
            if not is_int(self.prompt_logprobs_start) or not 0 <= self.prompt_logprobs_start <= INT32_MAX:
                raise bad("prompt_logprobs_start", "must be an integer >= 0 (a prompt position), or None")
            if self.prompt_logprobs is None:
                raise bad("prompt_logprobs_start", "needs prompt_logprobs (it says which prompt tokens get theirs)")
        if self.skip_reading_prefix_cache is False and self.prompt_logprobs is not None \
                and self.prompt_logprobs_start is None:
            raise bad("skip_reading_prefix_cache", "cannot be False with prompt_logprobs: a cached prompt "
                                                   "position has no logits (leave it None, or give "
                                                   "prompt_logprobs_start)")
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", "must be true or false")
        if not self.detokenize and self.stop:
            raise bad("detokenize", "must be True with stop strings: finding them needs the text (use stop_token_ids)")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
