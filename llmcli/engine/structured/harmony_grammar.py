"""A constraint on a Harmony model (gpt-oss) applies to its final answer only: the grammar lets the analysis
run free (up to a token budget, if one is set), then writes the final channel's header and hands over to the
constraint's own grammar, so reasoning and a valid answer both come back.

The analysis is a text lexeme, which never matches a special token: it ends where the model writes
``<|end|>``, or where its budget (llguidance's ``max_tokens`` on the rule) runs out and ``<|end|>`` is the only
token left. The headers are forced, so a model that would answer without reasoning (``<|channel|>final``
first) may, and one that would wander into a tool call or a second analysis cannot.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from llmcli.sampling_params import StructuredOutputsParams

# What the final message may hold when only a thinking budget is asked for: any text.
FREE_TEXT = StructuredOutputsParams(regex=r"(?s:.*)")


@dataclass(frozen=True)
class HarmonyFrame:
    """Where the completion starts ("header": after the prompt's ``<|start|>assistant``; "analysis": inside
    an analysis message the prompt opened) and the analysis's token budget (None: unbounded)."""

    start: str
    budget: int | None = None

    @property
    def key(self) -> str:
        return f"harmony:{self.start}:{self.budget}"

    def wrap(self, inner: str) -> str:
        """The grammar for the whole completion around ``inner`` (llguidance's grammar of the constraint:
        Lark text or a serialized top-level grammar)."""
        top = json.loads(inner) if inner.lstrip().startswith("{") else {"grammars": [{"lark_grammar": inner}]}
        answer = top["grammars"][0]
        name = answer.get("name") or "answer"
        answer["name"] = name
        # rule attributes are llguidance's Lark extension; max_tokens bounds the lexeme's tokens
        thought = "thought" if self.budget is None else f"thought[max_tokens={self.budget}]"
        final = f'<|channel|> "final" <|message|> @{name}'
        analysis_tail = '<|end|> <|start|> "assistant" '
        if self.start == "analysis":
            start = f"start: thought {analysis_tail}{final}"
        elif self.budget == 0:  # no reasoning at all: straight to the answer
            start = f"start: {final}"
        else:
            start = f'start: analysis? {final}\nanalysis: <|channel|> "analysis" <|message|> thought {analysis_tail}'
        lark = f"{start}\n{thought}: /(?s:.*)/\n"
        return json.dumps({"grammars": [{"lark_grammar": lark}, *top["grammars"]]})
