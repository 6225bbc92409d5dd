"""Per-request sampling settings, validated when they are made."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


class SamplingParamsError(ValueError):
    """A sampling setting is out of range; the message names the field."""


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
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(f"SamplingParams.structured_outputs: {name} must be a non-empty string")

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

    ``temperature=0`` is greedy (argmax) and deterministic. ``top_k=-1`` and
    ``top_p=1`` and ``min_p=0`` switch those filters off. ``max_tokens=None``
    generates until EOS, a stop condition or ``max_model_len``. ``seed`` makes a
    request reproducible whatever it is batched with.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int | None = 16
    ignore_eos: bool = False
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._check()

    def _check(self) -> None:
        def bad(field_name: str, why: str) -> SamplingParamsError:
            return SamplingParamsError(f"SamplingParams.{field_name}: {why} (got {getattr(self, field_name)!r})")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 means greedy)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or (self.top_k < 1 and self.top_k != -1):
            raise bad("top_k", "must be -1 (off) or an integer >= 1")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "must be an integer >= 1, or None for 'until the context is full'")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            raise bad("seed", "must be a non-negative integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
