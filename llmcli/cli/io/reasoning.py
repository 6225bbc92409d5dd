"""Reasoning parsers: split a thinking model's output into its reasoning and its answer.

Qwen3 thinks between ``<think>`` and ``</think>`` before it answers. Its chat template may already have
written ``<think>`` into the prompt (then the output holds only the closing tag), and with
``enable_thinking: false`` the template writes an empty think block, so the output holds no tags at all.

gpt-oss writes Harmony messages: its analysis channel is the reasoning, its final channel the answer, and a
commentary message addressed to a tool a tool call. They are read from the token ids (``engine/harmony.py``),
whose special tokens mark every message exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmcli.engine.harmony import HarmonyTokens, read_output

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
HARMONY_MARK = "<|channel|>"
PARSERS = ("qwen3", "harmony")


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the output has no reasoning part
    content: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape


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
        if chat_template and HARMONY_MARK in chat_template:
            return "harmony"
        return "qwen3" if chat_template and THINK_OPEN in chat_template else None
    if option not in PARSERS:
        raise ValueError(f"unknown reasoning parser {option!r} (choose from auto, none, {', '.join(PARSERS)})")
    return option


def split_reasoning(parser: str | None, text: str) -> Split:
    """``text`` split by ``parser`` (None: no reasoning part)."""
    if parser is None:
        return Split(None, text)
    return split_qwen3(text)


class OutputSplitter:
    """Splits each completion by the run's reasoning parser: the text parsers read its text, Harmony its
    token ids (decoded a message at a time with the tokenizer)."""

    def __init__(self, parser: str | None, tokenizer: Any) -> None:
        self.parser = parser
        self.tokenizer = tokenizer
        self.harmony = HarmonyTokens.of(tokenizer) if parser == "harmony" else None
        if parser == "harmony" and self.harmony is None:
            raise ValueError("--reasoning-parser harmony needs a tokenizer with Harmony's special tokens "
                             "(<|start|>, <|channel|>, <|message|>, <|end|>, <|return|>, <|call|>)")

    def split(self, out: Any) -> Split:
        """``out``: a RequestOutput of one completion (its text already decoded)."""
        if self.harmony is None:
            return split_reasoning(self.parser, out.text)
        found = read_output(out, self.tokenizer, self.harmony)
        if found is None:  # no Harmony message at all: the text as it is, all answer
            return Split(None, out.text)
        calls = [{"id": f"call_{i}", "type": "function", "function": {"name": name.removeprefix("functions."),
                                                                      "arguments": arguments}}
                 for i, (name, arguments) in enumerate(found.tool_calls)]
        return Split(found.reasoning, found.text, calls)


def split_output(reasoning: str | OutputSplitter | None, out: Any) -> Split:
    """``out`` (a RequestOutput of one completion) split by the run's parser: a splitter, or a text parser's
    name (None: no reasoning part)."""
    if isinstance(reasoning, OutputSplitter):
        return reasoning.split(out)
    return split_reasoning(reasoning, out.text)


def make_splitter(parser: str | None, tokenizer: Any) -> OutputSplitter | None:
    """The run's splitter (None: texts are left whole)."""
    return OutputSplitter(parser, tokenizer) if parser is not None else None
