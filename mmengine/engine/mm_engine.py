"""MMEngine: the public entry point. Adds requests, runs the step loop, and offers generate()."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import GenerationConfig, PretrainedConfig

from mmengine.engine.prompt_inputs import (
    check_request_id,
    check_salt,
    check_sampling_params,
    is_single_prompt,
    normalize_batch,
    normalize_prompt,
    normalize_conversations,
    normalize_salts,
    normalize_uuids,
)
from mmengine.config import EngineConfig
from mmengine.sample.detokenizer import IncrementalDetokenizer
from mmengine.errors import CheckpointError, ConfigError, InvalidInputError, UnknownAdapterError
from mmengine.encoder_cache.budget import EncoderBudget, compute_encoder_budget
from mmengine.encoder_cache.hashing import hash_bytes
from mmengine.encoder_cache.host_tier import EncoderHostTier, host_tier_bytes
from mmengine.encoder_cache.manager import EncoderCacheManager
from mmengine.utils.host_memory import check_cpu_kv_cache_fits
from mmengine.kv_cache.block_hash import make_hash_function
from mmengine.kv_cache.host_tier import KVHostTier
from mmengine.kv_cache.manager import KVCacheManager
from mmengine.lora.adapter import DecoderShape, VisionTargets
from mmengine.lora.manager import LoRAManager
from mmengine.lora.request import LoRARequest
from mmengine.models.loader import checkpoint_dtype
from mmengine.models.family import ModelFamily
from mmengine.models.registry import family_class_for, load_family, load_hf_config, load_hf_processor
from mmengine.multimodal.image_loading import ImageInput
from mmengine.multimodal.processor import BatchMemo, InputProcessor
from mmengine.outputs import RequestOutput
from mmengine.core.request import ProcessedPrompt, Request, RequestStatus
from mmengine.runner import ModelRunner
from mmengine.runner.launched_step import LaunchedStep
from mmengine.sample.structured_output.grammar import GrammarCompiler
from mmengine.sample.params import SamplingParams
from mmengine.core.scheduler import Scheduler, SchedulerOutput

logger = logging.getLogger(__name__)

PREPROCESS_THREADS = min(8, os.cpu_count() or 1)

Conversation = list[dict[str, Any]]


class MMEngine:
    """A multimodal LLM engine over one local checkpoint (a LLaVA-style HF directory).

    `MMEngine(path, **options)` loads the model (options: see EngineConfig) and sizes the KV and
    encoder caches. Then either
    - `generate(prompts, images=...)` / `chat(messages, images=...)`: run a batch to completion and
      get one RequestOutput per prompt, in input order; or
    - `add_request(prompt, images)` and `step()` in a loop: continuous batching driven by you;
      each step returns the outputs of the requests that got a token; `abort_request(id)` stops one.

    Images in a prompt are marked with the processor's image token, one per image (`<image>` for LLaVA,
    `<|vision_start|><|image_pad|><|vision_end|>` for Qwen2-VL; `chat()` writes them).
    Identical images share one encoder run and identical prefixes share KV blocks (`stats()`
    counts both). Bad input raises a ValueError subclass from mmengine.errors before anything is
    queued. Every public method may be called from several threads (see README, "Threads").
    """

    def __init__(self, model: str | os.PathLike, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(str(model), **kwargs)
        model_dir = Path(self.config.model)
        self.hf_config = load_hf_config(model_dir)
        family_class_for(self.hf_config)  # fail fast on unsupported architectures
        hf_processor = load_hf_processor(model_dir, self.config.mm_processor_kwargs)
        self.family: ModelFamily = load_family(self.hf_config, hf_processor, model_dir)
        self.max_model_len = _resolve_max_model_len(self.config, self.family)
        self.device = self.config.resolve_device()
        self.dtype = self.config.resolve_dtype(checkpoint_dtype(model_dir), self.device)

        self.input_processor = InputProcessor(
            model_dir,
            self.family,
            self.max_model_len,
            self.config.limit_mm_per_prompt,
            self.config.max_image_pixels,
            self.config.mm_processor_cache_bytes,
            self.config.prefix_caching_hash_algo,
            hf_processor=hf_processor,
            max_video_seconds=self.config.max_video_seconds,
        )
        self.tokenizer = self.input_processor.tokenizer
        self.runner = ModelRunner(self.config, self.family, model_dir, self.device, self.dtype, self.max_model_len)
        unpinned = self._encoder_budget(pinned_room_tokens=0, warn=False)  # the real one below warns
        images_per_step = unpinned.compute_budget_tokens // unpinned.max_tokens_per_item
        num_blocks = self.runner.determine_num_kv_blocks(
            encoder_fixed_bytes=unpinned.compute_budget_tokens * self.runner.embedding_bytes,
            encoder_bytes_per_block=self.config.block_size * self.runner.embedding_bytes,
            images_per_step=images_per_step,
        )
        if self.device.type == "cpu":
            per_block = self.runner.kv_block_bytes + self.config.block_size * self.runner.embedding_bytes
            check_cpu_kv_cache_fits(num_blocks, per_block, explicit=self.config.num_kv_blocks is not None)
        self.runner.allocate_kv_cache(num_blocks)
        if self.runner.use_cuda_graphs:
            self.runner.capture_cuda_graphs()
        self.runner.warm_up(images_per_step)
        self.encoder_budget = self._encoder_budget(pinned_room_tokens=num_blocks * self.config.block_size)
        kv_host_bytes = host_tier_bytes(self.config.kv_cache_host_bytes, self.device.type)
        self.kv_cache = KVCacheManager(
            num_blocks,
            self.config.block_size,
            make_hash_function(self.config.prefix_caching_hash_algo, self.config.prefix_caching_hash_seed),
            enable_prefix_caching=self.config.enable_prefix_caching,
            host_tier=KVHostTier(kv_host_bytes, self.runner.kv_block_bytes) if kv_host_bytes else None,
        )
        self.encoder_cache = EncoderCacheManager(self.encoder_budget.cache_capacity_tokens, self.kv_cache.uncache_pinning)
        self.kv_cache.pin_listener = self.encoder_cache
        self.input_processor.max_tokens_in_kv_cache = num_blocks * self.config.block_size
        self.input_processor.max_tokens_per_item = self.encoder_budget.compute_budget_tokens
        self.encoder_host_tier = _encoder_host_tier(self.config, self.device)
        self.runner.encoder_host_tier = self.encoder_host_tier
        self.scheduler = Scheduler(
            self.config, self.kv_cache, self.encoder_cache, self.encoder_budget.compute_budget_tokens, self.max_model_len,
            self.encoder_host_tier,
        )
        self.eos_token_ids = _eos_token_ids(model_dir, self.hf_config, self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, self.family.text_config.vocab_size, self.eos_token_ids)
        self.loras: LoRAManager | None = None
        if self.config.enable_lora:
            shape = DecoderShape.of(self.family.text_config, self.family.head_dim)
            vision = VisionTargets({name: (m.in_features, m.out_features) for name, m in self.runner.vision_lora_modules.items()},
                                   self.runner.model.checkpoint_name, self.runner.model.is_ignorable)
            self.loras = LoRAManager(shape, self.config.max_loras, self.config.max_lora_rank, self.config.max_cpu_loras, vision)

        self._async_scheduling = self.config.async_scheduling == "on" or (
            self.config.async_scheduling == "auto" and self.device.type == "cuda"
        )
        self._in_flight: _InFlightStep | None = None  # async scheduling: the step launched, not yet booked
        self._pool: ThreadPoolExecutor | None = None  # generate()'s preprocessing threads, made on first use
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        # One lock over the engine's state, held briefly: validation and preprocessing run outside it.
        self._lock = threading.RLock()
        self._pending: list[RequestOutput] = []  # outputs for step() to return (add_request's requests)
        # Told of prompts about to be queued, outside the lock (mmengine.ray's encoder store fetches their items)
        self.before_enqueue: Callable[[list[ProcessedPrompt]], None] | None = None
        self._owners: dict[str, dict[str, RequestOutput]] = {}  # request id -> its generate() call's results
        self._counters = {
            "steps": 0,
            "tokens_computed": 0,
            "prefill_tokens_computed": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "requests_finished": 0,
        }
        logger.info(
            "mmengine ready: %s on %s/%s, %d KV blocks of %d tokens, max_model_len %d",
            model_dir, self.device, self.dtype, num_blocks, self.config.block_size, self.max_model_len,
        )

    def _encoder_budget(self, pinned_room_tokens: int, warn: bool = True) -> EncoderBudget:
        return compute_encoder_budget(
            self.family.max_tokens_per_item(),
            self.config.max_num_batched_tokens,
            self.config.max_num_seqs,
            self.config.limit_mm_per_prompt,
            pinned_room_tokens=pinned_room_tokens,
            bytes_per_token=self.runner.embedding_bytes,
            encoder_cache_size=self.config.encoder_cache_size,
            warn=warn,
            items_per_video=self.family.max_items_per_video,
        )

    # -- low-level API ---------------------------------------------------------

    def add_request(
        self,
        prompt: str | dict[str, Any],
        images: Sequence[ImageInput] | None = None,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        mm_uuids: Sequence[str | None] | None = None,
        lora: LoRARequest | str | None = None,
        videos: Sequence[Any] | None = None,
    ) -> str:
        """Validates and queues one request; returns its id. Bad input raises before anything is queued.

        Requests share cached KV blocks only when their cache_salt is equal (None is a salt too).
        `mm_uuids` optionally gives each image an id that replaces hashing its content. `lora` runs
        the request under an adapter (a LoRARequest, registered on first use, or a registered name).
        `prompt` may also be a prompt dict, as generate() takes it.
        """
        params = check_sampling_params(sampling_params)
        check_salt(cache_salt)
        check_request_id(request_id)
        self._check_sampling(params)
        uuids = normalize_uuids(mm_uuids, single=True, num_prompts=1)[0]
        self._lora_key(lora)  # an unknown or broken adapter fails before preprocessing
        given = normalize_prompt(prompt, images, videos=videos)
        processed = self.input_processor.process(  # outside the lock
            given.text, given.images, params, mm_uuids=uuids, token_ids=given.token_ids, videos=given.videos
        )
        return self.add_processed_request(processed, params, request_id, cache_salt, lora)

    def add_processed_request(
        self,
        processed: ProcessedPrompt,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora: LoRARequest | str | None = None,
    ) -> str:
        """Queues a prompt that `input_processor.process` already validated and preprocessed (on any
        thread, e.g. a worker pool's); returns its id. add_request() is process() and then this."""
        params = check_sampling_params(sampling_params)
        check_salt(cache_salt)
        check_request_id(request_id)
        self._check_sampling(params)
        if self.before_enqueue is not None:
            self.before_enqueue([processed])
        with self._lock:
            return self._enqueue(processed, params, request_id, cache_salt, self._lora_key(lora))

    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns an output for every request added with add_request() that
        got a token (finished or not) or was aborted since the last call. Does nothing on an idle engine.
        With async scheduling (on CUDA by default) a step launches the next step before it reads the
        tokens of the one in flight, so a token arrives one step() call after the step that computed it.

        If the step fails (the exception propagates), no request has advanced past what its outputs
        say and the caches' books match the runner's tensors, so calling step() again retries it.
        """
        with self._lock:
            self._advance()
            delivered, self._pending = self._pending, []
            return delivered

    def _advance(self) -> None:
        """One step, if there is work; routes each output to its owner (a generate() call, or step())."""
        if not self._has_work():
            return
        try:
            outputs = self._step_async() if self._async_scheduling else self._step()
        except BaseException:
            self._reconcile_encoder_books()
            raise
        for output in outputs:
            self._route(output)

    def _has_work(self) -> bool:
        """Requests to run, or a step in flight whose tokens someone still needs (a step left computing
        only for finished requests, e.g. after a stop token, is not waited for)."""
        step = self._in_flight
        if step is not None and all(s.request.is_finished for s in step.out.scheduled):
            self._in_flight = step = None
        return self.scheduler.has_unfinished_requests() or step is not None

    def _step(self) -> list[RequestOutput]:
        out = self._schedule()
        launched = self.runner.launch(out, self._block_tables(out))
        if launched.pending is not None:  # the grammars are current: mask while the forward runs
            launched = self.runner.sample(launched)
        sampled = launched.result()
        updated = self.scheduler.update_from_output(out, sampled, self.eos_token_ids)
        self._record_logprobs(launched, updated)
        return self._outputs(updated)

    def _record_logprobs(self, launched: LaunchedStep, updated: list[Request]) -> None:
        for found in launched.prompt_logprobs:
            request = found.request
            recorded = request.prompt_logprobs or [None]  # the first token has none
            for position, entry in enumerate(found.entries(), start=found.first_position):
                if position == len(recorded):  # a preempted request recomputes positions it already has
                    recorded.append(entry)
            request.prompt_logprobs = recorded
        logprobs = launched.token_logprobs()
        if logprobs:
            for request in updated:
                if request.request_id in logprobs:
                    request.output_logprobs.append(logprobs[request.request_id])

    def _step_async(self) -> list[RequestOutput]:
        """Async scheduling: books the step in flight with placeholder tokens, schedules and launches
        the next one, and only then waits for the step in flight's tokens. The host work of a step
        (scheduling, input preparation, detokenization) so runs while the device computes.

        A request that stops on a token computes one more step, whose token is discarded. A failure
        before the launch leaves the step in flight to finish normally (its outputs are delivered),
        so the books match the tensors as in a synchronous step.
        """
        previous, self._in_flight = self._in_flight, None
        pending = self.scheduler.book_step(previous.out) if previous is not None else []
        try:
            out = self._schedule(allow_empty=previous is not None)
            launched = self.runner.launch(out, self._block_tables(out), previous.launched if previous is not None else None)
        except BaseException:
            if previous is not None:
                for output in self._resolve(previous, pending):
                    self._route(output)
            raise
        step = _InFlightStep(out, launched)
        if out.num_scheduled_tokens:
            self._in_flight = step
        try:
            return self._resolve(previous, pending) if previous is not None else []
        finally:
            if launched.pending is not None:
                # Constrained rows: their masks need the tokens just resolved, so this step samples
                # now, while its forward runs on the device.
                step.launched = self.runner.sample(launched)

    def _resolve(self, step: _InFlightStep, pending: list[Request]) -> list[RequestOutput]:
        sampled = step.launched.result()  # the wait for the device
        updated = self.scheduler.resolve_tokens(pending, sampled, self.eos_token_ids)
        self._record_logprobs(step.launched, updated)
        return self._outputs(updated)

    def _schedule(self, allow_empty: bool = False) -> SchedulerOutput:
        out = self.scheduler.schedule()
        if out.kv_offloads or out.kv_restores:
            self._copy_kv_blocks(out)
        if self.loras is not None:
            self._activate_loras(out)
        if out.is_empty and not allow_empty and self.scheduler.has_unfinished_requests():
            raise RuntimeError(f"scheduler made no progress: {self.scheduler.running + list(self.scheduler.waiting)}")
        self._counters["steps"] += not out.is_empty
        self._counters["tokens_computed"] += out.num_scheduled_tokens
        self._counters["prefill_tokens_computed"] += sum(
            max(0, min(s.end, s.request.num_prompt_tokens) - s.start) for s in out.scheduled
        )
        return out

    def _copy_kv_blocks(self, out: SchedulerOutput) -> None:
        """Queues the copies between the KV tiers first thing in the step. If they cannot be queued, the
        blocks that were to be restored leave the cache and their requests recompute (preempted): a
        failed copy costs a prefill, never a wrong result."""
        try:
            self.runner.copy_kv_blocks(out.kv_offloads, out.kv_restores)
        except BaseException:
            for request_id in self.kv_cache.abandon_copies():
                self.scheduler.recompute(request_id)
            raise

    def _activate_loras(self, out: SchedulerOutput) -> None:
        """Makes the step's adapters resident in device slots and tells the runner each request's slot."""
        with_lora = [s.request for s in out.scheduled if s.num_new_tokens > 0 and s.request.lora_name is not None]
        if not with_lora:
            return
        running = {r.lora_name for r in self.scheduler.running if r.lora_name is not None}
        slot_of = self.loras.activate([r.lora_name for r in with_lora], running, self.runner.load_lora_slot)
        out.lora_slots = {r.request_id: slot_of[r.lora_name] for r in with_lora}
        out.encoder_lora_slots = {r.request_id: slot_of[r.lora_name] for r in with_lora if self.loras.touches_vision(r.lora_name)}

    def _block_tables(self, out: SchedulerOutput) -> dict[str, list[int]]:
        return {s.request.request_id: self.kv_cache.block_ids(s.request.request_id) for s in out.scheduled}

    def _outputs(self, updated: list[Request]) -> list[RequestOutput]:
        outputs = (self._after_token(request) for request in updated)
        return [output for output in outputs if output is not None]

    def has_unfinished_requests(self) -> bool:
        """Whether step() has more to do or to hand back: requests in flight, or outputs not yet returned."""
        with self._lock:
            return self._has_work() or bool(self._pending)

    def abort_request(self, request_id: str) -> bool:
        """Stops a request and frees what it holds; False if no such request is in flight. Its final
        output (finish_reason "abort") comes from the next step(), or from generate() if it owns it."""
        with self._lock:
            request = self.scheduler.abort_request(request_id)
            if request is None:
                return False
            detokenizer = self._detokenizers.pop(request_id)
            detokenizer.flush()
            self.runner.penalties.release(request_id)
            self._route(self._output(request, detokenizer))
            return True

    # -- high-level API --------------------------------------------------------

    def generate(
        self,
        prompts: str | dict[str, Any] | Sequence[str | dict[str, Any]],
        images: Sequence[ImageInput] | Sequence[Sequence[ImageInput] | None] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | Sequence[str | None] | None = None,
        mm_uuids: Sequence[str | None] | Sequence[Sequence[str | None] | None] | None = None,
        lora: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
        videos: Sequence[Any] | Sequence[Sequence[Any] | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for one prompt or a batch; returns one output per prompt, in input order.

        A prompt is a str, or a dict as vLLM's LLM.generate takes it: {"prompt": str} or
        {"prompt_token_ids": [int]} (a placeholder per picture, or the processor's expanded runs), with
        optional "multi_modal_data": {"image": picture or [pictures]}. A token prompt and the text that
        tokenizes the same share KV blocks and encoder outputs.
        For one prompt, `images` is that prompt's list of images; for a batch, one list (or None) per prompt.
        `cache_salt` is one salt for all prompts or one per prompt; `mm_uuids` follows the shape of
        `images`; `lora` is one adapter (or None, the base model) for all prompts or one per prompt.
        `videos` follows the shape of `images`, one per video marker (`<|video_pad|>` for Qwen): a path,
        encoded bytes, frames (a list of PIL images or a uint8 array [frames, H, W, 3]), or a
        multimodal.video.Video with its sampling (fps or num_frames) and size bounds.
        Every prompt is validated before any is queued, so bad input queues nothing.
        """
        inputs, params_list = normalize_batch(prompts, images, sampling_params, videos)
        salts = normalize_salts(cache_salt, len(inputs))
        uuid_lists = normalize_uuids(mm_uuids, is_single_prompt(prompts), len(inputs))
        loras = self._per_prompt_loras(lora, len(inputs))
        jobs = list(zip(inputs, params_list, uuid_lists))

        memo = BatchMemo()  # a picture object given for many prompts is read and hashed once
        text_ids = self.input_processor.tokenize_batch([given.text for given in inputs]) if len(jobs) > 1 else [None]

        def process(i: int) -> tuple[ProcessedPrompt, str | None]:
            given, params, uuids = jobs[i]
            try:
                lora_key = self._lora_key(loras[i])  # an unknown adapter is this prompt's error, in input order
            except InvalidInputError as err:
                raise err.at_prompt(i) from err
            self._check_sampling(params)
            return self.input_processor.process(
                given.text, given.images, params, prompt_index=i, mm_uuids=uuids, memo=memo, text_ids=text_ids[i],
                token_ids=given.token_ids, videos=given.videos,
            ), lora_key

        # Decoding, hashing and resizing release the GIL: a batch with images is preprocessed on a
        # few threads (the first bad prompt, in input order, still raises before anything is queued).
        if len(jobs) > 1 and any(given.images or given.videos for given in inputs):
            processed = list(self._preprocess_pool().map(process, range(len(jobs))))
        else:
            processed = [process(i) for i in range(len(jobs))]
        return self.run_processed([p for p, _ in processed], params_list, salts, [key for _, key in processed], use_tqdm)

    def beam_search(self, prompts: Any, params: Any, images: Any = None, use_tqdm: bool = False) -> list[Any]:
        """Beam search (mmengine.engine.beam_search): one BeamSearchOutput per prompt, sequences best first.
        `prompts` and `images` as generate() takes them; `params` a BeamSearchParams."""
        from mmengine.engine.beam_search import beam_search  # a layer above the engine: imported only when used

        return beam_search(self, prompts, params, images, use_tqdm)

    def run_processed(
        self,
        processed: Sequence[ProcessedPrompt],
        params_list: Sequence[SamplingParams],
        salts: Sequence[str | None] | None = None,
        lora_keys: Sequence[str | None] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs prompts that `input_processor.process` already made to completion, as generate() does
        (layers above the engine, such as beam search, use it to resubmit a prompt without preprocessing
        its pictures again); one output per prompt, in order."""
        salts = salts or [None] * len(processed)
        lora_keys = lora_keys or [None] * len(processed)
        if self.before_enqueue is not None:
            self.before_enqueue(list(processed))
        results: dict[str, RequestOutput] = {}  # filled by whichever thread's step finishes them
        ids: list[str] = []
        try:
            with self._lock:
                for p, params, salt, lora_key in zip(processed, params_list, salts, lora_keys):
                    ids.append(self._enqueue(p, params, None, salt, lora_key))
                    self._owners[ids[-1]] = results
                self.scheduler.group_batch(ids)
            with tqdm(total=len(ids), desc="generate", disable=not use_tqdm, unit="req") as bar:
                while True:
                    with self._lock:  # released between steps, so other callers get their turn
                        if len(results) < len(ids):
                            if not self._has_work():
                                raise RuntimeError(f"generate() lost track of requests {sorted(set(ids) - set(results))}")
                            self._advance()
                        done = len(results)
                    bar.update(done - bar.n)
                    if done == len(ids):
                        break
        except BaseException:
            with self._lock:
                for request_id in ids:
                    self.abort_request(request_id)
                    self._owners.pop(request_id, None)
            raise
        return [results[request_id] for request_id in ids]

    def _check_sampling(self, params: SamplingParams) -> None:
        """What only the model can check, before the prompt is preprocessed: a structured-output spec
        compiles (once per spec, cached) and logit_bias names tokens of the vocabulary."""
        if params.structured_output is not None:
            self.grammars.compile(params.structured_output)
        vocab = self.family.text_config.vocab_size
        outside = [token for token in params.logit_bias if token >= vocab]
        if outside:
            raise ConfigError(f"SamplingParams.logit_bias names token {outside[0]}, outside the vocabulary of {vocab}")

    def _preprocess_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PREPROCESS_THREADS, thread_name_prefix="mmengine-preprocess")
            return self._pool

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        images: Sequence[ImageInput] | Sequence[Sequence[ImageInput] | None] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        cache_salt: str | Sequence[str | None] | None = None,
        mm_uuids: Sequence[str | None] | Sequence[Sequence[str | None] | None] | None = None,
        lora: LoRARequest | str | Sequence[LoRARequest | str | None] | None = None,
        videos: Sequence[Any] | Sequence[Sequence[Any] | None] | None = None,
    ) -> list[RequestOutput]:
        """Like generate(), for one conversation (a list of {"role", "content"} messages) or a list of
        them, rendered with the model's chat template; `images`, `videos`, `mm_uuids` and `lora` follow
        generate() ({"type": "video"} parts stand for the videos, in order)."""
        conversations, single = normalize_conversations(messages)
        if not getattr(self.input_processor.hf_processor, "chat_template", None):
            raise InvalidInputError(
                "this checkpoint has no chat template (no chat_template.jinja or chat_template in its tokenizer or "
                "processor config): write the prompt with the model's image markers and call generate()"
            )
        prompts = []
        for index, conversation in enumerate(conversations):
            try:
                prompts.append(self.input_processor.apply_chat_template(conversation))
            except Exception as err:  # jinja2's TemplateError and the template's own raise_exception
                raise InvalidInputError(f"the chat template rejects this conversation: {err}", index) from err
        return self.generate(prompts[0] if single else prompts, images, sampling_params, use_tqdm, cache_salt, mm_uuids, lora, videos)

    # -- LoRA adapters -----------------------------------------------------------

    def add_lora(self, lora: LoRARequest) -> bool:
        """Registers an adapter (its files are read and checked now: AdapterError if they do not fit);
        False if that name and path were registered already."""
        loras = self._require_lora()
        with self._lock:
            known = lora.name in loras.registered if isinstance(lora, LoRARequest) else False
            loras.add(lora)
            return not known

    def remove_lora(self, name: str) -> bool:
        """Unregisters an adapter; False if there is none of that name. Refused (AdapterInUseError)
        while queued or running requests use it: removal is never deferred behind your back."""
        loras = self._require_lora()
        with self._lock:
            key = loras.remove(name, lambda k: sum(r.lora_name == k for r in self.scheduler.requests.values()))
            if key is None:
                return False
            slot = loras.vacate(key)
            if slot is not None:
                self.runner.clear_lora_slot(slot)
            return True

    def list_loras(self) -> list[str]:
        """The registered adapters' names."""
        if self.loras is None:
            return []
        with self._lock:
            return sorted(self.loras.registered)

    def _require_lora(self) -> LoRAManager:
        if self.loras is None:
            raise ConfigError("LoRA adapters need an engine started with enable_lora=True")
        return self.loras

    def _lora_key(self, lora: object) -> str | None:
        if lora is None:
            return None
        if self.loras is None:
            raise UnknownAdapterError(f"request asks for LoRA adapter {getattr(lora, 'name', lora)!r}, but this engine "
                                      "was started without enable_lora=True")
        with self._lock:
            return self.loras.key_of(lora)  # type: ignore[arg-type]

    @staticmethod
    def _per_prompt_loras(lora: object, num_prompts: int) -> list[object]:
        """generate()'s `lora` (one adapter for all prompts, or a list of one per prompt) as one per prompt."""
        if isinstance(lora, list | tuple):
            if len(lora) != num_prompts:
                raise InvalidInputError(f"lora has {len(lora)} entries for {num_prompts} prompt(s)")
            return list(lora)
        return [lora] * num_prompts

    def reset_prefix_cache(self) -> None:
        """Forgets every cached KV block (e.g. after changing weights). Running requests are unaffected."""
        with self._lock:
            self.kv_cache.reset_prefix_cache()

    def reset_encoder_cache(self) -> None:
        """Drops every encoder output no running request needs (e.g. after changing the vision tower's
        weights); KV blocks that pinned them leave the prefix cache first."""
        with self._lock:
            self.encoder_cache.reset()
            self.runner.free_encoder_outputs(self.encoder_cache.take_freed())
            if self.encoder_host_tier is not None:
                self.encoder_host_tier.clear()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return self._stats()

    def _stats(self) -> dict[str, int]:
        return {
            **self._counters,
            "num_preemptions": self.scheduler.num_preemptions,
            "encoder_runs": self.runner.num_encoder_runs,
            "cascade_steps": self.runner.num_cascade_steps,
            "cascade_groups": self.runner.num_cascade_groups,
            "cascade_tokens": self.runner.num_cascade_tokens,
            "encoder_cache_hits": self.encoder_cache.num_hits,
            "encoder_cache_misses": self.encoder_cache.num_misses,
            "encoder_cache_evictions": self.encoder_cache.num_evictions,
            "encoder_cache_pinned": self.encoder_cache.num_pinned,
            "encoder_cache_entries": len(self.encoder_cache.entries),
            "encoder_cache_bytes": self.encoder_cache.num_used * self.runner.embedding_bytes,
            **_host_tier_stats(self.encoder_host_tier),
            **_kv_host_tier_stats(self.kv_cache.host_tier),
            "reencodes_after_prefix_hit": self.scheduler.num_reencodes_after_prefix_hit,
            "images_decoded": self.input_processor.num_images_decoded,
            "images_preprocessed": self.input_processor.num_images_preprocessed,
            "videos_decoded": self.input_processor.videos.num_videos_decoded,
            "videos_preprocessed": self.input_processor.videos.num_videos_preprocessed,
            "mm_processor_cache_hits": self.input_processor.cache.num_hits,
            "mm_processor_cache_bytes": self.input_processor.cache.num_bytes,
            "prefix_cache_queries": self.kv_cache.prefix_cache_queries,
            "prefix_cache_hits": self.kv_cache.prefix_cache_hits,
            "kv_blocks_total": self.kv_cache.num_blocks,
            "kv_blocks_free": self.kv_cache.num_free_blocks,
            "kv_blocks_cached": self.kv_cache.num_cached_blocks,
            "kv_blocks_evicted": self.kv_cache.pool.num_evictions,
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "encoder_cache_referenced": self.encoder_cache.num_referenced,
            **self.scheduler.sharing.stats(),
            **(self.loras.stats() if self.loras is not None else {}),
        }

    # -- internals -------------------------------------------------------------

    def _enqueue(
        self,
        processed: ProcessedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora_key: str | None = None,
    ) -> str:
        arrival = next(self._arrivals)
        if request_id is None:
            request_id = f"req-{arrival}"
            while request_id in self.scheduler.requests:  # a caller chose this name: take the next
                arrival = next(self._arrivals)
                request_id = f"req-{arrival}"
        elif request_id in self.scheduler.requests:
            raise InvalidInputError(f"request id {request_id!r} is already in use")
        if lora_key is not None and not self.loras.holds(lora_key):  # removed while the prompt was preprocessed
            raise UnknownAdapterError(f"LoRA adapter {self.loras.name_of(lora_key)!r} was removed before the request was queued")
        if lora_key is not None and processed.mm_items and self.loras.touches_vision(lora_key):
            processed = _items_under_adapter(processed, lora_key, self.config.prefix_caching_hash_algo)
        generator = self.runner.sampler.make_generator(params, self.device)
        request = Request(request_id, processed, params, arrival, generator, cache_salt=cache_salt, lora_name=lora_key)
        if params.structured_output is not None:
            request.grammar = self.grammars.matcher(params.structured_output)
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, stop=params.stop)
        self.scheduler.add_request(request)
        self._detokenizers[request_id] = detokenizer
        self._counters["prompt_tokens"] += request.num_prompt_tokens
        return request_id

    def _reconcile_encoder_books(self) -> None:
        """After a failed step: the encoder cache books exactly the outputs the runner holds.

        Nothing advanced (no request's computed tokens moved), so the step can simply run again,
        except that entries booked for encodes that never ran must not look encoded: they are
        unbooked and their requests encode them next time. Outputs whose entries were evicted go.
        """
        self.encoder_cache.take_freed()
        outputs = self.runner.encoder_outputs
        self.scheduler.forget_encoder_entries([h for h in self.encoder_cache.entries if h not in outputs])
        self.runner.free_encoder_outputs([h for h in outputs if h not in self.encoder_cache.entries])

    def _route(self, output: RequestOutput) -> None:
        """Hands an output to the generate() call that owns its request, else to the next step()."""
        results = self._owners.get(output.request_id)
        if results is None:
            self._pending.append(output)
        elif output.finished:
            results[output.request_id] = output
            del self._owners[output.request_id]

    def _after_token(self, request: Request) -> RequestOutput | None:
        """Detokenizes the request's new token and applies stop strings. Returns its output, or None
        for an unfinished request of a generate() call (which reads only final outputs): such a
        request's tokens are decoded all at once when it finishes, unless it has stop strings."""
        detokenizer = self._detokenizers[request.request_id]
        streamed = request.request_id not in self._owners or bool(request.sampling_params.stop)
        token = request.output_token_ids[-1]
        stop_string = detokenizer.append(token, decode=streamed)
        self._counters["generation_tokens"] += 1
        if stop_string is not None and not request.is_finished:
            request.stop_reason = stop_string
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        if request.grammar is not None and not request.is_finished and _grammar_done(request.grammar, token):
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            detokenizer.flush()  # release a trailing partial character held back while streaming
            del self._detokenizers[request.request_id]
            self.runner.penalties.release(request.request_id)
            self._counters["requests_finished"] += 1
        elif request.request_id in self._owners:
            return None
        return self._output(request, detokenizer)

    @staticmethod
    def _output(request: Request, detokenizer: IncrementalDetokenizer) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=detokenizer.text,
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            stop_reason=request.stop_reason,
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None else None,
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
        )


