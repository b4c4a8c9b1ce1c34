"""Incremental detokenization of generated tokens, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded in front of the output, so that tokenizers which render a token
# differently at the start of a text (e.g. SentencePiece dropping a leading space) get it right.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text as they arrive, and watches for stop strings.

    Follows vLLM's prefix_offset/read_offset scheme: every step decodes only the few tokens
    since the last emitted character boundary (plus a little context before it) and emits
    the difference. Text ending in U+FFFD is held back, since a later token may complete
    the UTF-8 character that a byte-level token split; `flush` emits it at the end.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._backend = _plain_backend(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        if any(not isinstance(s, str) or not s for s in self._stop):
            raise ValueError(f"stop strings must be non-empty strs, got {self._stop!r}")
        self._ids = self._prompt_context(prompt_token_ids)
        # ids[prefix:read] were decoded last step; ids[read:] are not emitted yet.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # The text is kept as chunks (joined lazily) so appending stays O(len(delta)).
        self._chunks: list[str] = []
        self._length = 0
        self._tail = ""  # the last (longest stop - 1) characters, where a stop string may begin
        self._tail_len = max((len(s) for s in self._stop), default=1) - 1
        self._stopped: str | None = None
        self.num_appended = 0  # tokens given to append(), those after a stop string included

    @property
    def text(self) -> str:
        """The generated text so far (the stop string, once matched, and what follows excluded)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the text, if any."""
        return self._stopped

    def append(self, token_id: int, decode: bool = True) -> str | None:
        """Adds one generated token. Returns the stop string matched, if this token completed one;
        from then on `text` ends just before the stop string (and later tokens are ignored).
        decode=False only queues the token (for a caller that reads no text until the end, with no
        stop strings): the next append() that decodes, or flush(), decodes the queued ones at once."""
        self.num_appended += 1
        if self._stopped is not None:
            return None
        self._ids.append(token_id)
        if not decode:
            if self._stop:
                raise ValueError("stop strings are matched as tokens arrive: append(decode=False) cannot watch for them")
            return None
        return self._emit(self._decode_delta(final=False))

    def flush(self) -> str | None:
        """Emits text held back for an unfinished UTF-8 character (it decodes as U+FFFD, as
        `tokenizer.decode` would). Call once the request ends; returns a stop string it completed."""
        if self._stopped is not None:
            return None
        return self._emit(self._decode_delta(final=True))

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # A prompt ending inside a UTF-8 character would merge with the first output bytes
        # and break the text diff; decode the output on its own instead.
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        # No clean-up of tokenization spaces: it is not stable under appending tokens.
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _decode_delta(self, *, final: bool) -> str:
        """The new text since the last emission; empty while a character is still incomplete."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or (not final and new_text.endswith(_REPLACEMENT_CHAR)):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _emit(self, delta: str) -> str | None:
        """Appends `delta` to the text; truncates it and returns the stop string if one now appears."""
        if not delta:
            return None
        window = self._tail + delta
        window_start = self._length - len(self._tail)
        self._chunks.append(delta)
        self._length += len(delta)
        match = self._find_stop(window, len(self._tail))
        if match is not None:
            start, self._stopped = match
            self._chunks = [self.text[: window_start + start]]
            self._length = len(self._chunks[0])
        elif self._tail_len:
            self._tail = window[-self._tail_len :]
        return self._stopped

    def _find_stop(self, window: str, old_len: int) -> tuple[int, str] | None:
        """The earliest stop string ending after `old_len` in `window` (ties: the shorter, which ends first)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            # Only matches reaching into the new text are new; earlier ones would have stopped us.
            start = window.find(stop, max(0, old_len - len(stop) + 1))
            if start >= 0 and (best is None or (start, len(stop)) < best[:2]):
                best = (start, len(stop), stop)
        return None if best is None else (best[0], best[2])


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust `tokenizers` object behind a fast tokenizer whose decoding adds nothing to it
    (without clean-up, transformers' decode is exactly the backend's), else None. Called twice per
    generated token, the backend alone costs a fraction of the Python wrapper."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if backend is None or type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    return backend
