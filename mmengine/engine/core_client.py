"""EngineCoreClient: MMEngine's face for AsyncMMEngine, over an engine-core process (engine/core_process.py).

The front end (this process) keeps the intake: argument checks, tokenizing, media loading and
preprocessing (its InputProcessor is built without the model; with mm_processor_workers, on its own
worker processes) and the structured-output checks. Prepared requests go to the core, whose scheduler,
encoder cache and prefix cache serve them all; each step's outputs (detokenized by the core, where stop
strings decide when a request ends) come back and are handed out by `step()`, as MMEngine.step does.
Pixel tensors cross by file descriptor in shared memory (torch's reductions), never as pickled arrays.

With `core_address`, it connects to a core another process spawned and shares it with that core's other
front ends (`mmengine serve --api-server-count N`); the core routes each request's outputs to the front end
that sent it.

One receiver thread reads the core's messages and watches its process: if the core dies, `step()`,
`has_unfinished_requests()`, `add_prepared_request()` and every call raise EngineDeadError, and the
callbacks given to `watch()` are told at once (AsyncMMEngine wakes its loop with it, so an idle engine
turns unhealthy too). `close()` stops a core this front end spawned and waits for it (a core outlives no
owner); a connected front end's `close()` only leaves (the core aborts its requests).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as torch_mp  # registers torch's reductions: tensors cross in shared memory

from mmengine.config import EngineConfig
from mmengine.engine.core_process import (
    ABORT, ADD, CALL, EXPECT, FAILED, OUTPUTS, READY, REPLY, REQUEST_FAILED, STEP_FAILED, core_environment, owned_core_main,
)
from mmengine.engine.intake import PreparedRequest, RequestIntake
from mmengine.engine.picture_mirror import SentPictures
from mmengine.engine.input_parts import build_input_parts, eos_token_ids_of
from mmengine.utils.ids import random_hex
from mmengine.engine.stats import processor_stats
from mmengine.errors import ConfigError, EngineDeadError
from mmengine.outputs import RequestOutput
from mmengine.sample.structured_output.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

_POLL_SECONDS = 0.05  # the longest step() waits for outputs (so the caller's loop applies aborts meanwhile)
_JOIN_SECONDS = 5.0
_CALL_SECONDS = 120.0
_CONNECT_SECONDS = 300.0  # a core listens before it loads the model: this bounds only a core that never started
_DIED = object()


@dataclass
class FailedOutput:
    """A request the core could not queue: `step()` hands it out like an output; its stream raises `error`."""

    request_id: str
    error: BaseException
    finished: bool = True


class EngineCoreClient:
    """The attributes and methods of MMEngine that AsyncMMEngine and the server use, over a core process."""

    def __init__(self, model: str, *, core_address: str | None = None, core_authkey: bytes | None = None,
                 **options: Any) -> None:
        """Spawns an engine-core process for this front end; with `core_address` (and its `core_authkey`),
        connects to a running one instead (one of `mmengine serve --api-server-count N`'s front ends)."""
        self.config = config = EngineConfig.from_kwargs(str(model), **options)
        if config.lora_config.enable_lora:
            raise ConfigError("engine_core='process' does not serve LoRA adapters yet: use engine_core='thread'")
        self.process: Any = None  # the core, when this front end spawned it (else another process owns it)
        if core_address is None:
            core_options = {**options, "engine_core": "thread", "mm_processor_workers": 0}
            context = torch_mp.get_context("spawn")
            self._connection, theirs = context.Pipe()
            self.process = context.Process(target=owned_core_main, args=(str(model), core_options, theirs), daemon=True,
                                           name="mmengine-engine-core")
            with core_environment():
                self.process.start()  # the model loads there while the intake is built here
            theirs.close()
            self._finalizer = weakref.finalize(self, _stop_core, self.process, self._connection, None)
        try:
            inputs = build_input_parts(config)
            self.input_processor = inputs.input_processor
            if core_address is not None:
                self._connection = _connect(core_address, core_authkey)
            info = self._wait_until_ready()
        except BaseException:
            if self.process is not None:
                self._finalizer()
            elif getattr(self, "input_processor", None) is not None and self.input_processor.pool is not None:
                self.input_processor.pool.close()
            raise
        if self.process is not None:
            self._finalizer.detach()
        pool = inputs.input_processor.pool
        self._finalizer = weakref.finalize(self, _stop_core, self.process, self._connection, pool)
        self._core_pid: int = info["pid"]
        self.hf_config, self.family, self.max_model_len = inputs.hf_config, inputs.family, inputs.max_model_len
        self.tokenizer = self.input_processor.tokenizer
        self.input_processor.max_tokens_in_kv_cache = info["max_tokens_in_kv_cache"]
        self.input_processor.max_tokens_per_item = info["max_tokens_per_item"]
        self.eos_token_ids = eos_token_ids_of(Path(config.model), self.hf_config, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.family.text_config.vocab_size, self.eos_token_ids)
        self.loras = None
        self.lock = threading.RLock()  # the intake's (the adapter books it guards live in no front end)
        self.intake = RequestIntake(self.input_processor, self.grammars, self.family.text_config.vocab_size, None, self.lock)
        self.dead_error: EngineDeadError | None = None
        self._closing = False
        self._send_lock = threading.Lock()
        # The pictures the core holds from this front end (engine/picture_mirror.py): each crosses once
        self._sent_pictures = SentPictures(config.multimodal_config.mm_processor_cache_bytes)
        self._adding = threading.Lock()  # the books change in the order the requests are sent
        self.num_items_sent_bare = 0  # items sent without their tensors, the core holding them
        self._books = threading.Lock()
        self._in_core: dict[str, tuple[str | None, list[int]]] = {}  # request id -> its prompt and token ids
        self._expected: set[str] = set()  # announced to the core (expect()), not sent yet
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # the core's outputs, for step()
        self._backlog: deque[Any] = deque()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._watchers: list[Callable[[], None]] = []
        self._receiver = threading.Thread(target=self._receive, name="mmengine-core-receiver", daemon=True)
        self._receiver.start()

    def _watched(self) -> list[Any]:
        """What the receiver waits on: the connection, and the core's sentinel when this process spawned it."""
        return [self._connection] + ([self.process.sentinel] if self.process is not None else [])

    def _wait_until_ready(self) -> dict[str, Any]:
        ready = wait(self._watched())
        if self._connection in ready:
            try:
                status, payload = self._connection.recv()
            except (EOFError, OSError):
                pass
            else:
                if status == READY:
                    return payload
                if status == FAILED:
                    raise payload
        if self.process is None:
            raise EngineDeadError("the engine-core process closed its connection while starting")
        self.process.join(_JOIN_SECONDS)
        raise EngineDeadError(f"the engine-core process died while starting (exit code {self.process.exitcode})")

    # -- state -----------------------------------------------------------------

    @property
    def core_pid(self) -> int:
        return self._core_pid

    def watch(self, callback: Callable[[], None]) -> None:
        """`callback()` is called (on the receiver thread) when the core dies; at once if it has."""
        with self._books:
            self._watchers.append(callback)
            dead = self.dead_error is not None
        if dead:
            callback()

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    # -- MMEngine's request methods --------------------------------------------

    def add_prepared_request(self, prepared: PreparedRequest, whole_answer: bool = False) -> str:
        """Sends a prepared request to the core (its tensors by fd, in shared memory); returns its id.
        `whole_answer`: the caller reads only the whole answer, so the core sends this request's output at its
        first token and at its end only (MMEngine.read_final_output_only there, from the first token on)."""
        self._check_alive()
        request_id = prepared.request_id or f"req-{random_hex()}"
        if prepared.request_id is None:
            prepared = dataclasses.replace(prepared, request_id=request_id)
        processed = prepared.processed
        with self._books:
            self._in_core[request_id] = (processed.prompt, processed.prompt_token_ids)
            self._expected.discard(request_id)
        with self._adding:
            items, bare = self._sent_pictures.strip(processed.mm_items)
            if bare:
                prepared = dataclasses.replace(prepared, processed=dataclasses.replace(processed, mm_items=items))
                self.num_items_sent_bare += bare
            self._send((ADD, in_shared_memory(prepared), processor_stats(self.input_processor), whole_answer))
        return request_id

    def expect(self, request_id: str, max_wait_s: float) -> None:
        """Tells the core that this request is being prepared: its next step waits (at most `max_wait_s`) for it to
        be added, or aborted, so that it joins that step."""
        with self._books:
            self._expected.add(request_id)
        self._send((EXPECT, request_id, max_wait_s))

    def abort_request(self, request_id: str) -> bool:
        """Tells the core to stop a request (its final "abort" output follows); False if it was not sent there
        (one only announced with expect() is withdrawn, so the core stops waiting for it)."""
        with self._books:
            known = request_id in self._in_core
            announced = request_id in self._expected
            self._expected.discard(request_id)
        if known or announced:
            try:
                self._send((ABORT, request_id))
            except EngineDeadError:
                pass
        return known

    def has_unfinished_requests(self) -> bool:
        self._check_alive()
        with self._books:
            return bool(self._in_core) or bool(self._backlog) or not self._inbox.empty()

    def step(self) -> list[RequestOutput | FailedOutput]:
        """The outputs the core sent since the last call (waiting briefly for some when there are none).
        A step the core failed raises here, after the outputs before it were handed out."""
        if not self._backlog:
            try:
                self._backlog.append(self._inbox.get(timeout=_POLL_SECONDS))
            except queue.Empty:
                self._check_alive()
                return []
        while True:
            try:
                self._backlog.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        outputs: list[RequestOutput | FailedOutput] = []
        while self._backlog:
            message = self._backlog[0]
            if message is _DIED or message[0] == STEP_FAILED:
                if outputs:
                    return outputs
                self._backlog.popleft()
                if message is _DIED:
                    self._backlog.appendleft(message)  # every later call raises too
                    raise self.dead_error
                raise RuntimeError(f"the engine core's step failed: {message[1]}")
            self._backlog.popleft()
            if message[0] == OUTPUTS:
                outputs.extend(self._restore(output) for output in message[1])
            elif message[0] == REQUEST_FAILED:
                with self._books:
                    self._in_core.pop(message[1], None)
                outputs.append(FailedOutput(message[1], message[2]))
        return outputs

    def _restore(self, output: RequestOutput) -> RequestOutput:
        with self._books:
            prompt, token_ids = (self._in_core.pop if output.finished else self._in_core.get)(output.request_id, (None, []))
        output.prompt, output.prompt_token_ids = prompt, token_ids
        return output

    # -- calls -----------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """The core's counters; the intake's (decoding, preprocessing, the processor cache) summed over its
        front ends (this one's as of now, the others' as of their last request)."""
        return self._call("stats")

    def reset_prefix_cache(self) -> None:
        self._call("reset_prefix_cache")

    def reset_encoder_cache(self) -> None:
        self._call("reset_encoder_cache")

    def list_loras(self) -> list[str]:
        return []

    def add_lora(self, lora: Any) -> bool:
        raise ConfigError("LoRA adapters need an engine started with enable_lora=True (and engine_core='thread')")

    remove_lora = add_lora

    def update_weights(self, weights: Any) -> int:
        raise ConfigError("update_weights is not served with engine_core='process' yet: use engine_core='thread'")

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("beam search is not served with engine_core='process' yet: use engine_core='thread'")

    def _call(self, name: str) -> Any:
        self._check_alive()
        future: Future = Future()
        call_id = next(self._call_ids)
        with self._books:
            self._calls[call_id] = future
        if self.dead_error is not None:  # died before the call was booked: nobody else resolves it
            raise self.dead_error
        self._send((CALL, call_id, name, processor_stats(self.input_processor)))
        return future.result(_CALL_SECONDS)

    # -- the pipe --------------------------------------------------------------

    def _send(self, message: Any) -> None:
        try:
            with self._send_lock:
                self._connection.send(message)
        except (OSError, ValueError) as err:  # a closed pipe: the core is gone (the receiver says why)
            self._receiver.join(_JOIN_SECONDS)
            raise self.dead_error or EngineDeadError(f"the engine-core process is gone: {err}") from err

    def _receive(self) -> None:
        connection, watched = self._connection, self._watched()
        try:
            while True:
                ready = wait(watched)
                if connection not in ready:
                    break
                try:
                    message = connection.recv()
                except (EOFError, OSError):
                    break
                if message[0] == REPLY:
                    _, call_id, ok, value = message
                    with self._books:
                        future = self._calls.pop(call_id, None)
                    if future is not None:
                        future.set_result(value) if ok else future.set_exception(value)
                else:
                    self._inbox.put(message)
        finally:
            self._died()

    def _died(self) -> None:
        if self.process is not None:
            self.process.join(_JOIN_SECONDS)
        if self._closing:
            error = EngineDeadError("the engine has been shut down")
        else:
            how = f"exit code {self.process.exitcode}" if self.process is not None else "its connection closed"
            error = EngineDeadError(f"the engine-core process died ({how}): every request in flight has failed")
            logger.error("%s", error)
        with self._books:
            self.dead_error = error
            calls, self._calls = list(self._calls.values()), {}
            watchers = list(self._watchers)
        for future in calls:
            future.set_exception(error)
        self._inbox.put(_DIED)
        for callback in watchers:
            callback()

    def close(self) -> None:
        """Stops the core (requests in it end) and the intake's worker processes, and waits for them."""
        self._closing = True
        self._finalizer()  # the core is told to stop and waited for (killed if it does not)
        self._receiver.join(_JOIN_SECONDS)
        self._connection.close()
        self.input_processor.pool = None

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def in_shared_memory(prepared: PreparedRequest) -> PreparedRequest:
    """The request with its items' tensors copied into shared memory, to cross by file descriptor. Sending
    a tensor would move its own storage there, in place: the processor cache's copy would then hold a
    descriptor and a mapping for as long as it is cached (thousands of pictures: the descriptor limit)."""
    items = prepared.processed.mm_items
    if not items:
        return prepared
    shared = [dataclasses.replace(item, encoder_inputs=type(item.encoder_inputs)(
        {name: _shared_copy(tensor) for name, tensor in item.encoder_inputs.items()})) for item in items]
    return dataclasses.replace(prepared, processed=dataclasses.replace(prepared.processed, mm_items=shared))


def _shared_copy(tensor: torch.Tensor) -> torch.Tensor:
    """One copy, straight into a new shared segment (clone + share_memory_ would copy twice)."""
    if tensor.is_shared():
        return tensor
    storage = torch.UntypedStorage._new_shared(tensor.numel() * tensor.element_size())
    return torch.empty(0, dtype=tensor.dtype).set_(storage, 0, tensor.shape).copy_(tensor)


def _connect(address: str, authkey: bytes | None) -> Connection:
    """Connects to a core that may still be starting (its address appears once it listens)."""
    deadline = time.monotonic() + _CONNECT_SECONDS
    while True:
        try:
            return Client(address, "AF_UNIX", authkey=authkey)
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise EngineDeadError(f"no engine core listens at {address} after {_CONNECT_SECONDS:.0f} s") from None
            time.sleep(0.05)


def _stop_core(process: Any, connection: Any, pool: Any) -> None:
    """Tells the core this front end is leaving (a core it spawned stops, and is waited for)."""
    try:
        connection.send(None)
    except (OSError, ValueError):
        pass
    if process is not None:
        process.join(_JOIN_SECONDS)
        if process.is_alive():
            process.kill()
            process.join(_JOIN_SECONDS)
    if pool is not None:
        pool.close()
