"""Errors about command-line values, said in the CLI's words: the flag, what it must be, what it got.

``SamplingParams`` and ``Config`` name their Python fields (``SamplingParams.max_tokens: ...``,
``Config.max_num_seqs=0: ...``); a user who typed ``--max-tokens 0`` should read about ``--max-tokens``.
"""
from __future__ import annotations

import re

from llmcli.cli.options import ENGINE_KNOBS

_SAMPLING = re.compile(r"^SamplingParams\.(?P<field>\w+): (?P<why>.*?)(?: \(got (?P<got>.*)\))?$", re.S)
_CONFIG = re.compile(r"^Config\.(?P<field>\w+)=(?P<got>.*?): (?P<why>.*)$", re.S)

# Python-side wording that reads oddly for a flag (None is not something one can type).
_REWORDINGS = (
    (re.compile(r"must be an integer >= (\d+)\b.*"), r"must be at least \1"),
    (re.compile(r"must be a number >= (\d+)(.*)"), r"must be at least \1\2"),
    (re.compile(r"must be a positive integer\b.*"), "must be at least 1"),
    (re.compile(r"must be a non-negative integer\b.*"), "must be at least 0"),
)


def flag_for(owner: str, field_name: str) -> str:
    """The flag that sets ``field_name`` of ``owner`` ("Config" or "SamplingParams")."""
    if owner == "Config":
        for knob in ENGINE_KNOBS:
            if knob.name == field_name:
                return knob.option
    return "--" + field_name.replace("_", "-")


def _reword(why: str) -> str:
    for pattern, replacement in _REWORDINGS:
        if pattern.fullmatch(why):
            return pattern.sub(replacement, why)
    return why


def flag_message(message: str) -> str:
    """``message`` with a Config / SamplingParams field named by its flag; other messages are unchanged."""
    for owner, pattern in (("SamplingParams", _SAMPLING), ("Config", _CONFIG)):
        match = pattern.match(message)
        if match is None:
            continue
        why = _reword(match["why"])
        got = match["got"]
        if got is not None and got.startswith("'") and got.endswith("'"):
            got = got[1:-1]
        flag = flag_for(owner, match["field"])
        if not why.startswith("must") and got is not None:
            return f"{flag} {got}: {why}"  # e.g. --device cuda: no CUDA device is visible ...
        return f"{flag} {why}" + (f", got {got}" if got is not None else "")
    return message
