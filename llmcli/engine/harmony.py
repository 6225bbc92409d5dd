"""Harmony, gpt-oss's chat format, read from token ids: its special tokens, the messages of a completion
(channel, recipient, content), where a prompt leaves the assistant, and which ``<|end|>`` ends a generation.

A Harmony completion is a run of messages ``<|channel|>C<|message|>...<|end|>`` joined by
``<|start|>assistant``, the last one closed by ``<|return|>`` (the final answer) or ``<|call|>`` (a tool
call). The special tokens make the split exact, so nothing here searches decoded text for markers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

REASONING_EFFORTS = ("low", "medium", "high")
BUDGET_NEEDS_HARMONY = ("needs a model whose chat format marks its reasoning with special tokens (Harmony: "
                        "gpt-oss); this model's does not")
_NAMES = {"start": "<|start|>", "channel": "<|channel|>", "message": "<|message|>", "end": "<|end|>",
          "ret": "<|return|>", "call": "<|call|>", "constrain": "<|constrain|>"}


def reasoning_effort_problem(value: Any) -> str | None:
    """Why ``value`` is no reasoning effort the Harmony template takes (None: it is fine)."""
    if value in REASONING_EFFORTS:
        return None
    return f"must be one of {', '.join(REASONING_EFFORTS)}, got {value!r}"


@dataclass(frozen=True)
class HarmonyTokens:
    """The ids of Harmony's special tokens in one tokenizer."""

    start: int
    channel: int
    message: int
    end: int
    ret: int
    call: int
    constrain: int | None = None

    @classmethod
    def of(cls, tokenizer: Any) -> HarmonyTokens | None:
        """The tokenizer's Harmony tokens, or None when it lacks one of them (not a Harmony model)."""
        if tokenizer is None:
            return None
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        ids = {key: vocab.get(name) for key, name in _NAMES.items()}
        if any(ids[k] is None for k in ("start", "channel", "message", "end", "ret", "call")):
            return None
        return cls(**ids)

    @property
    def closers(self) -> frozenset[int]:
        return frozenset((self.end, self.ret, self.call))

    @property
    def specials(self) -> frozenset[int]:
        return self.closers | {t for t in (self.start, self.channel, self.message, self.constrain) if t is not None}


@dataclass
class Message:
    """One message of a completion: its header's tokens, its content's tokens, and the token that closed it
    (None: the completion ended inside it)."""

    header: list[int] = field(default_factory=list)
    content: list[int] = field(default_factory=list)
    closed_by: int | None = None
    has_body: bool = False  # its <|message|> was generated (a header cut short has none)


def messages_of(ids: list[int], tokens: HarmonyTokens, in_content: bool = False) -> list[Message]:
    """The messages of a completion, ``ids`` starting inside a header (after the prompt's
    ``<|start|>assistant``) or, with ``in_content``, inside a message's content (the prompt ended with
    ``<|message|>``)."""
    out = [Message(has_body=in_content)]
    closers = tokens.closers
    for t in ids:
        msg = out[-1]
        if msg.closed_by is not None:
            if t == tokens.start:
                out.append(Message())
            else:  # text between messages (a malformed completion): a header without its <|start|>
                out.append(Message(header=[t]))
            continue
        if msg.has_body:
            if t in closers:
                msg.closed_by = t
            else:
                msg.content.append(t)
        elif t == tokens.message:
            msg.has_body = True
        elif t in closers:  # a header closed before its <|message|>: nothing to read
            msg.closed_by = t
        else:
            msg.header.append(t)
    return [m for m in out if m.header or m.has_body]


@dataclass(frozen=True)
class Header:
    """What a message's header says: its channel and its recipient (``to=functions.x``), if any."""

    channel: str | None
    recipient: str | None
    constrain: str | None = None  # <|constrain|>json: the content's format


def read_header(msg: Message, tokens: HarmonyTokens, decode: Callable[[list[int]], str],
                channel: str | None = None) -> Header:
    """``channel``: the channel the prompt's header already named (a completion starting in content)."""
    before, after, constrain, seen_channel, seen_constrain = [], [], [], False, False
    for t in msg.header:
        if t == tokens.channel:
            seen_channel = True
        elif tokens.constrain is not None and t == tokens.constrain:
            seen_constrain = True
        elif seen_constrain:
            constrain.append(t)
        elif seen_channel:
            after.append(t)
        else:
            before.append(t)
    words = decode(after).split() if seen_channel else []
    role = decode(before).split()
    recipient = next((w[3:] for w in role + words if w.startswith("to=")), None)
    name = words[0] if words and not words[0].startswith("to=") else channel
    return Header(name, recipient, decode(constrain).strip() or None)


