"""Structured output: a request's tokens constrained by a grammar (JSON schema, regex, choice, Lark).

params.py   StructuredOutputParams: what SamplingParams(structured_output=...) takes (plain data)
grammar.py  GrammarCompiler: specs -> llguidance grammars, validated once per spec and cached; matchers
masks.py    the next step's allowed-token bitmasks filled on the host, applied to logits on the device
"""

from mmengine.sample.structured_output.params import StructuredOutputParams

__all__ = ["StructuredOutputParams"]
