"""Reasoning parsers: a thinking model's `<think>...</think>` apart from its answer, as vLLM's
`--reasoning-parser` splits it ("qwen3" for Qwen3 / Qwen3.5, "deepseek_r1" for DeepSeek-R1; the two
write the same tags).

The answer starts inside the reasoning when the prompt ends with a `<think>` (the generation prompt of
templates that open it for the model), or when the model writes `<think>` first; a prompt that ends
with `</think>` (Qwen3's `enable_thinking=False`) leaves the answer all content. Only the prompt's end,
which the template appended after the last message, is read: tags in the user's text never open or
close the reasoning. Everything up to `</think>` is reasoning, everything after it content. While a
request runs, a trailing piece that may still become a tag is held back, so the reasoning and the
content each only grow as tokens arrive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the answer has no reasoning part
    content: str


def prompt_opens_reasoning(prompt: str | None) -> bool:
    """Whether the prompt ends with a `<think>` (whitespace aside) that the model's answer continues."""
    return _ending_tag(prompt) == START


def prompt_closes_reasoning(prompt: str | None) -> bool:
    """Whether the prompt ends with a `</think>` (whitespace aside; Qwen3's enable_thinking=False): the
    answer has no reasoning, so a grammar applies from its first token."""
    return _ending_tag(prompt) == END


def _ending_tag(prompt: str | None) -> str | None:
    # Only the very end: a tag before it is in a message (the user's text, an earlier turn's reasoning).
    text = (prompt or "").rstrip()
    return next((tag for tag in (START, END) if text.endswith(tag)), None)


def opening_token(tokenizer: Any) -> int | None:
    """The token that alone writes `<think>` (as Qwen3's and DeepSeek-R1's tokenizers have), if any."""
    ids = tokenizer.encode(START, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def split_reasoning(text: str, opened: bool, final: bool) -> ReasoningSplit:
    """`text` (the whole generated text so far) as reasoning and content; `final`: the request ended,
    so nothing is held back."""
    if not opened:
        if text.startswith(START):
            opened, text = True, text[len(START):]
        elif not final and START.startswith(text):  # "<th": may still become the opening tag
            return ReasoningSplit(None, "")
        else:
            return ReasoningSplit(None, text)
    end = text.find(END)
    if end >= 0:
        return ReasoningSplit(text[:end], text[end + len(END):])
    if final:
        return ReasoningSplit(text, "")
    return ReasoningSplit(text[: len(text) - _partial_tag(text, END)], "")


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0 if none)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ReasoningGate:
    """A request's grammar that applies only after its reasoning (vLLM's rule for structured output
    with a reasoning parser): while `waiting`, every token is allowed and none reaches the matcher; the
    first token after the one that completes `</think>` is the grammar's first. It stands in for the
    llguidance matcher (is_error / is_stopped / consume_token), so the step loop and the mask filler
    need nothing else. Text that the closing tag's own token carries after `</think>` is not checked.

    `for_prompt` makes the gate of a prompt: waiting when it opened the reasoning, ruling from the first
    token when it closed it, and otherwise ruling from the first token too, except that the model may
    begin with the `<think>` token (`opening_token`, allowed besides the grammar's tokens) and so open
    its reasoning, as the split reads the answer."""

    def __init__(self, matcher: Any, waiting: bool, opening_token: int | None = None) -> None:
        self.matcher = matcher
        self.waiting = waiting
        self.opening_token = opening_token  # allowed as the first token (then the gate waits); None after it

    @classmethod
    def for_prompt(cls, matcher: Any, prompt: str | None, opening_token: int | None) -> ReasoningGate:
        if prompt_opens_reasoning(prompt):
            return cls(matcher, waiting=True)
        return cls(matcher, waiting=False, opening_token=None if prompt_closes_reasoning(prompt) else opening_token)

    def is_error(self) -> bool:
        return not self.waiting and self.matcher.is_error()

    def is_stopped(self) -> bool:
        return not self.waiting and self.matcher.is_stopped()

    def consume_token(self, token: int) -> None:
        opening, self.opening_token = self.opening_token, None
        if token == opening:
            self.waiting = True  # the model opened its reasoning
        elif not self.waiting:
            self.matcher.consume_token(token)

    def see(self, text: str) -> None:
        """The request's whole generated text, after each token."""
        if self.waiting and END in text:
            self.waiting = False
