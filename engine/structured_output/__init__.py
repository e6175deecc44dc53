"""Structured output with llguidance: grammars compiled off the engine thread, token masks per step.

``GrammarCompiler`` turns a request's ``StructuredOutputsParams`` into an llguidance grammar and
compiles it on a small thread pool, caching by the grammar's text; the frontend awaits it to refuse a
bad schema with a 400 before anything is queued. ``GuidanceManager`` is the scheduler's
``StructuredOutputManager``: it holds one matcher per constrained request, fills the step's packed
allowed-token bitmask and advances the matchers by the sampled tokens.
"""

from pagedserve.engine.structured_output.compiler import GrammarCompiler
from pagedserve.engine.structured_output.manager import GuidanceManager

__all__ = ["GrammarCompiler", "GuidanceManager"]
