"""Reasoning parsers: split a thinking model's output into its reasoning and its answer.

Qwen3 thinks between ``<think>`` and ``</think>`` before it answers. Its chat template may already have
written ``<think>`` into the prompt (then the output holds only the closing tag), and with
``enable_thinking: false`` the template writes an empty think block, so the output holds no tags at all.
"""
from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PARSERS = ("qwen3",)


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the output has no reasoning part
    content: str


def split_qwen3(text: str) -> Split:
    """``<think>R</think>C`` → (R, C). Without ``</think>``: a text that opened ``<think>`` was cut off
    while thinking (all of it is reasoning, the answer is empty); one with no tags is all answer."""
    head = text.lstrip()
    opened = head.startswith(THINK_OPEN)
    if opened:
        head = head[len(THINK_OPEN):]
    if THINK_CLOSE in head:
        reasoning, _, content = head.partition(THINK_CLOSE)
        return Split(reasoning.strip("\n"), content.lstrip("\n"))
    if opened:
        return Split(head.strip("\n"), "")
    return Split(None, text)


def choose_parser(option: str, chat_template: str | None) -> str | None:
    """The parser to use: ``option`` itself, or for ``auto`` qwen3 when the chat template uses <think>."""
    if option == "none":
        return None
    if option == "auto":
        return "qwen3" if chat_template and THINK_OPEN in chat_template else None
    if option not in PARSERS:
        raise ValueError(f"unknown reasoning parser {option!r} (choose from auto, none, {', '.join(PARSERS)})")
    return option


def split_reasoning(parser: str | None, text: str) -> Split:
    """``text`` split by ``parser`` (None: no reasoning part)."""
    if parser is None:
        return Split(None, text)
    return split_qwen3(text)
