"""Logprobs in output records: llmcli's plain shape and OpenAI's chat / completions shapes.

Every position the engine reports is ``{token id: Logprob}``: the chosen token first,
then the top k (which may include it). A token's text is the tokenizer's decoding
of that one token (``token_id:N`` when the model has no tokenizer); ``bytes`` are
that text's UTF-8 bytes.
"""
from __future__ import annotations

from typing import Any

from llmcli.engine.outputs import Logprob


def _text(token_id: int, lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def _top(position: dict[int, Logprob], chosen: int, k: int) -> list[tuple[int, Logprob]]:
    """The k likeliest of the position, best first (the chosen token only if it is among them)."""
    ranked = sorted(((tid, lp) for tid, lp in position.items() if tid != chosen or lp.rank is not None
                     and lp.rank <= k), key=lambda item: -item[1].logprob)
    return ranked[:k]


def plain_logprobs(token_ids: list[int], positions: list[dict[int, Logprob]], k: int) -> list[dict[str, Any]]:
    """``[{token, token_id, logprob, top_logprobs: [{token, token_id, logprob}]}]``, one per token."""
    out = []
    for token, position in zip(token_ids, positions):
        lp = position[token]
        out.append({"token": _text(token, lp), "token_id": token, "logprob": lp.logprob,
                    "top_logprobs": [{"token": _text(t, x), "token_id": t, "logprob": x.logprob}
                                     for t, x in _top(position, token, k)]})
    return out


def plain_prompt_logprobs(token_ids: list[int], positions: list[dict[int, Logprob] | None],
                          k: int) -> list[dict[str, Any] | None]:
    """As ``plain_logprobs`` for the prompt; the first token has no context, so null."""
    return [None] + plain_logprobs(token_ids[1:], positions[1:], k)


def chat_logprobs(token_ids: list[int], positions: list[dict[int, Logprob]], k: int) -> dict[str, Any]:
    """OpenAI chat completions: ``{content: [{token, logprob, bytes, top_logprobs: [...]}], refusal}``."""
    def item(token: int, lp: Logprob) -> dict[str, Any]:
        text = _text(token, lp)
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

    content = [{**item(token, position[token]), "top_logprobs": [item(t, x) for t, x in _top(position, token, k)]}
               for token, position in zip(token_ids, positions)]
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: list[int], positions: list[dict[int, Logprob]], k: int) -> dict[str, Any]:
    """OpenAI (legacy) completions: ``{tokens, token_logprobs, top_logprobs, text_offset}``."""
    tokens, token_logprobs, top, offsets, at = [], [], [], [], 0
    for token, position in zip(token_ids, positions):
        lp = position[token]
        text = _text(token, lp)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top.append({_text(t, x): x.logprob for t, x in _top(position, token, k)})
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
