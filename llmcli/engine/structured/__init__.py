"""Structured outputs: constraints turned into llguidance grammars, compiled off the step loop, and the
per-step token bitmasks of constrained sequences (applied on the device by ``llmcli.layers.token_mask``)."""
from llmcli.engine.structured.compiler import GrammarCompiler
from llmcli.engine.structured.grammar import GrammarError, check_constraint, grammar_text
from llmcli.engine.structured.masks import ConstrainedBatch

__all__ = ["ConstrainedBatch", "GrammarCompiler", "GrammarError", "check_constraint", "grammar_text"]
