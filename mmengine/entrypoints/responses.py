"""The JSON this server answers with: whole completions, stream chunks and usage."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mmengine.engine.async_engine import DeltaOutput
from mmengine.utils.ids import random_hex


def new_id(prefix: str) -> str:
    return f"{prefix}-{random_hex()}"


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def summed_usage(lasts: Sequence[DeltaOutput], samples_per_prompt: int = 1) -> dict[str, Any]:
    """Usage over a request's choices: completion tokens of every choice, prompt (and cached) tokens
    once per prompt, as OpenAI counts n > 1 (the lasts come prompt by prompt, `samples_per_prompt` each)."""
    firsts = lasts[::samples_per_prompt]
    return usage(sum(d.num_prompt_tokens for d in firsts), sum(d.num_output_tokens for d in lasts),
                 sum(d.num_cached_tokens for d in firsts))


class ResponseWriter:
    """Builds one choice's response objects: the whole answer, or its stream's chunks."""

    def __init__(self, kind: str, request_id: str, model: str, index: int = 0) -> None:
        self.chat = kind == "chat"
        self.request_id = request_id
        self.model = model
        self.index = index  # the choice's index (prompt by prompt, n choices each)
        self.created = int(time.time())

    def _envelope(self, object_name: str) -> dict[str, Any]:
        return {"id": self.request_id, "object": object_name, "created": self.created, "model": self.model}

    def choice(self, text: str, last: DeltaOutput, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index, "finish_reason": last.finish_reason, "logprobs": logprobs,
                                  "stop_reason": last.stop_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    def complete(self, choices: list[dict[str, Any]], usage_body: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage_body}

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              stop_reason: str | int | None = None, with_usage_field: bool = False,
              logprobs: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None,
              reasoning: str = "") -> dict[str, Any]:
        choice: dict[str, Any] = {"index": self.index, "finish_reason": finish_reason, "logprobs": logprobs}
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        body = {**self._envelope("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        """The final usage chunk."""
        return {**self._envelope("chat.completion.chunk" if self.chat else "text_completion"),
                "choices": [], "usage": usage_body}
