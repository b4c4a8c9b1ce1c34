"""RequestIntake: the one pass from a caller's arguments to prompts ready to queue.

A request comes in through exactly two stages, whichever entry point it used (generate, add_request,
chat, AsyncMMEngine, beam search):
1. `check` / `check_batch`: the arguments put in shape (prompt_inputs.py: prompt forms, image, video and
   audio lists, salts, ids); cheap, no model work, so a caller can fail fast before registering anything;
2. `prepare` / `prepare_batch`: what only the model can check (the adapter, the structured-output spec,
   logit_bias), then the processor (multimodal/processor.py) tokenizes, loads and preprocesses, once.
Bad input raises a typed InvalidInputError naming its prompt, before anything is queued; except that
with preprocessing worker processes, generate() queues a batch's prompts as they become ready, in
whatever order that is (`start_batch`), so a picture that fails to decode can come after other prompts
were queued: those are aborted before the error reaches the caller, and nothing of the batch runs on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from mmengine.core.request import ProcessedPrompt
from mmengine.engine.prompt_inputs import (
    PromptInput,
    check_request_id,
    check_salt,
    check_sampling_params,
    is_single_prompt,
    normalize_batch,
    normalize_prompt,
    normalize_salts,
    normalize_uuids,
)
from mmengine.errors import ConfigError, InvalidInputError, UnknownAdapterError
from mmengine.lora.manager import LoRAManager
from mmengine.multimodal.processor import BatchMemo, InputProcessor
from mmengine.sample.params import SamplingParams
from mmengine.sample.structured_output.grammar import GrammarCompiler

PREPROCESS_THREADS = min(8, os.cpu_count() or 1)


@dataclass
class CheckedRequest:
    """A request's arguments in shape, before any model work: the prompt as given and its options."""

    given: PromptInput
    params: SamplingParams
    mm_uuids: Any = None
    cache_salt: str | None = None
    lora: object = None
    request_id: str | None = None


@dataclass
class PreparedRequest:
    """A request ready to queue: its prompt preprocessed and its adapter resolved to a key."""

    processed: ProcessedPrompt
    params: SamplingParams
    cache_salt: str | None = None
    lora_key: str | None = None
    request_id: str | None = None


class PreparingBatch:
    """A batch whose prompts are being prepared on the pool, handed out as each becomes ready, in whatever
    order that is (a slow or failing picture holds back no later prompt already prepared); each comes with
    its input index, so outputs can be put back in input order. Among the prompts ready at once, and for a
    batch already prepared (`of`), the order is input order.

    A bad prompt raises from `take_ready` once its preparation has failed: the prompts not started are
    dropped and those started are waited for, then the error raised is that of the lowest input index among
    the prompts whose preparation failed (a prompt dropped before it started is not checked), so the same
    finished preparations always raise the same error."""

    def __init__(self, futures: Sequence[Future[PreparedRequest]]) -> None:
        self._futures = list(futures)
        self._pending = list(range(len(self._futures)))  # the prompts not handed out yet, in input order

    @classmethod
    def of(cls, prepared: Sequence[PreparedRequest]) -> PreparingBatch:
        """A batch already prepared."""
        futures = []
        for request in prepared:
            futures.append(Future())
            futures[-1].set_result(request)
        return cls(futures)

    def __len__(self) -> int:
        return len(self._futures)

    @property
    def complete(self) -> bool:
        """Every prompt has been handed out."""
        return not self._pending

    def take_ready(self) -> list[tuple[int, PreparedRequest]]:
        """The prompts not handed out before that are ready (without waiting), each with its input index."""
        done = [index for index in self._pending if self._futures[index].done()]
        if any(self._failed(index) for index in done):
            self.cancel()
            failed = [index for index in range(len(self._futures)) if self._failed(index)]
            self._futures[failed[0]].result()  # raises the lowest failed prompt's error
        taken = set(done)
        self._pending = [index for index in self._pending if index not in taken]
        return [(index, self._futures[index].result()) for index in done]

    def wait_for_next(self, timeout: float | None) -> None:
        """Waits (at most `timeout` seconds; None: without bound) until any prompt not handed out yet is ready."""
        if not self.complete:
            wait([self._futures[index] for index in self._pending], timeout=timeout, return_when=FIRST_COMPLETED)

    def cancel(self) -> None:
        """Drops the prompts not started and waits for those started (a no-op once all are handed out)."""
        for future in self._futures:
            future.cancel()
        wait(self._futures)

    def _failed(self, index: int) -> bool:
        future = self._futures[index]
        return future.done() and not future.cancelled() and future.exception() is not None


