"""From a StructuredOutputsParams to llguidance's grammar text, and checking it without a tokenizer."""
from __future__ import annotations

import json
from typing import Any

from llmcli.sampling_params import StructuredOutputsParams

INSTALL_HINT = "structured outputs need llguidance: pip install 'llguidance>=1.0'"
# JSON is written as json.dumps writes it: ", " and ": ", no other whitespace. Free whitespace lets a
# model pad forever; a schema's own "x-guidance" options still win over these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's per-step work limits, raised for batch use (its defaults in brackets). A matcher that hits one
# stops with "ParserTooComplex" and its request ends with finish_reason "abort" (README); these leave room
# for long arrays and strings at the price of a rare slow step. The lexer fuel costs ~1 ms per 14k.
PARSER_LIMITS = {
    "step_lexer_fuel": 1_000_000,  # [200k] lexer work per mask
    "step_max_items": 200_000,  # [50k] Earley items per mask
    "max_items_in_row": 10_000,  # [2000] items in one Earley row
    "initial_lexer_fuel": 4_000_000,  # [1M] building the lexer at compile time
}


class GrammarError(ValueError):
    """A schema, regex, choice list or grammar that cannot be compiled; the message says why."""


def load_llguidance() -> Any:
    try:
        import llguidance as llg
    except ImportError:  # pragma: no cover - it is a dependency; a broken install still gets a clear message
        raise GrammarError(INSTALL_HINT) from None
    return llg


def parser_limits() -> Any:
    """``PARSER_LIMITS`` as llguidance takes them (read at each compile, so tests can tighten them)."""
    return load_llguidance().LLParserLimits(**PARSER_LIMITS)


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``spec`` (not yet checked)."""
    matcher = load_llguidance().LLMatcher
    kind = spec.kind
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json":
        return matcher.grammar_from_json_schema(spec.json, defaults=JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        # Lark string literals take JSON's escapes.
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    return matcher.grammar_from_lark(spec.grammar)


_checked: dict[str, str] = {}  # canonical key -> "" or the error; a batch repeats few distinct constraints


def check_constraint(spec: StructuredOutputsParams) -> None:
    """Raise GrammarError if ``spec`` cannot be compiled (cached per distinct constraint; no tokenizer needed)."""
    error = _checked.get(spec.key)
    if error is None:
        try:
            error = load_llguidance().LLMatcher.validate_grammar(grammar_text(spec), limits=parser_limits())
        except (ValueError, TypeError) as exc:
            error = str(exc) or type(exc).__name__
        if len(_checked) < 65536:
            _checked[spec.key] = error
    if error:
        text = " ".join(line.strip() for line in error.strip().splitlines() if line.strip())
        raise GrammarError(text if len(text) <= 300 else text[:297] + "...")
