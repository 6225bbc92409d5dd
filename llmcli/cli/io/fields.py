"""Field names of input records: aliases of other tools, and the report of fields llmcli does not know."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

# Names other tools use for a field llmcli has under another name (HF generate, TGI / Anthropic, OpenAI).
ALIASES = {
    "max_new_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "stop_sequences": "stop",
}

# OpenAI body fields that name the request rather than ask for something: known, and not used.
OPENAI_BODY_EXTRA = ("model",)

SHOWN_LINES = 3  # line numbers listed per unknown field before "(and N more)"


class AliasConflict(ValueError):
    """A record gives both a field and one of its aliases, with different values."""

    def __init__(self, alias: str, canonical: str) -> None:
        super().__init__(f"conflicts with {canonical}: give only one of them")
        self.alias = alias
        self.canonical = canonical


def resolve_aliases(obj: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with every alias renamed to llmcli's name (the same value under both names is fine)."""
    out = dict(obj)
    for alias, canonical in ALIASES.items():
        if alias not in out:
            continue
        value = out.pop(alias)
        if canonical in out and out[canonical] != value:
            raise AliasConflict(alias, canonical)
        out[canonical] = value
    return out


def unknown_fields(obj: dict[str, Any], known: Iterable[str], prefix: str = "") -> list[str]:
    """Names (with ``prefix``, e.g. ``body.``) of the keys of ``obj`` outside ``known`` and the aliases."""
    allowed = set(known) | set(ALIASES)
    return [prefix + name for name in obj if name not in allowed]


@dataclass
class UnknownFieldReport:
    """Which unknown fields appeared on which lines, for one warning per field name."""

    lines: dict[str, list[int]] = field(default_factory=dict)
    hints: dict[str, str | None] = field(default_factory=dict)

    def add(self, name: str, line: int, hint: str | None = None) -> None:
        self.lines.setdefault(name, []).append(line)
        self.hints.setdefault(name, hint)

    def messages(self, source: str) -> list[str]:
        out = []
        for name, lines in self.lines.items():
            shown = ", ".join(str(n) for n in lines[:SHOWN_LINES])
            more = f" (and {len(lines) - SHOWN_LINES} more)" if len(lines) > SHOWN_LINES else ""
            word = "line" if len(lines) == 1 else "lines"
            hint = f' (did you mean "{self.hints[name]}"?)' if self.hints.get(name) else ""
            out.append(f'{source}: unknown field "{name}" on {word} {shown}{more}; ignored{hint}')
        return out
