"""Each token's bytes, for logprobs' token texts: the exact bytes of the tokenizer's piece (a byte-level
token may hold part of a character), read through the grammar engine's reading of the vocabulary when
it can read this tokenizer, else what the tokenizer decodes the token to alone (e.g. WordPiece, which
llguidance does not read). Logprobs never need the grammar engine to work."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mmengine.errors import UnsupportedModelError
from mmengine.sample.structured_output.grammar import GrammarCompiler


def token_bytes_reader(tokenizer: Any, grammars: GrammarCompiler) -> Callable[[int], bytes]:
    try:
        exact = grammars.tokenizer
    except UnsupportedModelError:
        return lambda token: tokenizer.decode([token], skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False).encode("utf-8")
    return lambda token: exact.decode_bytes([token])
