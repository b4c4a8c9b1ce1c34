"""The engine-core process: one MMEngine (scheduler, both caches, the model) that steps for a front end.

`AsyncMMEngine.from_model(path, engine_core="process")` spawns it (engine/core_client.py is the other end):

```
front end (the caller's process)                       engine core (spawned, 1)
intake: checks, tokenizing, media, preprocessing
  --("add", PreparedRequest: token ids, params, salt,   MMEngine.add_prepared_request
         items whose tensors cross by fd, shared memory)-->
  --("abort", request id)-->                             MMEngine.abort_request
  --("call", id, name)-->                                stats, reset_prefix_cache, reset_encoder_cache
  <--("outputs", [RequestOutput])--                      each step's outputs (detokenized here)
  <--("step_failed", why) / ("request_failed", id, error) / ("reply", id, ok, value)--
```

The core steps while it has work and reads its messages between steps; idle, it waits for one. It ends
when told to (None) or when the front end's end of the pipe closes (the front end is gone), so it never
outlives its front end. The engine is built with the front end's options, without preprocessing workers:
pictures arrive prepared.
"""

from __future__ import annotations

import logging
import os
import pickle
from typing import Any

from mmengine.engine.intake import PreparedRequest
from mmengine.engine.mm_engine import MMEngine
from mmengine.outputs import RequestOutput

logger = logging.getLogger(__name__)

READY, FAILED = "ready", "failed"
ADD, ABORT, CALL = "add", "abort", "call"
OUTPUTS, STEP_FAILED, REQUEST_FAILED, REPLY = "outputs", "step_failed", "request_failed", "reply"
CALLS = ("stats", "reset_prefix_cache", "reset_encoder_cache")


def core_main(model: str, options: dict[str, Any], connection: Any) -> None:
    """The process's entry point: builds the engine, says it is ready (with what the front end's intake
    needs to know of the caches), then serves until told to stop or the front end is gone."""
    try:
        engine = MMEngine(model, **options)
    except BaseException as err:  # noqa: BLE001 - reported to the front end, which raises it
        connection.send((FAILED, picklable(err)))
        return
    processor = engine.input_processor
    connection.send((READY, {"pid": os.getpid(), "max_tokens_in_kv_cache": processor.max_tokens_in_kv_cache,
                             "max_tokens_per_item": processor.max_tokens_per_item}))
    EngineCore(engine, connection).serve()


class EngineCore:
    def __init__(self, engine: MMEngine, connection: Any) -> None:
        self.engine = engine
        self.connection = connection

    def serve(self) -> None:
        engine = self.engine
        while True:
            # Idle: wait for a message; with work: take what has come and step.
            if not engine.has_unfinished_requests():
                self.connection.poll(None)
            try:
                while self.connection.poll(0):
                    if not self._handle(self.connection.recv()):
                        return
            except (EOFError, OSError):  # the front end is gone
                return
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as err:  # noqa: BLE001 - the step advanced nothing: the front end decides whom to fail
                logger.exception("engine-core step failed")
                self._send((STEP_FAILED, f"{type(err).__name__}: {err}"))
                continue
            if outputs:
                for output in outputs:
                    _strip(output)
                self._send((OUTPUTS, outputs))

    def _handle(self, message: Any) -> bool:
        """Applies one message; False when told to stop."""
        if message is None:
            return False
        kind = message[0]
        if kind == ADD:
            prepared: PreparedRequest = message[1]
            try:
                self.engine.add_prepared_request(prepared)
            except Exception as err:  # noqa: BLE001 - that request's failure, not the core's
                self._send((REQUEST_FAILED, prepared.request_id, picklable(err)))
        elif kind == ABORT:
            self.engine.abort_request(message[1])
        elif kind == CALL:
            _, call_id, name = message
            try:
                if name not in CALLS:
                    raise ValueError(f"the engine core serves no call {name!r}")
                self._send((REPLY, call_id, True, getattr(self.engine, name)()))
            except Exception as err:  # noqa: BLE001 - handed to the caller
                self._send((REPLY, call_id, False, picklable(err)))
        return True

    def _send(self, message: Any) -> None:
        try:
            self.connection.send(message)
        except (OSError, ValueError):  # the front end is gone: the next poll ends the loop
            pass


def _strip(output: RequestOutput) -> None:
    """The prompt and its token ids stay behind: the front end has them (an output is made every step)."""
    output.prompt = None
    output.prompt_token_ids = []


def picklable(err: BaseException) -> BaseException:
    """The error itself when it crosses a pipe intact, else a RuntimeError that names it."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(err).__name__}: {err}")