@dataclass
class _InFlightStep:
    out: SchedulerOutput
    launched: LaunchedStep


def _encoder_host_tier(config: EngineConfig, device: Any) -> EncoderHostTier | None:
    """The host tier of the encoder cache, sized by encoder_cache_host_bytes (None: see EngineConfig)."""
    size = host_tier_bytes(config.encoder_cache_host_bytes, device.type)
    return EncoderHostTier(size) if size > 0 else None


def _host_tier_stats(tier: EncoderHostTier | None) -> dict[str, int]:
    if tier is None:
        return {name: 0 for name in ("encoder_host_hits", "encoder_host_entries", "encoder_host_bytes", "encoder_host_stored",
                                     "encoder_host_evictions", "encoder_host_bytes_copied_in", "encoder_host_bytes_copied_out")}
    return {"encoder_host_hits": tier.num_hits, "encoder_host_entries": len(tier), "encoder_host_bytes": tier.num_bytes,
            "encoder_host_stored": tier.num_stored, "encoder_host_evictions": tier.num_evictions,
            "encoder_host_bytes_copied_in": tier.bytes_in, "encoder_host_bytes_copied_out": tier.bytes_out}


def _kv_host_tier_stats(tier: KVHostTier | None) -> dict[str, int]:
    if tier is None:
        return {name: 0 for name in ("kv_host_hits", "kv_host_blocks", "kv_host_bytes", "kv_host_stored", "kv_host_evictions")}
    return {"kv_host_hits": tier.num_hits, "kv_host_blocks": len(tier), "kv_host_bytes": tier.num_bytes,
            "kv_host_stored": tier.num_stored, "kv_host_evictions": tier.num_evictions}


