"""Grammars for constrained decoding: compiled from a request's
StructuredOutputParams against the tokenizer's vocabulary (xgrammar), and
matched token by token for the scheduler (scheduler/constraint.py)."""

from aioserve.grammar.compiler import GrammarBudget, GrammarCompiler, GrammarError, compiler_for
from aioserve.grammar.matcher import CompiledGrammar

__all__ = ["CompiledGrammar", "GrammarBudget", "GrammarCompiler", "GrammarError", "compiler_for"]
