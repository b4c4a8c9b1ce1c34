"""`/tokenize`, `/detokenize` and `/version`, in vLLM's request and response shapes: clients count and
budget prompts with them. A chat's count equals the `usage.prompt_tokens` the same chat request gets."""

from __future__ import annotations

from typing import Any, Protocol

from mmengine import __version__
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_errors import APIError, from_engine_error
from mmengine.entrypoints.logprobs_format import token_text
from mmengine.entrypoints.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from mmengine.errors import MMEngineError
from mmengine.sample.params import SamplingParams


class Server(Protocol):
    """What these routes use of the OpenAI server (api_server.py)."""

    engine: AsyncMMEngine

    def adapter_for(self, model: str) -> str | None: ...

    async def chat_prompt(self, body: ChatCompletionRequest) -> tuple[str | dict[str, Any], list[Any] | None]: ...

    def token_bytes(self, token: int) -> bytes: ...


def version() -> dict[str, str]:
    return {"version": __version__}


async def tokenize(server: Server, body: TokenizeRequest) -> dict[str, Any]:
    if body.model is not None:
        server.adapter_for(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt", code="invalid_value")
    engine = server.engine.engine
    param = "messages" if body.messages is not None else "prompt"
    if body.messages is not None:
        prompt, images = await server.chat_prompt(ChatCompletionRequest(model=body.model or "", messages=body.messages))
    else:
        prompt, images = body.prompt, None
    pictures = bool(images) or isinstance(prompt, dict)
    if pictures and not body.add_special_tokens:
        raise APIError(400, "add_special_tokens=false is not supported for a prompt with pictures or videos",
                       param="add_special_tokens", code="unsupported_parameter")
    try:
        if pictures:  # the engine's own intake: the placeholder runs expanded as a request's are
            def count() -> list[int]:
                checked = engine.intake.check(prompt, images, SamplingParams(max_tokens=1))
                return engine.intake.prepare(checked).processed.prompt_token_ids

            tokens = await server.engine.run_in_pool(count)
        else:
            tokens = list(engine.tokenizer(prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
    except MMEngineError as err:
        raise from_engine_error(err, input_param=param) from err
    strings = [token_text(server.token_bytes(t)) for t in tokens] if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens, "token_strs": strings}


def detokenize(server: Server, body: DetokenizeRequest) -> dict[str, Any]:
    if body.model is not None:
        server.adapter_for(body.model)
    engine = server.engine.engine
    vocab = len(engine.tokenizer)
    outside = [t for t in body.tokens if not 0 <= t < vocab]
    if outside:
        raise APIError(400, f"tokens holds {outside[0]}, outside the vocabulary of {vocab}", param="tokens", code="invalid_value")
    return {"prompt": engine.tokenizer.decode(body.tokens)}
