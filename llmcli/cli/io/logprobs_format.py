"""Logprobs in output records: llmcli's plain shape and OpenAI's chat / completions shapes.

Every position the engine reports is ``{token id: Logprob}``: the chosen token first,
then the top k (which may include it). A token's text is the tokenizer's decoding
of that one token (``token_id:N`` when the model has no tokenizer); ``bytes`` are
the token's own bytes (``TokenBytes``), so a token holding part of a character
gives that part, and the bytes of a completion's tokens join into its text.
"""
from __future__ import annotations

import re
from typing import Any, Callable

from llmcli.engine.outputs import Logprob

Bytes = Callable[[int, str], list[int]]  # (token id, its text) -> the token's bytes

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TokenBytes:
    """A token's own bytes, from its vocabulary entry: byte-level BPE (GPT-2, Qwen, Llama 3) spells each byte
    as one printable character, SentencePiece writes ``<0xE2>`` byte tokens and ``▁`` for a space. Without
    a tokenizer (or for a piece neither explains) the UTF-8 of the token's text."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, list[int]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel" or "ByteLevel" in repr(decoder)
        self.table: dict[str, int] = {}
        if self.byte_level:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            self.table = {char: byte for byte, char in bytes_to_unicode().items()}

    def __call__(self, token: int, text: str) -> list[int]:
        found = self.cache.get(token)
        if found is None:
            found = self.cache[token] = self._bytes(token, text)
        return found

    def _bytes(self, token: int, text: str) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token) if self.tokenizer is not None else None
        if not isinstance(piece, str):
            return list(text.encode("utf-8"))
        if self.byte_level and all(c in self.table for c in piece):
            return [self.table[c] for c in piece]
        match = _BYTE_TOKEN.fullmatch(piece)
        if match:
            return [int(match.group(1), 16)]
        if not self.byte_level and "\u2581" in piece:
            return list(piece.replace("\u2581", " ").encode("utf-8"))
        return list(text.encode("utf-8"))


def _utf8(token: int, text: str) -> list[int]:
    return list(text.encode("utf-8"))


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


def chat_logprobs(token_ids: list[int], positions: list[dict[int, Logprob]], k: int,
                  token_bytes: Bytes | None = None) -> dict[str, Any]:
    """OpenAI chat completions: ``{content: [{token, logprob, bytes, top_logprobs: [...]}], refusal}``."""
    to_bytes = token_bytes or _utf8

    def item(token: int, lp: Logprob) -> dict[str, Any]:
        text = _text(token, lp)
        return {"token": text, "logprob": lp.logprob, "bytes": to_bytes(token, text)}

    content = [{**item(token, position[token]), "top_logprobs": [item(t, x) for t, x in _top(position, token, k)]}
               for token, position in zip(token_ids, positions)]
    return {"content": content, "refusal": None}


def completion_logprobs(token_ids: list[int], positions: list[dict[int, Logprob]], k: int) -> dict[str, Any]:
    """OpenAI (legacy) completions: ``{tokens, token_logprobs, top_logprobs, text_offset}``; each position's
    ``top_logprobs`` holds the k likeliest and the sampled token (OpenAI: "up to logprobs+1")."""
    tokens, token_logprobs, top, offsets, at = [], [], [], [], 0
    for token, position in zip(token_ids, positions):
        lp = position[token]
        text = _text(token, lp)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        top.append({_text(t, x): x.logprob for t, x in [(token, lp), *_top(position, token, k)]})
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def echo_logprobs(prompt_ids: list[int], prompt_positions: list[dict[int, Logprob] | None], first_text: str,
                  token_ids: list[int], positions: list[dict[int, Logprob]], k: int) -> dict[str, Any]:
    """Completions with ``echo``: the prompt's tokens, then the completion's, in ``completion_logprobs``'
    shape; the first prompt token has no context, so its logprob and top list are null (OpenAI, vLLM)."""
    head = completion_logprobs(prompt_ids[1:], list(prompt_positions)[1:], k)
    tail = completion_logprobs(token_ids, positions, k)
    tokens = [first_text, *head["tokens"], *tail["tokens"]]
    offsets, at = [], 0
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [None, *head["token_logprobs"], *tail["token_logprobs"]],
            "top_logprobs": [None, *head["top_logprobs"], *tail["top_logprobs"]], "text_offset": offsets}