class RequestIntake:
    def __init__(self, processor: InputProcessor, grammars: GrammarCompiler, vocab_size: int,
                 loras: LoRAManager | None, lock: threading.RLock) -> None:
        """`lock`: the engine's lock, under which the adapter books are read."""
        self.processor = processor
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.loras = loras
        self._lock = lock
        self._pool: ThreadPoolExecutor | None = None  # made on the first batch with pictures

    # -- stage 1: the arguments ------------------------------------------------

    def check(self, prompt: object, images: object = None, sampling_params: object = None, *, request_id: object = None,
              cache_salt: object = None, mm_uuids: object = None, lora: object = None, videos: object = None,
              audios: object = None) -> CheckedRequest:
        """One request's arguments (add_request's); an unknown adapter fails here, before preprocessing."""
        params = check_sampling_params(sampling_params)
        salt = check_salt(cache_salt)
        request_id = check_request_id(request_id)
        uuids = normalize_uuids(mm_uuids, single=True, num_prompts=1)[0]
        self.lora_key(lora)
        return CheckedRequest(normalize_prompt(prompt, images, videos=videos, audios=audios), params, uuids, salt, lora, request_id)

    def check_batch(self, prompts: object, images: object = None, sampling_params: object = None, *,
                    cache_salt: object = None, mm_uuids: object = None, lora: object = None,
                    videos: object = None, audios: object = None) -> list[CheckedRequest]:
        """One prompt or a batch, as generate() takes them; one CheckedRequest per prompt, in order."""
        inputs, params_list = normalize_batch(prompts, images, sampling_params, videos, audios)
        salts = normalize_salts(cache_salt, len(inputs))
        uuid_lists = normalize_uuids(mm_uuids, is_single_prompt(prompts), len(inputs))
        loras = _per_prompt(lora, len(inputs))
        return [CheckedRequest(*fields) for fields in zip(inputs, params_list, uuid_lists, salts, loras)]

    # -- stage 2: the model's checks and preprocessing -------------------------

    def prepare(self, checked: CheckedRequest, index: int = 0, memo: BatchMemo | None = None,
                text_ids: list[int] | None = None) -> PreparedRequest:
        """Checks what only the model can and preprocesses the prompt (on any thread, off the engine lock)."""
        try:
            lora_key = self.lora_key(checked.lora)
        except InvalidInputError as err:
            raise err.at_prompt(index) from err
        self.check_sampling(checked.params)
        given = checked.given
        processed = self.processor.process(
            given.text, given.images, checked.params, prompt_index=index, mm_uuids=checked.mm_uuids, memo=memo,
            text_ids=text_ids, token_ids=given.token_ids, videos=given.videos, audios=given.audios,
        )
        return PreparedRequest(processed, checked.params, checked.cache_salt, lora_key, checked.request_id)

    def prepare_batch(self, batch: list[CheckedRequest]) -> list[PreparedRequest]:
        """Prepares a batch; the first bad prompt, in input order, raises before anything is queued.

        The batch's texts are tokenized in one call, and a picture object given for many prompts is
        read and hashed once. Decoding, hashing and resizing release the GIL, so a batch with pictures
        is preprocessed on a few threads. A bad prompt stops the batch at once: the prompts not started
        are dropped and those started are waited for, so nothing of the batch runs on after it raises."""
        memo = BatchMemo()
        text_ids = self.processor.tokenize_batch([c.given.text for c in batch]) if len(batch) > 1 else [None]

        def prepare(index: int) -> PreparedRequest:
            return self.prepare(batch[index], index, memo, text_ids[index])

        if len(batch) > 1 and any(c.given.images or c.given.videos or c.given.audios for c in batch):
            return self._prepare_on_pool(prepare, len(batch))
        return [prepare(index) for index in range(len(batch))]

    def overlaps(self, batch: list[CheckedRequest]) -> bool:
        """Whether generate() queues this batch's prompts as they are prepared: a batch with media whose
        pictures go to the preprocessing worker processes (the engine's own thread stays free for steps)."""
        return self.processor.pool is not None and len(batch) > 1 and any(
            c.given.images or c.given.videos or c.given.audios for c in batch)

    def start_batch(self, batch: list[CheckedRequest]) -> PreparingBatch:
        """Starts preparing a batch on the pool (as prepare_batch does) without waiting for it."""
        memo = BatchMemo()
        text_ids = self.processor.tokenize_batch([c.given.text for c in batch])
        pool = self._preprocess_pool()
        return PreparingBatch([pool.submit(self.prepare, checked, index, memo, text_ids[index])
                               for index, checked in enumerate(batch)])

    def _prepare_on_pool(self, prepare: Callable[[int], PreparedRequest], num_prompts: int) -> list[PreparedRequest]:
        pool = self._preprocess_pool()
        futures = [pool.submit(prepare, index) for index in range(num_prompts)]
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        finally:  # a failure, or the caller interrupted: drop what has not started, wait for what has
            for future in futures:
                future.cancel()
            wait(futures)
        # Started in input order, so every prompt before a failed one ran: this raises the first bad prompt's error
        return [future.result() for future in futures]

    def check_sampling(self, params: SamplingParams) -> None:
        """What only the model can check before the prompt is preprocessed: a structured-output spec
        compiles (once per spec, cached) and logit_bias names tokens of the vocabulary."""
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)
        outside = [token for token in params.logit_bias if token >= self.vocab_size]
        if outside:
            raise ConfigError(f"SamplingParams.logit_bias names token {outside[0]}, outside the vocabulary of {self.vocab_size}")

    def lora_key(self, lora: object) -> str | None:
        """The adapter's key in the LoRA books (a LoRARequest is registered on first use); None for the base model."""
        if lora is None:
            return None
        if self.loras is None:
            raise UnknownAdapterError(f"request asks for LoRA adapter {getattr(lora, 'name', lora)!r}, but this engine "
                                      "was started without enable_lora=True")
        with self._lock:
            return self.loras.key_of(lora)  # type: ignore[arg-type]

    def _preprocess_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                # at least one thread per preprocessing worker process, each waiting on its picture
                workers = self.processor.pool.num_workers if self.processor.pool is not None else 0
                self._pool = ThreadPoolExecutor(max(PREPROCESS_THREADS, workers), thread_name_prefix="mmengine-preprocess")
            return self._pool


def _per_prompt(lora: object, num_prompts: int) -> list[object]:
    """generate()'s `lora` (one adapter for all prompts, or a list of one per prompt) as one per prompt."""
    if isinstance(lora, list | tuple):
        if len(lora) != num_prompts:
            raise InvalidInputError(f"lora has {len(lora)} entries for {num_prompts} prompt(s)")
        return list(lora)
    return [lora] * num_prompts
