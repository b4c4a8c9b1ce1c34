"""The OpenAI-compatible server: a FastAPI app over one AsyncMMEngine.

    POST /v1/chat/completions   messages with text and image_url parts (data: URLs, allowed file:// paths)
    POST /v1/completions        a prompt: a string, token ids, or a list of either (one choice per prompt)
    GET  /v1/models, /health, /metrics
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   with --enable-lora-runtime-updates

A request's `model` is the served model's name (the base model) or a LoRA adapter's name.

Streaming answers are server-sent events in OpenAI's chunk format, ending with `data: [DONE]`.
A client that goes away (mid-stream or while waiting for a whole answer) aborts its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from mmengine.engine.async_engine import AsyncMMEngine, DeltaOutput, RequestStream
from mmengine.entrypoints.api_errors import APIError, from_engine_error, install_error_handlers
from mmengine.entrypoints.chat import AudioPart, ChatTemplate, EmbedsPart, VideoPart, parse_messages
from mmengine.entrypoints.completion_echo import Echo, prompt_only
from mmengine.entrypoints.embeds_payload import decode_embeds_payload
from mmengine.entrypoints.media import fetch_remote_image, is_remote, load_input_audio, load_local_image_url
from mmengine.entrypoints.metrics import ServerMetrics
from mmengine.entrypoints.logprobs_format import LogprobsFormatter, cumulative_logprob, prompt_logprobs_json
from mmengine.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRARequest,
    TokenizeRequest,
    UnloadLoRARequest,
)
from mmengine.entrypoints.responses import ResponseWriter, new_id, summed_usage
from mmengine.entrypoints.responses_api import ResponsesRequest, create_response
from mmengine.entrypoints.tokenize import detokenize, tokenize, version
from mmengine.entrypoints.server_settings import ServerSettings
from mmengine.entrypoints.tools import ToolCallStream, parse_tool_calls
from mmengine.outputs import TokenLogprobs
from mmengine.errors import (
    AdapterError,
    AdapterInUseError,
    ChatTemplateOptionError,
    ConfigError,
    InvalidInputError,
    MMEngineError,
    UnsupportedModelError,
)
from mmengine.engine.beam_search import BeamSearchParams
from mmengine.engine.prompt_inputs import TemplateOptions
from mmengine.lora.request import LoRARequest
from mmengine.sample.token_bytes import token_bytes_reader
from mmengine.utils.collector_pace import pace_collector_for_serving
from mmengine.utils.heap import freeze_startup_heap

logger = logging.getLogger(__name__)

_DONE = "data: [DONE]\n\n"


def build_app(async_engine: AsyncMMEngine, settings: ServerSettings) -> FastAPI:
    """The app serving `async_engine`; the engine is shut down with the app."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await async_engine.shutdown()

    app = FastAPI(title="mmengine", description="OpenAI-compatible multimodal server", lifespan=lifespan)
    server = _OpenAIServer(async_engine, settings)
    install_error_handlers(app, on_error=lambda status: server.metrics.errors.labels(str(status)).inc())
    app.state.server = server
    # without a key FastAPI would still solve the dependency (a coroutine and its bookkeeping) on every request
    auth = [Depends(server.check_api_key)] if settings.api_key is not None else []

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.generate("chat", body, request)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.generate("completion", body, request)

    @app.post("/v1/responses", dependencies=auth)
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        tokenizer = async_engine.engine.tokenizer
        return await create_response(body, lambda chat: server.generate("chat", chat, request),
                                     lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"]))

    @app.get("/v1/models", dependencies=auth)
    async def models() -> dict[str, Any]:
        return server.models()

    if settings.lora_runtime_updates:

        @app.post("/v1/load_lora_adapter", dependencies=auth)
        async def load_lora_adapter(body: LoadLoRARequest) -> Response:
            return await server.load_lora(body)

        @app.post("/v1/unload_lora_adapter", dependencies=auth)
        async def unload_lora_adapter(body: UnloadLoRARequest) -> Response:
            return await server.unload_lora(body)

    @app.post("/tokenize", dependencies=auth)
    async def tokenize_route(body: TokenizeRequest) -> dict[str, Any]:
        return await tokenize(server, body)

    @app.post("/detokenize", dependencies=auth)
    async def detokenize_route(body: DetokenizeRequest) -> dict[str, Any]:
        return detokenize(server, body)

    @app.get("/version")
    async def version_route() -> dict[str, str]:
        return version()

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_healthy:
            # the step loop's own failure, else the engine's (an engine-core process or a tensor-parallel rank that died)
            error = async_engine.dead_error or getattr(async_engine.engine, "dead_error", None)
            reason = repr(error) if error is not None else "shut down"
            raise APIError(503, f"the engine loop is not running: {reason}", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    def metrics() -> Response:  # a plain def: FastAPI runs it on a thread, so waiting for stats() blocks no one
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


class _OpenAIServer:
    def __init__(self, async_engine: AsyncMMEngine, settings: ServerSettings) -> None:
        self.engine = async_engine
        self.settings = settings
        self.metrics = ServerMetrics(async_engine)
        self.template = ChatTemplate(async_engine.engine, settings.chat_template)
        self.created = int(time.time())
        self._logprobs_formatter: LogprobsFormatter | None = None
        self._read_token_bytes: Callable[[int], bytes] | None = None
        for name, path in settings.lora_modules.items():
            self._check_adapter_name(name)
            async_engine.engine.add_lora(LoRARequest(name, path))

    async def check_api_key(self, request: Request) -> None:
        # async: FastAPI runs a plain-def dependency on its thread pool, a thread hop per request for a compare
        expected = self.settings.api_key
        if expected is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
            raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")

    def models(self) -> dict[str, Any]:
        base = self.settings.served_model_name
        engine = self.engine.engine
        card = {"id": base, "object": "model", "created": self.created, "owned_by": "mmengine", "root": engine.config.model,
                "parent": None, "max_model_len": engine.max_model_len}
        adapters = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "mmengine",
             "root": str(engine.loras.registered[name].path), "parent": base, "max_model_len": engine.max_model_len}
            for name in engine.list_loras()
        ]
        return {"object": "list", "data": [card, *adapters]}

    def adapter_for(self, model: str) -> str | None:
        """The LoRA adapter a request's `model` selects (None: the base model); 404 for any other name."""
        if model == self.settings.served_model_name:
            return None
        if model in self.engine.engine.list_loras():
            return model
        raise APIError(404, f"the model {model!r} does not exist: this server serves {self.settings.served_model_name!r}"
                       + "".join(f", {name!r}" for name in self.engine.engine.list_loras()), param="model", code="model_not_found")

    def _check_adapter_name(self, name: str) -> None:
        if not name or name == self.settings.served_model_name:
            raise APIError(400, f"an adapter cannot be named {name!r} (the served model's name)", param="lora_name",
                           code="invalid_value")

    async def load_lora(self, body: LoadLoRARequest) -> Response:
        self._check_adapter_name(body.lora_name)
        if body.lora_name in self.engine.engine.list_loras():
            raise APIError(400, f"an adapter named {body.lora_name!r} is already loaded: unload it first", param="lora_name",
                           code="invalid_value")
        try:  # reads and checks the files: off the event loop
            await self.engine.run_in_pool(lambda: self.engine.engine.add_lora(LoRARequest(body.lora_name, body.lora_path)))
        except (AdapterError, ConfigError) as err:
            raise APIError(400, str(err), param="lora_path", code="invalid_adapter") from err
        return JSONResponse({"status": "ok", "message": f"adapter {body.lora_name!r} loaded"})

    async def unload_lora(self, body: UnloadLoRARequest) -> Response:
        try:
            removed = self.engine.engine.remove_lora(body.lora_name)
        except AdapterInUseError as err:
            raise APIError(409, str(err), param="lora_name", code="adapter_in_use") from err
        except ConfigError as err:
            raise APIError(400, str(err), param="lora_name", code="invalid_value") from err
        if not removed:
            raise APIError(404, f"no adapter named {body.lora_name!r} is loaded", param="lora_name", code="model_not_found")
        return JSONResponse({"status": "ok", "message": f"adapter {body.lora_name!r} unloaded"})

    async def generate(self, kind: str, body: ChatCompletionRequest | CompletionRequest, request: Request) -> Response:
        """A chat, or a completion of one or several prompts: n choices per prompt (the best n of
        best_of samples), indexed prompt by prompt."""
        arrival = time.monotonic()
        lora = self.adapter_for(body.model)
        body.check_supported(self.settings.max_n)
        params, fill_max_tokens = body.sampling_params()
        chat = kind == "chat"
        request_id = new_id("chatcmpl" if chat else "cmpl")
        input_param = "messages" if chat else "prompt"
        if body.use_beam_search:
            return await self._beam_search(kind, body, request_id, params, lora)
        await self._compile_grammar(body, params)
        samples = body.num_samples if isinstance(body, CompletionRequest) else body.n
        streams: list[RequestStream] = []
        inputs: list[tuple[Any, Any]] = []
        try:
            self.engine.check_not_overloaded()  # before decoding anything
            if chat and samples == 1:  # one pool job renders, decodes, checks, preprocesses and queues it
                inputs = [(None, None)]
                streams.append(await self.engine.add_request_from(
                    await self.chat_prompt_maker(body), params, request_id=request_id, cache_salt=body.cache_salt,
                    mm_uuids=body.mm_uuids, fill_max_tokens=fill_max_tokens, lora=lora, whole_answer=not body.stream,
                ))
            else:
                inputs = [await self.chat_prompt(body)] if chat else [(prompt, None) for prompt in body.prompts()]
                for index, (prompt, images) in enumerate(inputs):
                    # The samples of a prompt queue one after another: the first prefills the prompt and
                    # the others wait for its blocks (the scheduler's wait for in-flight blocks), so the
                    # prompt is computed once; each sample has its own seed stream (seed + j).
                    for j in range(samples):
                        sample_params = params if j == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + j)
                        single = len(inputs) == 1 and samples == 1
                        streams.append(await self.engine.add_request(
                            prompt, images, sample_params, request_id=request_id if single else f"{request_id}-{index}-{j}",
                            cache_salt=body.cache_salt, mm_uuids=body.mm_uuids if chat else None,
                            fill_max_tokens=fill_max_tokens, lora=lora, whole_answer=not body.stream,
                        ))
        except BaseException as err:  # refused or cancelled: the prompts already queued are aborted
            for stream in streams:
                stream.abort()
            if not isinstance(err, MMEngineError):
                raise
            answer = from_engine_error(err, input_param=input_param)
            if len(inputs) > 1 and isinstance(err, InvalidInputError):  # name the prompt of the list at fault
                answer.message = f"prompt {len(streams) // samples}: {answer.message}"
            raise answer from err
        writers = [ResponseWriter(kind, request_id, body.model, index) for index in range(len(streams))]
        deltas = [self.metrics.timed(aiter(stream), arrival, "chat" if chat else "completions") for stream in streams]
        tools = chat and bool(body.tools) and body.tool_mode()[0] != "none"
        shape = _Choices(len(inputs), samples, body.n, self._logprobs_shown(body), tools,
                         reasoning=self.engine.engine.config.model_config.reasoning_parser is not None)
        if body.prompt_logprobs is not None:
            shape.prompt_logprobs = lambda entries: prompt_logprobs_json(entries, self.token_bytes, body.prompt_logprobs)
        if not chat and body.echo:  # each choice starts with its prompt (completion_echo.py)
            shape.echo = Echo.of([prompt for prompt, _ in inputs], self.engine.engine.tokenizer.decode)
            if body.echo_only:
                deltas = [prompt_only(d) for d in deltas]

        def abort_all() -> None:
            for stream in streams:
                stream.abort()

        async def abort_all_after() -> None:  # async: a plain-def background task would take a thread-pool trip
            abort_all()

        if body.stream:
            events = self._events(writers, deltas, streams, body.include_usage, shape)
            return StreamingResponse(events, media_type="text/event-stream", background=BackgroundTask(abort_all_after))
        answer = asyncio.ensure_future(self._wholes(writers, deltas, shape))
        try:
            if not await _finished_before_disconnect(request, answer):
                self.metrics.client_disconnects.inc()
                return Response(status_code=499)  # nobody reads it
            return JSONResponse(answer.result())
        except MMEngineError as err:
            raise from_engine_error(err, input_param=input_param) from err
        finally:
            abort_all()

    async def _compile_grammar(self, body: Any, params: Any) -> None:
        """A structured-output spec compiles (or is found in the cache) before anything is queued;
        a spec llguidance rejects is a 400 naming the field that gave it."""
        spec = params.structured_output
        if spec is None:
            return
        _, field_name = body.structured_output()
        # a forced tool call's grammar is ours: its parts are compiled first, so an error names the
        # client's schema at fault and never shows the grammar around it
        for part, param, what in [*body.grammar_checks(), (spec, field_name, field_name)]:
            try:
                await self.engine.run_in_pool(self.engine.engine.grammars.compile, part)
            except ConfigError as err:
                if part is spec and field_name == "tool_choice":
                    message = "tool_choice: the tool-call grammar over these tools cannot be built"
                elif param.startswith("tools["):  # "tools[0].function.parameters ('name') cannot be used: ..."
                    message = str(err).replace(f"SamplingParams.structured_output {part.kind}", what)
                else:
                    message = str(err).replace("SamplingParams.structured_output", what)
                raise APIError(400, message, param=param, code="invalid_value") from err
            except UnsupportedModelError as err:  # the grammar engine cannot read this model's tokenizer
                raise APIError(400, f"{field_name} needs structured output, which this model cannot use: {err}",
                               param=field_name, code="unsupported_model") from err

    def _logprobs_shown(self, body: Any) -> _LogprobsShown | None:
        """How the answer shows logprobs (None: it does not)."""
        if isinstance(body, ChatCompletionRequest):
            if not body.logprobs:
                return None
            return _LogprobsShown(chat=True, top=body.top_logprobs or 0, formatter=self._formatter())
        if body.logprobs is None:
            return None
        return _LogprobsShown(chat=False, top=body.logprobs, formatter=self._formatter())

    def _formatter(self) -> LogprobsFormatter:
        if self._logprobs_formatter is None:
            self._logprobs_formatter = LogprobsFormatter(self.token_bytes)
        return self._logprobs_formatter

    def token_bytes(self, token: int) -> bytes:
        """The tokenizer's own bytes of a token (sample/token_bytes.py; the reader is made once)."""
        if self._read_token_bytes is None:
            engine = self.engine.engine
            self._read_token_bytes = token_bytes_reader(engine.tokenizer, engine.grammars)
        return self._read_token_bytes(token)

    async def _beam_search(self, kind: str, body: Any, request_id: str, params: Any, lora: str | None) -> Response:
        """use_beam_search: width n, n choices per prompt (best first), answered whole."""
        chat = kind == "chat"
        if lora is not None:
            raise APIError(400, "use_beam_search does not run under a LoRA adapter yet", param="model", code="unsupported_parameter")
        try:
            beam = BeamSearchParams(beam_width=body.n, max_tokens=params.max_tokens, length_penalty=body.length_penalty,
                                    ignore_eos=body.ignore_eos)
        except ConfigError as err:
            raise APIError(400, str(err), param="length_penalty", code="invalid_value") from err
        try:
            if chat:
                prompt, images = await self.chat_prompt(body)
                prompts, pictures = [prompt], [images]
            else:
                prompts, pictures = body.prompts(), None
            results = await self.engine.run_in_pool(lambda: self.engine.engine.beam_search(prompts, beam, images=pictures))
        except MMEngineError as err:
            raise from_engine_error(err, input_param="messages" if chat else "prompt") from err
        choices, completion_tokens = [], 0
        for result in results:
            for seq in result.sequences:
                finish = "stop" if seq.token_ids and seq.token_ids[-1] in self.engine.engine.eos_token_ids and not body.ignore_eos else "length"
                choice = {"index": len(choices), "finish_reason": finish, "logprobs": None, "stop_reason": None}
                choice |= {"message": {"role": "assistant", "content": seq.text}} if chat else {"text": seq.text}
                choices.append(choice)
                completion_tokens += len(seq.token_ids)
        prompt_tokens = sum(len(result.prompt_token_ids) for result in results)
        return JSONResponse({"id": request_id, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": body.model, "choices": choices,
                             "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                       "total_tokens": prompt_tokens + completion_tokens,
                                       "prompt_tokens_details": {"cached_tokens": 0}}})

    async def chat_prompt(self, body: ChatCompletionRequest) -> tuple[str | dict[str, Any], list[Any] | None]:
        """The rendered prompt and its pictures; a prompt with videos or audio clips is a prompt dict
        carrying them all (multi_modal_data), as MMEngine takes it."""
        return await self.engine.run_in_pool(await self.chat_prompt_maker(body))

    async def chat_prompt_maker(self, body: ChatCompletionRequest) -> Callable[[], tuple[str | dict[str, Any], list[Any] | None]]:
        """chat_prompt()'s work on the event loop (parsing, remote media, the template's options: their errors
        raise here), and a function that does the rest off it: renders the template and decodes the media."""
        conversation, sources = parse_messages(body.messages, self.settings.enable_mm_embeds)
        policy = self.settings.media
        pictures = [s for s in sources if not isinstance(s, (VideoPart, AudioPart))]
        videos = [s.url for s in sources if isinstance(s, VideoPart)]
        audios = [s for s in sources if isinstance(s, AudioPart)]
        remote = {i: await fetch_remote_image(src, i, policy) for i, src in enumerate(pictures) if isinstance(src, str) and is_remote(src)}
        remote_videos = {i: await fetch_remote_image(url, i, policy, "video") for i, url in enumerate(videos) if is_remote(url)}

        def image(i: int, source: str | EmbedsPart) -> Any:
            if isinstance(source, EmbedsPart):
                return decode_embeds_payload(source.payload, i)
            return remote[i] if i in remote else load_local_image_url(source, i, policy)

        def video(i: int, url: str) -> Any:
            return remote_videos[i] if i in remote_videos else load_local_image_url(url, i, policy, "video")

        tools = None
        if body.tools and body.tool_mode()[0] != "none":  # "none": the model is not offered them
            if not self.template.renders_tools:
                raise APIError(400, "this model's chat template does not render tools, so they cannot be offered: start "
                               "the server with a --chat-template that does", param="tools", code="unsupported_parameter")
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
        if body.chat_template is not None and not self.settings.trust_request_chat_template:
            raise APIError(400, "this server does not render a request's own chat_template: it uses its own (start it with "
                           "--trust-request-chat-template to allow them)", param="chat_template", code="unsupported_parameter")
        try:
            options = TemplateOptions(body.chat_template, body.chat_template_kwargs or {}, body.add_generation_prompt,
                                      body.continue_final_message, tools)
        except ChatTemplateOptionError as err:
            raise APIError(400, err.reason, param=err.field, code="invalid_value") from err

        def prepare() -> tuple[str | dict[str, Any], list[Any] | None]:  # base64 decoding and the template, off the event loop
            prompt, images = self.template.render(conversation, options), [image(i, source) for i, source in enumerate(pictures)]
            if not videos and not audios:
                return prompt, images
            clips = [video(i, url) for i, url in enumerate(videos)]
            sounds = [load_input_audio(part.data, part.format, i, policy) for i, part in enumerate(audios)]
            return {"prompt": prompt, "multi_modal_data": {"image": images, "video": clips, "audio": sounds}}, None

        return prepare

    @staticmethod
    async def _wholes(writers: list[ResponseWriter], deltas: list[AsyncIterator[DeltaOutput]], shape: _Choices) -> dict[str, Any]:
        """The whole answer: n choices per prompt (the best n by cumulative log-probability when
        best_of > n), usage over every sample drawn."""

        async def whole(deltas: AsyncIterator[DeltaOutput]) -> tuple[str, DeltaOutput, list[TokenLogprobs], str]:
            parts, last, logprobs, reasoning = [], None, [], []
            async for delta in deltas:
                parts.append(delta.text)
                reasoning.append(delta.reasoning_text)
                logprobs += delta.logprobs or []
                last = delta
            return "".join(parts), last, logprobs, "".join(reasoning)

        # (gather wraps each coroutine in a task: a request with one choice awaits its own)
        answers = [await whole(deltas[0])] if len(deltas) == 1 else await asyncio.gather(*(whole(d) for d in deltas))
        choices = []
        for prompt in range(shape.num_prompts):
            drawn = list(range(prompt * shape.samples, (prompt + 1) * shape.samples))
            if shape.samples > shape.n:
                drawn = sorted(drawn, key=lambda i: cumulative_logprob(answers[i][2]), reverse=True)[: shape.n]
            for i in drawn:
                text, last, logprobs, reasoning = answers[i]
                if shape.echo is not None:
                    shown = None if shape.shown is None else shape.shown.formatter.echoed_completion(
                        last.prompt_token_ids, last.prompt_logprobs or [None], logprobs, shape.shown.top)
                    choice = writers[i].choice(shape.echo.texts[prompt] + text, last, shown)
                else:
                    choice = writers[i].choice(text, last, shape.shown.format(logprobs, 0) if shape.shown else None)
                if shape.reasoning and writers[i].chat:
                    choice["message"]["reasoning_content"] = reasoning or None
                if shape.tools:
                    parsed = parse_tool_calls(text)
                    choice["message"] = {**choice["message"], "content": parsed.content, "tool_calls": parsed.tool_calls}
                    if parsed.tool_calls and last.finish_reason == "stop":
                        choice["finish_reason"] = "tool_calls"
                if shape.prompt_logprobs is not None and not writers[i].chat:  # completions: per choice, as vLLM
                    choice["prompt_logprobs"] = shape.prompt_logprobs(last.prompt_logprobs or [])
                choices.append({**choice, "index": len(choices)})
        body = writers[0].complete(choices, summed_usage([last for _, last, _, _ in answers], shape.samples))
        if shape.prompt_logprobs is not None and writers[0].chat:  # chat: once, beside the choices, as vLLM
            body["prompt_logprobs"] = shape.prompt_logprobs(answers[0][1].prompt_logprobs or [])
        return body

    async def _events(
        self, writers: list[ResponseWriter], deltas: list[AsyncIterator[DeltaOutput]], streams: list[RequestStream],
        include_usage: bool, shape: _Choices,
    ) -> AsyncIterator[str]:
        """The chunks of every choice, as they come (each carries its index); then the usage and [DONE]."""
        chat = writers[0].chat
        try:
            if chat:
                yield _event(writers[0].chunk("", role=True, with_usage_field=include_usage))
            lasts: list[DeltaOutput | None] = [None] * len(writers)
            sent_chars = [0] * len(writers)
            echoed = [shape.echo is None] * len(writers)  # echo: whether the choice's prompt has been sent
            calls = [ToolCallStream() for _ in writers] if shape.tools else None
            async for index, delta in _merged(deltas):  # one chunk per delta: new tokens (text may be held back) or the end
                lasts[index] = delta
                logprobs = shape.shown.format(delta.logprobs or [], sent_chars[index]) if shape.shown else None
                sent_chars[index] += len(delta.text)
                text, finish, made = delta.text, delta.finish_reason, []
                if not echoed[index]:  # the prompt leads the choice's first chunk
                    text, echoed[index] = shape.echo.texts[index // shape.samples] + text, True
                if calls is not None:
                    text, made = calls[index].feed(delta.text, final=delta.finished)
                    if finish == "stop" and calls[index].num_calls:
                        finish = "tool_calls"
                yield _event(writers[index].chunk(text, finish, stop_reason=delta.stop_reason,
                                                  with_usage_field=include_usage, logprobs=logprobs, tool_calls=made,
                                                  reasoning=delta.reasoning_text))
            if include_usage and all(last is not None for last in lasts):
                yield _event(writers[0].usage_chunk(summed_usage(lasts, shape.samples)))
            yield _DONE
        except MMEngineError as err:  # a request failed in the engine after the stream began
            yield _event(from_engine_error(err, input_param="messages" if chat else "prompt").body())
            yield _DONE
        finally:
            if not all(stream.finished for stream in streams):  # the client went away (or the server is stopping)
                self.metrics.client_disconnects.inc()
            for stream in streams:
                stream.abort()


@dataclass
class _LogprobsShown:
    chat: bool
    top: int
    formatter: LogprobsFormatter

    def format(self, entries: list[TokenLogprobs], text_offset: int) -> dict[str, Any]:
        if self.chat:
            return self.formatter.chat(entries, self.top)
        return self.formatter.completion(entries, self.top, text_offset)


@dataclass
class _Choices:
    num_prompts: int
    samples: int  # drawn per prompt (best_of, else n)
    n: int  # answered per prompt
    shown: _LogprobsShown | None
    tools: bool = False  # the answers' <tool_call> blocks become tool_calls
    prompt_logprobs: Callable[[list[Any]], list[Any]] | None = None  # formats them, when asked for
    echo: Echo | None = None  # completions' echo: the prompts that lead their choices
    reasoning: bool = False  # a reasoning parser splits the answers: chat messages carry reasoning_content


async def _merged(iterators: list[AsyncIterator[DeltaOutput]]) -> AsyncIterator[tuple[int, DeltaOutput]]:
    """(index, item) from several async iterators as each yields; an iterator's exception is raised here."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, iterator: AsyncIterator[DeltaOutput]) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item))
            await queue.put((index, done))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, err))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _finished_before_disconnect(request: Request, answer: asyncio.Future) -> bool:
    """Waits for `answer`; if the client disconnects first, cancels it and returns False."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({answer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not answer.done():
            answer.cancel()
    return answer.done() and not answer.cancelled()


DEAD_ENGINE_DRAIN_SECONDS = 2.0  # after the engine dies: answer 503 for this long, then exit (as the multi-process server)


def run_server(async_engine: AsyncMMEngine, settings: ServerSettings, host: str, port: int, log_level: str = "info",
               access_log: bool = True, sock: socket.socket | None = None) -> None:
    """Serves until interrupted (uvicorn handles SIGINT/SIGTERM, exit 0), or until the engine dies for good (a
    tensor-parallel worker or the engine-core process died, the step loop failed): then every request is
    answered 503 for DEAD_ENGINE_DRAIN_SECONDS and the server exits with code 1, so a supervisor restarts it.
    `access_log=False`: no line per request from uvicorn (formatted and written on the event loop). `sock`: a socket
    already listening on host:port (serve binds it before the model loads: entrypoints/listening_socket.py)."""
    import uvicorn

    if sock is not None:
        port = sock.getsockname()[1]
    logger.info("serving %s as %r on http://%s:%d", async_engine.engine.config.model, settings.served_model_name, host, port)
    config = uvicorn.Config(build_app(async_engine, settings), host=host, port=port, log_level=log_level,
                            access_log=access_log)
    freeze_startup_heap()
    pace_collector_for_serving()
    server = uvicorn.Server(config)
    with signals_stop(server):
        died = run_on_uvicorns_loop(config, serve_until_engine_dies(server, async_engine,
                                                                    sockets=None if sock is None else [sock]))
    if died:
        raise SystemExit(1)


@contextmanager
def signals_stop(server: Any) -> Iterator[None]:
    """SIGINT and SIGTERM ask `server` to stop, as uvicorn's own handlers do while it serves (a second one: at
    once). uvicorn raises a signal it caught again once it has stopped, for the handler it found: with Python's,
    a Ctrl-C ended a clean stop in a KeyboardInterrupt traceback and exit code 1, and a SIGTERM killed the
    process. Here there is nothing left to do by then. (Only the main thread can set handlers.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def ask_to_stop(signum: int, frame: Any) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    previous = {signum: signal.signal(signum, ask_to_stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_on_uvicorns_loop(config: Any, coroutine: Any) -> Any:
    """Runs `coroutine` to its end on the event loop uvicorn would choose (uvloop where installed, as
    `uvicorn.Server.run` does; a plain asyncio.run would take asyncio's own loop, whose Python-level loop
    and transports cost the server's one GIL a tenth of the step loop's time under load)."""
    if sys.version_info < (3, 11):  # (no asyncio.Runner)
        config.setup_event_loop()
        return asyncio.run(coroutine)
    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        return runner.run(coroutine)


async def serve_until_engine_dies(server: Any, async_engine: AsyncMMEngine, poll_seconds: float = 0.2,
                                  sockets: list | None = None) -> int:
    """Runs the uvicorn server (on `sockets`, if given); returns 1 if the engine died (the server stopped after
    draining), else 0."""
    died = False

    async def watch() -> None:
        nonlocal died
        while not server.should_exit:
            await asyncio.sleep(poll_seconds)
            if async_engine.has_died:
                died = True
                logger.error("the engine died (%r): answering 503 for %.0f s, then exiting", async_engine.dead_error
                             or getattr(async_engine.engine, "dead_error", None), DEAD_ENGINE_DRAIN_SECONDS)
                await asyncio.sleep(DEAD_ENGINE_DRAIN_SECONDS)
                server.should_exit = True
                return

    watcher = asyncio.create_task(watch())
    try:
        await server.serve(sockets=sockets)
    finally:
        watcher.cancel()
    return 1 if died else 0