def _grammar_done(matcher: Any, token: int) -> bool:
    """Feeds a sampled token to a request's grammar; True when the grammar admits no further token
    (complete: the request stops as on EOS)."""
    matcher.consume_token(token)
    return matcher.is_stopped() or matcher.is_error()


def _items_under_adapter(processed: ProcessedPrompt, lora_key: str, hash_algo: str) -> ProcessedPrompt:
    """The prompt with each item keyed by the adapter too: an adapter on the vision side makes its own
    encoder outputs, which must neither hit nor feed the shared entries (nor KV blocks over them)."""
    items = [dataclasses.replace(item, mm_hash=hash_bytes(f"{item.mm_hash}|lora|{lora_key}".encode(), hash_algo))
             for item in processed.mm_items]
    return dataclasses.replace(processed, mm_items=items)


def _resolve_max_model_len(config: EngineConfig, family: ModelFamily) -> int:
    limit = family.text_config.max_position_embeddings
    window = family.sliding_window
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ConfigError(f"max_model_len={config.max_model_len} exceeds the model's max_position_embeddings={limit}")
        if window is not None and config.max_model_len > window:
            raise ConfigError(
                f"max_model_len={config.max_model_len} exceeds the model's sliding window ({window}); "
                "sliding-window attention is not supported, so max_model_len must stay within it"
            )
        return config.max_model_len
    if window is not None and window < limit:
        logger.warning("capping max_model_len to the model's sliding window (%d)", window)
        return window
    return limit


def _eos_token_ids(model_dir: Path, hf_config: PretrainedConfig, tokenizer: Any) -> frozenset[int]:
    """The generation config's EOS ids (what transformers' generate() stops on), else the model's or tokenizer's."""
    value: Any = None
    path = model_dir / "generation_config.json"
    if path.exists():
        try:
            value = GenerationConfig.from_pretrained(str(model_dir), local_files_only=True).eos_token_id
        except Exception as err:  # transformers raises OSError or ValueError for a broken file
            raise CheckpointError(f"cannot read the generation config: {err}", path) from err
    if value is None:
        value = getattr(hf_config.text_config, "eos_token_id", None)
    if value is None:
        value = tokenizer.eos_token_id
    values = value if isinstance(value, list | tuple) else [value]
    return frozenset(v for v in values if isinstance(v, int))
