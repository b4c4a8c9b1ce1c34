"""AsyncMMEngine: MMEngine behind one background step loop, for servers and other asyncio code.

- One thread drives `MMEngine.step()` while there is work; requests join at any time.
- `add_request()` validates and preprocesses the prompt and its images on a worker pool (off the
  event loop and off the step loop), queues it, and returns a RequestStream; iterating the stream
  yields DeltaOutputs: the text and tokens that are new since the previous one.
- A stream left before its end (the consumer breaks, is cancelled, or calls `abort()`) aborts the
  request: its KV blocks and encoder references are freed before the next step.
- Turnaround: a step waits (at most `max_admission_wait_s`) for the requests still being prepared on the pool,
  so that a request that arrived while a step ran is in the next one instead of a later one (a slot left by a
  finished request stands empty for no step while the client's next request is prepared).
- Back-pressure: with `max_queued_requests` set, a request arriving while that many are still
  waiting for their first token is refused with EngineOverloadedError.
- A step that raises is retried (MMEngine.step leaves nothing half-done); if it keeps raising, the
  newest request is failed with RequestFailedError and the loop goes on without it. Any other
  failure of the loop is fatal: `is_healthy` turns False and every stream ends with EngineDeadError.

All methods but `abort()` are called from the one event loop the engine was started on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from mmengine.engine.async_errors import EngineOverloadedError, RequestFailedError
from mmengine.engine.core_client import EngineCoreClient
from mmengine.engine.intake import CheckedRequest
from mmengine.engine.prompt_inputs import check_request_id
from mmengine.errors import ConfigError, EngineDeadError, InvalidInputError
from mmengine.lora.request import LoRARequest
from mmengine.multimodal.image_loading import ImageInput
from mmengine.outputs import RequestOutput, TokenLogprobs
from mmengine.sample.params import SamplingParams
from mmengine.utils.ids import random_hex

if TYPE_CHECKING:  # (imported where one is built: a front end over an engine-core process runs no model)
    from mmengine.engine.mm_engine import MMEngine

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A stream's params until the pool job has checked the request's own (SamplingParams() validates itself: a shared
# one saves the event loop that work per request). Only ever replaced, never changed in place.
_PENDING_PARAMS = SamplingParams()


@dataclass
class DeltaOutput:
    """What a request produced since its previous DeltaOutput, and its running totals."""

    request_id: str
    text: str  # new text (concatenating every delta's text gives the request's whole text)
    token_ids: list[int]  # new tokens
    finish_reason: str | None  # "stop" | "length" | "abort" on the last delta, else None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int  # generated so far
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # the new tokens' (SamplingParams.logprobs), else None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the last delta, with SamplingParams.prompt_logprobs
    prompt_token_ids: list[int] | None = None  # on the last delta: the prompt as the engine ran it
    reasoning_text: str = ""  # new reasoning (EngineConfig.reasoning_parser); `text` is then the answer's

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestStream:
    """One request's outputs as DeltaOutputs. Iterate it once; leaving early aborts the request.

    With stop strings, the last (longest stop string - 1) characters are held back until the
    request ends, since they may turn out to begin a stop string (which is cut from the text); with a
    reasoning parser, so are those of the reasoning.
    """

    def __init__(self, engine: AsyncMMEngine, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = params
        self.num_prompt_tokens = 0  # known once the prompt is processed
        self.finished = False  # its last output (or its error) has arrived
        self.aborted = False  # left before it finished
        self.started = False  # its first token has arrived
        self.cancelled = False  # aborted by its consumer (the worker that queues it checks this)
        self.added = False  # queued in the engine
        # False: the consumer wants the whole answer (a non-streamed one) and is woken for the first token and the
        # end only; the outputs between stay queued and come as one delta with the end (outputs are cumulative)
        self.wakes_per_output = True
        self._woken_for_token = False
        self._engine = engine
        self.set_params(params)
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self._iterated = False
        self._sent_chars = 0
        self._sent_reasoning_chars = 0
        self._sent_tokens = 0

    def set_params(self, params: SamplingParams) -> None:
        self.sampling_params = params
        self._holdback = max((len(s) for s in params.stop), default=1) - 1

    def __aiter__(self) -> AsyncIterator[DeltaOutput]:
        if self._iterated:
            raise RuntimeError(f"the stream of request {self.request_id!r} can be iterated only once")
        self._iterated = True
        return self._deltas()

    def abort(self) -> None:
        """Stops the request and frees what it holds (no-op once it has finished)."""
        if not self.finished and not self.aborted:
            self.aborted = True
            self._engine.abort(self.request_id)

    async def _deltas(self) -> AsyncIterator[DeltaOutput]:
        try:
            while True:
                item = await self._next_item()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                delta = self._delta(item)
                if delta is not None:
                    yield delta
                if item.finished:
                    return
        finally:
            self.abort()

    def _put(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        self._items.append(item)
        if isinstance(item, RequestOutput) and not item.finished and not self.wakes_per_output:
            if self._woken_for_token or not item.token_ids:
                return
            self._woken_for_token = True
        self._ready.set()

    async def _next_item(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        # Outputs are cumulative: when the consumer fell behind, the latest one carries everything.
        while isinstance(item, RequestOutput) and self._items and isinstance(self._items[0], RequestOutput):
            item = self._items.popleft()
        return item

    def _delta(self, output: RequestOutput) -> DeltaOutput | None:
        text = output.text
        end = len(text) if output.finished else max(self._sent_chars, len(text) - self._holdback)
        new_text = text[self._sent_chars : end]
        self._sent_chars += len(new_text)
        reasoning = output.reasoning_content or ""
        # A stop string may begin in the reasoning and run on past it: its tail is held back too, as far as
        # the text after it is shorter than the holdback.
        held = 0 if output.finished else max(0, self._holdback - len(text))
        new_reasoning = reasoning[self._sent_reasoning_chars : max(self._sent_reasoning_chars, len(reasoning) - held)]
        self._sent_reasoning_chars += len(new_reasoning)
        new_tokens = output.token_ids[self._sent_tokens :]
        logprobs = output.logprobs[self._sent_tokens :] if output.logprobs is not None else None
        self._sent_tokens = len(output.token_ids)
        if output.finished:
            self.finished = True
        elif not new_tokens and not new_text and not new_reasoning:
            return None
        return DeltaOutput(
            request_id=output.request_id,
            text=new_text,
            token_ids=new_tokens,
            finish_reason=output.finish_reason,
            stop_reason=output.stop_reason,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_output_tokens=len(output.token_ids),
            num_cached_tokens=output.num_cached_tokens,
            logprobs=logprobs,
            prompt_logprobs=output.prompt_logprobs if output.finished else None,
            prompt_token_ids=output.prompt_token_ids if output.finished else None,
            reasoning_text=new_reasoning,
        )


class AsyncMMEngine:
    """An MMEngine driven by a background step loop; requests stream their outputs as deltas.

    `AsyncMMEngine(engine)` wraps an engine (or `AsyncMMEngine.from_model(path, **options)` builds
    one). The loop starts with the first request, on the running event loop; `shutdown()` stops it.
    """

    def __init__(
        self,
        engine: MMEngine | EngineCoreClient,
        *,
        max_queued_requests: int | None = None,
        num_preprocess_workers: int = 2,
        max_step_retries: int = 1,
        owns_engine: bool = False,
        max_admission_wait_s: float = 0.0,
    ) -> None:
        """`owns_engine`: shutdown() also shuts the engine down: an EngineCoreClient's core process (the front end
        leaves its core), an MMEngine's preprocessing workers and tensor-parallel ranks. from_model owns what it builds.
        `max_admission_wait_s`: the longest a step waits for requests being prepared on the pool (0, the default:
        it never waits); over an engine-core process, each request being prepared is announced to the core, whose
        next step waits as long for it. A wait puts a request that arrives while a step runs into the next step, at
        the cost of up to that long between the running requests' tokens whenever one is being prepared: worth it
        where a step is short against a request's preparation (small models, CPU), not for a GPU's decode."""
        for name, value, low in (
            ("max_queued_requests", max_queued_requests, 1),
            ("num_preprocess_workers", num_preprocess_workers, 1),
            ("max_step_retries", max_step_retries, 0),
        ):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                optional = " or None" if name == "max_queued_requests" else ""
                raise ConfigError(f"{name} must be an int >= {low}{optional}, got {value!r}")
        if isinstance(max_admission_wait_s, bool) or not isinstance(max_admission_wait_s, (int, float)) \
                or not 0 <= max_admission_wait_s < float("inf"):
            raise ConfigError(f"max_admission_wait_s must be a finite number of seconds >= 0, got {max_admission_wait_s!r}")
        self.engine = engine
        self.max_admission_wait_s = float(max_admission_wait_s)
        self.max_queued_requests = max_queued_requests
        self.max_step_retries = max_step_retries
        # at least one thread per preprocessing worker process (mm_processor_workers), each waiting on its picture
        processes = engine.input_processor.pool.num_workers if engine.input_processor.pool is not None else 0
        self._pool = ThreadPoolExecutor(max(num_preprocess_workers, processes), thread_name_prefix="mmengine-preprocess")
        # Shared by the event loop, the workers and the step loop: the live streams and pending aborts.
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}  # in arrival order
        self._num_queued = 0  # streams whose first token has not arrived
        self._preparing: set[str] = set()  # requests registered whose pool job has not queued them yet
        self._prepared = threading.Condition(self._lock)  # notified when _preparing empties
        self._aborts: list[str] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.dead_error: BaseException | None = None  # why the step loop died, if it did
        self._owns_engine = owns_engine
        self.load_listener: Callable[[], None] | None = None  # told when num_in_flight or num_queued may have changed
        if isinstance(engine, EngineCoreClient):
            engine.watch(self._wake.set)  # a core that dies wakes the loop, which then fails every stream

    @classmethod
    def from_model(
        cls,
        model: str,
        *,
        max_queued_requests: int | None = None,
        num_preprocess_workers: int = 2,
        max_admission_wait_s: float = 0.0,
        **engine_options: Any,
    ) -> AsyncMMEngine:
        """`engine_core="process"` (an engine option) runs the scheduler, the caches and the model in an
        engine-core process of its own (engine/core_client.py). The engine is this AsyncMMEngine's: shutdown() stops
        every process it started (the core, or the in-process engine's preprocessing workers and tensor-parallel ranks)."""
        process = engine_options.get("engine_core") == "process"
        if process:
            engine: MMEngine | EngineCoreClient = EngineCoreClient(model, **engine_options)
        else:
            from mmengine.engine.mm_engine import MMEngine  # (the model's code: only an in-process engine needs it)

            engine = MMEngine(model, **engine_options)
        try:
            return cls(engine, max_queued_requests=max_queued_requests, num_preprocess_workers=num_preprocess_workers,
                       owns_engine=True, max_admission_wait_s=max_admission_wait_s)
        except BaseException:
            getattr(engine, "shutdown", engine.close)()
            raise

    # -- state -------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        """False once the step loop has died (or the engine was shut down)."""
        return (self.dead_error is None and getattr(self.engine, "dead_error", None) is None and not self._stopping
                and (self._thread is None or self._thread.is_alive()))

    @property
    def has_died(self) -> bool:
        """True once the engine can never serve again because something failed (the step loop died, or an
        engine-core process or a tensor-parallel worker did); False after a deliberate shutdown."""
        return not self._stopping and (self.dead_error is not None or getattr(self.engine, "dead_error", None) is not None
                                       or (self._thread is not None and not self._thread.is_alive()))

    @property
    def num_queued(self) -> int:
        """Requests accepted whose first token has not arrived (preprocessing, waiting or in prefill)."""
        return self._num_queued

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _load_changed(self) -> None:
        if self.load_listener is not None:
            self.load_listener()

    # -- requests ----------------------------------------------------------------

    async def add_request(
        self,
        prompt: str | dict[str, Any],
        images: Sequence[ImageInput] | None = None,
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        mm_uuids: Sequence[str | None] | None = None,
        fill_max_tokens: bool = False,
        lora: LoRARequest | str | None = None,
        videos: Sequence[Any] | None = None,
        audios: Sequence[Any] | None = None,
        whole_answer: bool = False,
    ) -> RequestStream:
        """Validates, preprocesses (on the worker pool) and queues one request; returns its stream.

        Bad input raises the engine's typed errors before anything is queued. `fill_max_tokens`
        replaces `sampling_params.max_tokens` with all the room the prompt leaves (max_model_len
        and the KV cache), as OpenAI's API does when max_tokens is not given. `lora` selects an adapter
        (a registered name, or a LoRARequest registered on first use). `videos` / `audios`: one per video /
        audio marker, as MMEngine.generate takes them. `whole_answer`: the caller reads only the whole answer
        (a non-streamed reply), so its stream wakes it for the first token and for the end, not for every
        step: it yields the first token's delta and then one delta with all the rest.
        """
        self._start()
        self.check_not_overloaded()
        checked = self.engine.intake.check(prompt, images, sampling_params, request_id=request_id, cache_salt=cache_salt,
                                           mm_uuids=mm_uuids, lora=lora, videos=videos, audios=audios)  # an unknown adapter fails here
        request_id = checked.request_id = checked.request_id or f"req-{random_hex()}"
        params = checked.params
        stream = RequestStream(self, request_id, params)
        stream.wakes_per_output = not whole_answer
        self._register(stream)
        return await self._queue_on_pool(stream, self._process_and_queue, stream, checked, fill_max_tokens)

    async def add_request_from(
        self,
        make_prompt: Callable[[], tuple[str | dict[str, Any], Sequence[ImageInput] | None]],
        sampling_params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        mm_uuids: Sequence[str | None] | None = None,
        fill_max_tokens: bool = False,
        lora: LoRARequest | str | None = None,
        whole_answer: bool = False,
    ) -> RequestStream:
        """add_request() for a prompt that is itself made on the worker pool: `make_prompt()` returns
        (prompt, images), e.g. a chat template rendered and its pictures decoded, and runs in the same pool
        job as the intake's checks, the preprocessing and the queueing. The request so reaches the engine
        after one trip to the pool instead of two (each trip waits for the event loop, which under load waits
        for the step loop's GIL). Errors are add_request()'s, and whatever `make_prompt` raises."""
        self._start()
        self.check_not_overloaded()
        request_id = check_request_id(request_id) or f"req-{random_hex()}"
        stream = RequestStream(self, request_id, _PENDING_PARAMS)  # its checked params are set before it is queued
        stream.wakes_per_output = not whole_answer
        self._register(stream)

        def make_and_queue() -> None:
            prompt, images = make_prompt()
            checked = self.engine.intake.check(prompt, images, sampling_params, request_id=request_id,
                                               cache_salt=cache_salt, mm_uuids=mm_uuids, lora=lora)
            stream.set_params(checked.params)
            self._process_and_queue(stream, checked, fill_max_tokens)

        return await self._queue_on_pool(stream, make_and_queue)

    def _register(self, stream: RequestStream) -> None:
        """Makes the stream the request's (its id must be free) and counts it as waiting for its first token."""
        with self._lock:
            if stream.request_id in self._streams:
                raise InvalidInputError(f"request id {stream.request_id!r} is already in use")
            self._streams[stream.request_id] = stream
            self._num_queued += 1
            self._preparing.add(stream.request_id)
        self._load_changed()
        if isinstance(self.engine, EngineCoreClient) and self.max_admission_wait_s > 0:
            try:  # the core's next step waits for it
                self.engine.expect(stream.request_id, self.max_admission_wait_s)
            except BaseException:
                self._done_preparing(stream.request_id)
                stream.abort()
                raise

    async def _queue_on_pool(self, stream: RequestStream, job: Callable[..., None], *args: Any) -> RequestStream:
        """Runs the job that prepares and queues the stream's request on the worker pool; if it fails, the
        stream is unregistered (and if the worker still queues it, the worker aborts it) and the error raised."""

        def job_then_ready() -> None:
            try:
                job(*args)
            finally:
                self._done_preparing(stream.request_id)

        try:
            await self.run_in_pool(job_then_ready)
        except BaseException:
            stream.abort()
            raise
        finally:  # (a job cancelled before it ran never says so itself)
            self._done_preparing(stream.request_id)
        return stream

    def _done_preparing(self, request_id: str) -> None:
        """The request is queued, failed or cancelled: steps no longer wait for it."""
        with self._lock:
            self._preparing.discard(request_id)
            if not self._preparing:
                self._prepared.notify_all()

    def check_not_overloaded(self) -> None:
        """Raises EngineOverloadedError while `max_queued_requests` requests wait for their first token
        (add_request() checks it too; a caller may check first, before doing its own work)."""
        if self.max_queued_requests is not None and self._num_queued >= self.max_queued_requests:
            raise EngineOverloadedError(
                f"{self._num_queued} requests are waiting for their first token "
                f"(max_queued_requests={self.max_queued_requests}); retry later"
            )

    async def generate(
        self,
        prompt: str,
        images: Sequence[ImageInput] | None = None,
        sampling_params: SamplingParams | None = None,
        **options: Any,
    ) -> AsyncIterator[DeltaOutput]:
        """add_request() and iterate its stream; leaving the loop early aborts the request."""
        stream = await self.add_request(prompt, images, sampling_params, **options)
        deltas = aiter(stream)
        try:
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()

    def abort(self, request_id: str) -> None:
        """Stops a request and frees its KV blocks and encoder references before the next step; its
        stream ends without more output. Safe from any thread; unknown ids are ignored."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.cancelled = True
                self._num_queued -= not stream.started
            self._aborts.append(request_id)
        self._load_changed()
        self._wake.set()

    async def run_in_pool(self, function: Callable[..., T], *args: Any) -> T:
        """Runs `function(*args)` on the preprocessing worker pool (for work that must stay off the
        event loop, such as decoding an upload)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, function, *args)

    async def update_weights(self, weights: Any) -> int:
        """MMEngine.update_weights off the event loop: loaded between two steps (it takes the engine's
        lock, which the step loop lets go of between steps), the caches reset; requests in flight go on."""
        return await asyncio.get_running_loop().run_in_executor(None, self.engine.update_weights, weights)

    async def reset_prefix_cache(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.reset_prefix_cache)

    async def shutdown(self) -> None:
        """Stops the step loop (requests in flight are aborted) and the worker pool."""
        self._stopping = True
        with self._lock:
            ids = list(self._streams)
            self._prepared.notify_all()
        for request_id in ids:
            self.abort(request_id)
        self._wake.set()
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._owns_engine:  # (an MMEngine's shutdown also stops its tensor-parallel workers)
            await asyncio.get_running_loop().run_in_executor(None, getattr(self.engine, "shutdown", self.engine.close))

    async def __aenter__(self) -> AsyncMMEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # -- worker pool side --------------------------------------------------------

    def _process_and_queue(self, stream: RequestStream, checked: CheckedRequest, fill_max_tokens: bool) -> None:
        engine = self.engine
        params = checked.params
        if fill_max_tokens:  # the prompt is checked to leave room for one token; it gets all the room there is below
            checked = dataclasses.replace(checked, params=dataclasses.replace(params, max_tokens=1))
        prepared = engine.intake.prepare(checked)  # a bad spec or prompt fails here, off the engine lock
        stream.num_prompt_tokens = len(prepared.processed.prompt_token_ids)
        if fill_max_tokens:  # the intake checked that one token fits; take all the room there is
            params = dataclasses.replace(params, max_tokens=self.max_output_tokens(stream.num_prompt_tokens))
            stream.sampling_params = params
        if stream.cancelled:
            return
        prepared = dataclasses.replace(prepared, params=params, request_id=stream.request_id)
        if isinstance(engine, EngineCoreClient):  # the core turns a whole answer itself, at its first token
            engine.add_prepared_request(prepared, whole_answer=not stream.wakes_per_output)
        else:
            engine.add_prepared_request(prepared)
        stream.added = True
        self._wake.set()
        if stream.cancelled:  # cancelled while being queued: the step loop's abort may have missed it
            engine.abort_request(stream.request_id)

    def max_output_tokens(self, num_prompt_tokens: int) -> int:
        """The most tokens a prompt of this length may generate: what max_model_len and the whole KV
        cache leave after it."""
        limit = self.engine.max_model_len
        in_kv_cache = self.engine.input_processor.max_tokens_in_kv_cache
        if in_kv_cache is not None:
            limit = min(limit, in_kv_cache)
        return limit - num_prompt_tokens

    # -- the step loop -----------------------------------------------------------

    def _start(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine loop has failed: {self.dead_error!r}")
        if getattr(self.engine, "dead_error", None) is not None:  # an engine-core process that died
            raise self.engine.dead_error
        if self._stopping:
            raise EngineDeadError("the engine has been shut down")
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="mmengine-step-loop", daemon=True)
            self._thread.start()
        elif asyncio.get_running_loop() is not self._loop:
            raise RuntimeError("an AsyncMMEngine serves the event loop it was started on")

    def _run(self) -> None:
        failures = 0
        try:
            while True:
                self._wake.clear()
                self._apply_aborts()
                if self._stopping:
                    return
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    continue
                self._await_preparing()
                try:
                    outputs = self.engine.step()
                except EngineDeadError:  # an engine-core process died: nothing can be retried
                    raise
                except Exception as err:  # the step advanced nothing, so it can be retried
                    failures += 1
                    logger.exception("engine step failed (%d in a row)", failures)
                    if failures > self.max_step_retries:
                        self._fail_newest_request(err)
                    continue
                failures = 0
                if outputs:
                    self._read_whole_answers_at_the_end(outputs)
                    self._post(self._dispatch, outputs)
        except BaseException as err:
            logger.exception("the engine loop died")
            self.dead_error = err
            self._post(self._fail_all, err)

    def _await_preparing(self) -> None:
        """Before a step: waits (at most max_admission_wait_s) for the requests being prepared on the pool, so they
        join this step. Without the wait the step loop, holding the GIL and the engine's lock most of the time,
        ran several steps while a client's next request was rendered, tokenized and queued, each over one slot
        fewer. (An EngineCoreClient's step only reads the core's outputs: the core waits, told by expect().)"""
        if self.max_admission_wait_s <= 0 or isinstance(self.engine, EngineCoreClient):
            return
        with self._lock:
            self._prepared.wait_for(lambda: not self._preparing or self._stopping, timeout=self.max_admission_wait_s)

    def _read_whole_answers_at_the_end(self, outputs: list[RequestOutput]) -> None:
        """A whole answer's request, once its first token is out, is stepped as generate()'s are: no output per
        step, its tokens decoded when it ends (MMEngine.read_final_output_only; an engine-core process is told at
        add_prepared_request and turns the request itself, with no trip back here)."""
        read_final = getattr(self.engine, "read_final_output_only", None)
        if read_final is None:
            return
        with self._lock:
            turned = [output.request_id for output in outputs if output.token_ids and not output.finished
                      and not getattr(self._streams.get(output.request_id), "wakes_per_output", True)]
        for request_id in turned:
            read_final(request_id)

    def _apply_aborts(self) -> None:
        with self._lock:
            aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.engine.abort_request(request_id)  # False if not queued yet: its worker aborts it

    def _fail_newest_request(self, err: Exception) -> None:
        with self._lock:
            queued = [stream for stream in self._streams.values() if stream.added]
            if not queued:
                raise RuntimeError("engine steps keep failing and no request of this AsyncMMEngine is left to fail") from err
            stream = queued[-1]
            del self._streams[stream.request_id]
            self._num_queued -= not stream.started
        self._load_changed()
        self.engine.abort_request(stream.request_id)
        logger.error("failing request %s: engine steps keep failing while it is in flight", stream.request_id)
        failure = RequestFailedError(f"request {stream.request_id} failed: engine steps kept raising {err!r}")
        self._post(stream._put, failure)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    # -- on the event loop -------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        delivered = []
        with self._lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:  # aborted or failed meanwhile
                    continue
                error = getattr(output, "error", None)  # an engine core's FailedOutput: it could not queue it
                if error is not None:
                    del self._streams[output.request_id]
                    self._num_queued -= not stream.started
                    delivered.append((stream, error))
                    continue
                if not stream.started and (output.token_ids or output.finished):
                    stream.started = True
                    self._num_queued -= 1
                if output.finished:
                    del self._streams[output.request_id]
                delivered.append((stream, output))
        self._load_changed()
        for stream, output in delivered:
            stream._put(output)

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            self._num_queued = 0
        self._load_changed()
        for stream in streams:
            stream._put(EngineDeadError(f"the engine loop has failed: {err!r}"))