@dataclass
class HarmonySplit:
    """A completion as the output shows it: the analysis (None: there was none), the final answer, and the
    tool calls of commentary messages with a recipient (name, arguments text)."""

    reasoning: str | None
    text: str
    tool_calls: list[tuple[str, str]] = field(default_factory=list)


def split_completion(ids: list[int], tokens: HarmonyTokens, decode: Callable[[list[int]], str],
                     prompt_tail: str | None = None) -> HarmonySplit | None:
    """analysis → reasoning, final → text, commentary with a recipient → a tool call, commentary without one
    (a preamble, written for the user) → text before the final answer. None when ``ids`` hold no Harmony
    special token at all (the caller keeps the plain text). ``prompt_tail``: ``prompt_state`` of the prompt."""
    in_content = prompt_tail not in (None, "header")
    if not in_content and not any(t in tokens.specials for t in ids):
        return None
    msgs = messages_of(ids, tokens, in_content=in_content)
    analysis, final, calls = [], [], []
    for i, msg in enumerate(msgs):
        header = read_header(msg, tokens, decode, channel=prompt_tail if i == 0 and in_content else None)
        if not msg.has_body:
            continue
        content = decode(msg.content)
        if header.channel == "analysis":
            analysis.append(content)
        elif header.recipient is not None and header.recipient != "user":
            calls.append((header.recipient, content))
        else:  # final, a commentary preamble, or a channel Harmony does not name: for the reader
            final.append(content)
    return HarmonySplit("\n\n".join(analysis) if analysis else None, "\n\n".join(final), calls)


def read_output(output: Any, tokenizer: Any, tokens: HarmonyTokens | None = None) -> HarmonySplit | None:
    """A Harmony model's RequestOutput (its first completion) as reasoning, final text and tool calls, from its
    token ids; None when the tokenizer is not Harmony's or the completion holds no Harmony message. For the
    Python API: ``read_output(llm.chat(...)[0], llm.get_tokenizer())``; ``tokens``: the tokenizer's Harmony
    tokens when already known (finding them reads the whole vocabulary)."""
    tokens = tokens or HarmonyTokens.of(tokenizer)
    if tokens is None:
        return None
    skip = output.outputs[0].skip_special_tokens

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=skip)

    prompt = list(output.prompt_token_ids or [])
    tail = prompt_state(prompt, tokens, decode) if prompt else "header"
    return split_completion(list(output.outputs[0].token_ids), tokens, decode, tail)


def prompt_state(prompt_ids: list[int], tokens: HarmonyTokens, decode: Callable[[list[int]], str]) -> str | None:
    """Where the prompt leaves the completion: "header" (right after ``<|start|>assistant``: the model writes
    the channel), a channel name (the prompt ended with that message's ``<|message|>``), or None (the prompt
    does not end in an open assistant message: a plain text prompt, or content already begun)."""
    last = next((i for i in range(len(prompt_ids) - 1, -1, -1) if prompt_ids[i] == tokens.start), None)
    if last is None:
        return None
    tail = prompt_ids[last + 1:]
    if any(t in tokens.closers for t in tail):
        return None
    head = tail[:tail.index(tokens.message)] if tokens.message in tail else tail
    role = head[:head.index(tokens.channel)] if tokens.channel in head else head
    if not decode(role).strip().startswith("assistant"):
        return None
    if tokens.message not in tail:
        return "header" if tokens.channel not in head else None  # a half-written channel: left alone
    if tail[-1] != tokens.message:
        return None
    return read_header(Message(header=head), tokens, decode).channel


def closes_final(token_ids: list[int], index: int, tokens: HarmonyTokens, decode: Callable[[list[int]], str]) -> bool:
    """Whether the ``<|end|>`` at ``index`` closes a final-channel message (the answer is complete, so the
    generation ends there rather than running on into another message)."""
    i = index - 1
    while i >= 0 and token_ids[i] != tokens.message:
        if token_ids[i] in tokens.closers or token_ids[i] == tokens.start:
            return False
        i -= 1
    j = i - 1
    while j >= 0 and token_ids[j] != tokens.channel:
        if token_ids[j] in tokens.closers or token_ids[j] == tokens.start:
            return False
        j -= 1
    if j < 0:
        return False
    words = decode(token_ids[j + 1:i]).split()
    return bool(words) and words[0] == "final" and not any(w.startswith("to=") for w in words)
