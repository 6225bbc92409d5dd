"""Score records: the log-likelihood of given continuations of a prompt (``continuations``), or the
perplexity of a text (``"score": "perplexity"``). They generate nothing: the engine's prompt logprobs
answer them, one engine request per continuation (or one for the text)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmcli.cli.io.field_problem import FieldProblem
from llmcli.sampling_params import SamplingParams

SCORE_FIELDS = ("continuations", "score")
SCORE_KINDS = ("perplexity",)
MAX_CONTINUATIONS = 1024
# One generated token because a request must generate something; its logprobs are not read.
SCORE_PARAMS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)


@dataclass
class Score:
    """What a score record asks: ``kind`` "continuations" or "perplexity"; the continuations as written
    (texts or token ids); ``continuation_ids``: their tokens, filled in when the record is prepared."""

    kind: str
    continuations: list[str | list[int]] = field(default_factory=list)
    continuation_ids: list[list[int]] = field(default_factory=list)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           and t >= 0 for t in value)


def take_score(obj: dict[str, Any], sampling: dict[str, Any]) -> Score | None:
    """The score a plain record asks for, or None; FieldProblem for a malformed one or one with sampling
    fields (a score record generates no text)."""
    conts, kind = obj.get("continuations"), obj.get("score")
    if conts is None and kind is None:
        return None
    if conts is not None and kind is not None:
        raise FieldProblem("score", "conflicts with continuations: a record scores continuations or its whole "
                                    "prompt, not both")
    if sampling:
        name = next(iter(sampling))
        raise FieldProblem(name, "a score record generates no text, so it takes no sampling fields")
    if kind is not None:
        if kind not in SCORE_KINDS:
            raise FieldProblem("score", f"must be one of {', '.join(SCORE_KINDS)} (the continuations of a prompt "
                                        "are scored with \"continuations\")")
        return Score(kind)
    if not isinstance(conts, list) or not conts:
        raise FieldProblem("continuations", "must be a non-empty array of strings (or of token-id arrays)")
    if len(conts) > MAX_CONTINUATIONS:
        raise FieldProblem("continuations", f"holds {len(conts)} items; at most {MAX_CONTINUATIONS}")
    for j, c in enumerate(conts):
        if not ((isinstance(c, str) and c) or _is_ids(c)):
            raise FieldProblem(f"continuations[{j}]", "must be a non-empty string or a non-empty array of "
                                                      "token ids")
    return Score("continuations", list(conts))
