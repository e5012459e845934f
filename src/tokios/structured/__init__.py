"""Structured output: constrained decoding that makes output match a JSON schema, a regex, a choice
or a grammar by construction (docs/structured.md).

- spec.py: `StructuredOutput`, what one request asks for (validated for shape at the door) and
  its llguidance grammar text;
- compiler.py: `GrammarCompiler`, one per engine: the llguidance tokenizer of the model, grammar
  compilation off the step loop (a worker thread), a cache of compiled grammars by content;
- matcher.py: `GrammarMatcher`, one per sequence: which tokens may come next, advanced by the
  scheduler as tokens are appended, rolled back never (proposals are checked, not consumed);
- bitmask.py: `GrammarBitmask`, owned by the model runner: fills the token bitmask of the
  constrained rows of a step (in a thread, while the model's forward runs) and applies it to the
  logits before the sampler.

Built on llguidance (its Earley parser and lexer compute a mask in ~100 us for our vocabularies).
"""

from tokios.structured.compiler import CompiledGrammar, GrammarCompiler
from tokios.structured.matcher import GrammarMatcher
from tokios.structured.spec import StructuredOutput

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "StructuredOutput"]
