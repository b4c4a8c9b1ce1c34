"""MMEngine: the public entry point, a thin facade over the parts start-up builds.

Requests come in through the intake (intake.py), run in the step loop (step_loop.py), and leave as
RequestOutputs; this file holds the public methods and the lock they share, nothing more.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from mmengine.config import EngineConfig
from mmengine.core.request import ProcessedPrompt
from mmengine.engine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from mmengine.engine.chat_media import has_media_parts, take_media_parts
from mmengine.engine.intake import PreparedRequest, PreparingBatch, RequestIntake
from mmengine.engine.prompt_inputs import (
    TemplateOptions,
    check_request_id,
    check_salt,
    check_sampling_params,
    normalize_conversations,
)
from mmengine.engine.startup import build_engine_parts
from mmengine.engine.stats import engine_stats
from mmengine.engine.step_loop import StepLoop
from mmengine.engine.step_threads import StepThreads
from mmengine.engine.weight_update import WeightsSource, updates_encoders, weight_stream
from mmengine.errors import ConfigError, EngineDeadError, InvalidInputError
from mmengine.lora.manager import LoRAManager
from mmengine.lora.request import LoRARequest
from mmengine.multimodal.image_loading import ImageInput
from mmengine.multimodal.media_urls import MediaPolicy
from mmengine.outputs import RequestOutput
from mmengine.runner.parallel_runner import ParallelRunner
from mmengine.sample.params import SamplingParams

Conversation = list[dict[str, Any]]


class MMEngine:
    """A multimodal LLM engine over one local checkpoint (a LLaVA-style or Qwen-VL HF directory).

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
    queued. Every public method may be called from several threads (see docs/python-api.md, "Threads").
    """

    def __init__(self, model: str | os.PathLike, **kwargs: Any) -> None:
        self.config = EngineConfig.from_kwargs(str(model), **kwargs)
        if self.config.parallel_config.engine_core != "thread":
            raise ConfigError("engine_core='process' is AsyncMMEngine's (AsyncMMEngine.from_model(path, engine_core='process')); "
                              "MMEngine runs in the calling process")
        self.parts = parts = build_engine_parts(self.config)
        self.hf_config, self.family, self.max_model_len = parts.hf_config, parts.family, parts.max_model_len
        self.device, self.dtype, self.runner = parts.device, parts.dtype, parts.runner
        self.input_processor, self.tokenizer = parts.input_processor, parts.input_processor.tokenizer
        self.encoder_budget, self.kv_cache, self.encoder_cache = parts.encoder_budget, parts.kv_cache, parts.encoder_cache
        self.encoder_host_tier, self.scheduler = parts.encoder_host_tier, parts.scheduler
        self.eos_token_ids, self.grammars, self.loras = parts.eos_token_ids, parts.grammars, parts.loras
        # The engine's one lock, held briefly: validation and preprocessing run outside it. Layers above
        # the engine that must never see a step half done (an audit, the Ray encoder store) take it too.
        self.lock = threading.RLock()
        self.intake = RequestIntake(self.input_processor, self.grammars, self.family.text_config.vocab_size, self.loras, self.lock)
        mode = self.config.scheduler_config.async_scheduling
        async_scheduling = mode == "on" or (mode == "auto" and self.device.type == "cuda")
        self.steps = StepLoop(self.config, self.scheduler, self.runner, self.kv_cache, self.encoder_cache, self.grammars,
                              self.loras, self.tokenizer, self.eos_token_ids, async_scheduling)
        # Told of prompts about to be queued, outside the lock (mmengine.ray's encoder store fetches their items)
        self.before_enqueue: Callable[[list[ProcessedPrompt]], None] | None = None
        # Worker processes (mm_processor_workers) stop with close(), or when the engine is collected
        pool = self.input_processor.pool
        self._finalizer = weakref.finalize(self, pool.close) if pool is not None else None
        # tensor_parallel_size > 1: the worker processes that hold the model (runner/parallel_runner.py)
        self.parallel = self.runner if isinstance(self.runner, ParallelRunner) else None
        # a model stepping on this process's CPU threads leaves the busy preprocessing workers their cores
        self.step_threads = StepThreads(pool) if pool is not None and self.device.type == "cpu" and self.parallel is None else None

    def close(self) -> None:
        """Stops the engine's worker processes (mm_processor_workers); the engine keeps its caches and can
        still serve, preparing pictures on its own threads."""
        if self._finalizer is not None:
            self._finalizer()
            self.input_processor.pool = None
            self.step_threads = None

    def shutdown(self) -> None:
        """Stops every process the engine started: the preprocessing workers and, with tensor_parallel_size > 1,
        the model's workers (after which every call raises EngineDeadError). Idempotent."""
        self.close()
        if self.parallel is not None:
            self.parallel.shutdown()

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine can no longer compute (a tensor-parallel worker died, noticed between steps too), or
        None. AsyncMMEngine reads it, so a server's /health goes red without waiting for a request."""
        return self.parallel.dead_error if self.parallel is not None else None

    def __enter__(self) -> MMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

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
        audios: Sequence[Any] | None = None,
    ) -> str:
        """Validates and queues one request; returns its id. Bad input raises before anything is queued.

        Requests share cached KV blocks only when their cache_salt is equal (None is a salt too).
        `mm_uuids` optionally gives each image an id that replaces hashing its content. `lora` runs
        the request under an adapter (a LoRARequest, registered on first use, or a registered name).
        `prompt` may also be a prompt dict, as generate() takes it.
        """
        checked = self.intake.check(prompt, images, sampling_params, request_id=request_id, cache_salt=cache_salt,
                                    mm_uuids=mm_uuids, lora=lora, videos=videos, audios=audios)
        return self.add_prepared_request(self.intake.prepare(checked))  # preprocessed outside the lock

    def add_processed_request(
        self,
        processed: ProcessedPrompt,
        sampling_params: SamplingParams,
        request_id: str | None = None,
        cache_salt: str | None = None,
        lora: LoRARequest | str | None = None,
    ) -> str:
        """Queues a prompt that `input_processor.process` already validated and preprocessed (on any
        thread, e.g. a worker pool's); returns its id. add_request() is the intake and then this."""
        params = check_sampling_params(sampling_params)
        check_salt(cache_salt)
        check_request_id(request_id)
        self.intake.check_sampling(params)
        return self.add_prepared_request(PreparedRequest(processed, params, cache_salt, self.intake.lora_key(lora), request_id))

    def add_prepared_request(self, prepared: PreparedRequest) -> str:
        """Queues a request the intake prepared (`intake.check` then `intake.prepare`, on any thread); its id."""
        if self.parallel is not None:
            self.parallel.check_alive()  # a dead worker: EngineDeadError, not a request that never runs
        if self.before_enqueue is not None:
            self.before_enqueue([prepared.processed])
        with self.lock:
            return self.steps.enqueue(prepared.processed, prepared.params, prepared.request_id, prepared.cache_salt,
                                      prepared.lora_key)

    def step(self) -> list[RequestOutput]:
        """Runs one scheduler step; returns an output for every request added with add_request() that
        got a token (finished or not) or was aborted since the last call. Does nothing on an idle engine.
        With async scheduling (on CUDA by default) a step launches the next step before it reads the
        tokens of the one in flight, so a token arrives one step() call after the step that computed it.

        If the step fails (the exception propagates), no request has advanced past what its outputs
        say and the caches' books match the runner's tensors, so calling step() again retries it.
        """
        with self.lock:
            self._advance()
            delivered, self.steps.pending = self.steps.pending, []
            return delivered

    def _advance(self) -> None:
        """One step of the loop (under the lock), on the CPU threads that busy preprocessing workers leave."""
        if self.step_threads is None:
            self.steps.advance()
            return
        with self.step_threads.around_step():
            self.steps.advance()

    def read_final_output_only(self, request_id: str) -> bool:
        """From now on step() returns this request's output (an add_request() one) only when it finishes, its
        remaining tokens decoded then at once, as generate() reads its own requests: for a caller that wants the
        whole answer only. False if no such request is in flight (finished, aborted, unknown or generate()'s)."""
        with self.lock:
            if request_id not in self.scheduler.requests or request_id in self.steps.owners:
                return False
            self.steps.owners[request_id] = _ToNextStep(self.steps)
            return True

    def has_unfinished_requests(self) -> bool:
        """Whether step() has more to do or to hand back: requests in flight, or outputs not yet returned."""
        with self.lock:
            return self.steps.has_work() or bool(self.steps.pending)

    def abort_request(self, request_id: str) -> bool:
        """Stops a request and frees what it holds; False if no such request is in flight. Its final
        output (finish_reason "abort") comes from the next step(), or from generate() if it owns it."""
        with self.lock:
            return self.steps.abort(request_id)

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
        audios: Sequence[Any] | Sequence[Sequence[Any] | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for one prompt or a batch; returns one output per prompt, in input order.

        A prompt is a str, or a dict as vLLM's LLM.generate takes it: {"prompt": str} or
        {"prompt_token_ids": [int]} (a placeholder per picture, or the processor's expanded runs), with
        optional "multi_modal_data": {"image": picture or [pictures], "video": ..., "audio": ...}. A token prompt and the text that
        tokenizes the same share KV blocks and encoder outputs.
        For one prompt, `images` is that prompt's list of images; for a batch, one list (or None) per prompt.
        `cache_salt` is one salt for all prompts or one per prompt; `mm_uuids` follows the shape of
        `images`; `lora` is one adapter (or None, the base model) for all prompts or one per prompt.
        `videos` follows the shape of `images`, one per video marker (`<|video_pad|>` for Qwen): a path,
        encoded bytes, frames (a list of PIL images or a uint8 array [frames, H, W, 3]), or a
        multimodal.video.Video with its sampling (fps or num_frames) and size bounds.
        `audios` follows the shape of `images`, one per audio marker (`<|audio|>` for Gemma 4): a path,
        encoded bytes (WAV, FLAC, MP3, OGG, ...), a (samples, sampling_rate) tuple of a 1-D float array,
        or a multimodal.audio.Audio.
        Every prompt is validated before any is queued, so bad input queues nothing. With preprocessing
        worker processes (mm_processor_workers), a batch's prompts are queued as their pictures are prepared,
        in whatever order that is (the outputs keep the prompts' order), so the first ready run meanwhile; a picture that fails then aborts the batch's queued requests before
        its error is raised, so nothing of the batch runs on.
        """
        batch = self.intake.check_batch(prompts, images, sampling_params, cache_salt=cache_salt, mm_uuids=mm_uuids,
                                        lora=lora, videos=videos, audios=audios)
        if self.intake.overlaps(batch):  # the first prompts run while later pictures are still being prepared
            return self.run_prepared(self.intake.start_batch(batch), use_tqdm)
        return self.run_prepared(self.intake.prepare_batch(batch), use_tqdm)

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
        return self.run_prepared([PreparedRequest(*fields) for fields in zip(processed, params_list, salts, lora_keys)], use_tqdm)

    def run_prepared(self, prepared: Sequence[PreparedRequest] | PreparingBatch, use_tqdm: bool = False) -> list[RequestOutput]:
        """Queues prepared requests (grouped by shared prefix) and steps until all finish; one output per
        prompt, in input order. A batch still being prepared is queued as its prompts become ready, in
        whatever order that is, while the model steps on those queued before; a bad prompt then aborts the
        batch's queued requests and raises (PreparingBatch.take_ready says which error)."""
        incoming = prepared if isinstance(prepared, PreparingBatch) else PreparingBatch.of(prepared)
        results: dict[str, RequestOutput] = {}  # filled by whichever thread's step finishes them
        ids: dict[int, str] = {}  # input index -> request id, in the order queued
        try:
            with tqdm(total=len(incoming), desc="generate", disable=not use_tqdm, unit="req") as bar:
                while True:
                    self._enqueue(incoming.take_ready(), results, ids)
                    with self.lock:  # released between steps, so other callers get their turn
                        if len(results) < len(ids):
                            if not self.steps.has_work():
                                raise RuntimeError(f"generate() lost track of requests {sorted(set(ids.values()) - set(results))}")
                            self._advance()
                        done = len(results)
                    bar.update(done - bar.n)
                    if done == len(incoming):
                        break
                    if done == len(ids):  # nothing of ours to step: wait for any prompt to be prepared
                        incoming.wait_for_next(timeout=0.05)
        except BaseException:
            incoming.cancel()
            with self.lock:
                for request_id in ids.values():
                    self.steps.abort(request_id)
                    self.steps.owners.pop(request_id, None)
            raise
        return [results[ids[index]] for index in range(len(incoming))]

    def _enqueue(self, prepared: list[tuple[int, PreparedRequest]], results: dict[str, RequestOutput],
                 ids: dict[int, str]) -> None:
        """Queues prepared requests (each with its input index) as one group (grouped by shared prefix), their
        outputs going to `results` and their ids to `ids` by input index."""
        if not prepared:
            return
        if self.before_enqueue is not None:
            self.before_enqueue([p.processed for _, p in prepared])
        with self.lock:
            queued = []
            for index, p in prepared:  # each id recorded at once: a failure aborts what was queued
                ids[index] = self.steps.enqueue(p.processed, p.params, None, p.cache_salt, p.lora_key)
                self.steps.owners[ids[index]] = results
                queued.append(ids[index])
            self.scheduler.group_batch(queued)

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
        *,
        audios: Sequence[Any] | Sequence[Sequence[Any] | None] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        media_policy: MediaPolicy | None = None,
    ) -> list[RequestOutput]:
        """Like generate(), for one conversation (a list of {"role", "content"} messages) or a list of
        them, rendered with the model's chat template (or `chat_template`); `images`, `videos`, `audios`,
        `mm_uuids` and `lora` follow generate() ({"type": "video"} and {"type": "audio"} parts stand for the
        videos and clips, in order).
        `chat_template_kwargs` are the template's own variables (e.g. {"enable_thinking": False});
        `add_generation_prompt=False, continue_final_message=True` continues the last message instead of
        opening the assistant's turn; `tools` (OpenAI function dicts) are rendered by the template.
        Pictures may instead come as OpenAI `image_url` / `video_url` parts, loaded under `media_policy`
        (default: data: URLs only; file:// under its allowed directory, http(s) when it allows them), and
        clips as `input_audio` parts (base64 data and its format)."""
        conversations, single = normalize_conversations(messages)
        if self.family.audio_token_id is None and any(_has_audio_parts(c) for c in conversations):
            raise InvalidInputError(f"{self.family.display_name} takes no audio: a conversation holds an 'audio' / "
                                    "'input_audio' content part")
        if any(has_media_parts(c) for c in conversations):
            conversations, images, videos, audios = self._media_from_parts(conversations, single, images, videos, audios,
                                                                           media_policy)
        options = TemplateOptions(chat_template, chat_template_kwargs or {}, add_generation_prompt,
                                  continue_final_message, tools)
        if chat_template is None and not getattr(self.input_processor.hf_processor, "chat_template", None):
            raise InvalidInputError(
                "this checkpoint has no chat template (no chat_template.jinja or chat_template in its tokenizer or "
                "processor config): pass chat_template=, or write the prompt with the model's image markers and call generate()"
            )
        prompts = []
        for index, conversation in enumerate(conversations):
            try:
                prompts.append(self.input_processor.apply_chat_template(conversation, **options.render_kwargs()))
            except Exception as err:  # jinja2's TemplateError and the template's own raise_exception
                raise InvalidInputError(f"the chat template rejects this conversation: {err}", index) from err
        return self.generate(prompts[0] if single else prompts, images, sampling_params, use_tqdm, cache_salt, mm_uuids, lora, videos,
                             audios)

    @staticmethod
    def _media_from_parts(conversations: list[Conversation], single: bool, images: Any, videos: Any, audios: Any,
                          policy: MediaPolicy | None) -> tuple[list[Conversation], Any, Any, Any]:
        if images is not None or videos is not None or audios is not None:
            raise InvalidInputError("pictures given twice: as image_url / video_url / input_audio parts and in images= / "
                                    "videos= / audios=")
        loaded = [take_media_parts(c, policy or MediaPolicy(), index) for index, c in enumerate(conversations)]
        rendered, images, videos, audios = (list(column) for column in zip(*loaded))
        if single:
            return rendered, images[0], videos[0], audios[0]
        return rendered, images, videos, audios

    def beam_search(self, prompts: Any, params: BeamSearchParams, images: Any = None, use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search (engine/beam_search.py): one BeamSearchOutput per prompt, sequences best first.
        `prompts` and `images` as generate() takes them; `params` a BeamSearchParams."""
        return beam_search(self, prompts, params, images, use_tqdm)

    # -- LoRA adapters -----------------------------------------------------------

    def add_lora(self, lora: LoRARequest) -> bool:
        """Registers an adapter (its files are read and checked now: AdapterError if they do not fit);
        False if that name and path were registered already."""
        loras = self._require_lora()
        with self.lock:
            known = lora.name in loras.registered if isinstance(lora, LoRARequest) else False
            loras.add(lora)
            return not known

    def remove_lora(self, name: str) -> bool:
        """Unregisters an adapter; False if there is none of that name. Refused (AdapterInUseError)
        while queued or running requests use it: removal is never deferred behind your back."""
        loras = self._require_lora()
        with self.lock:
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
        with self.lock:
            return sorted(self.loras.registered)

    def _require_lora(self) -> LoRAManager:
        if self.loras is None:
            raise ConfigError("LoRA adapters need an engine started with enable_lora=True")
        return self.loras

    # -- caches and counters -----------------------------------------------------

    def update_weights(self, weights: WeightsSource) -> int:
        """Loads new values for some or all of the model's weights, named as in the checkpoint: a state
        dict, (name, tensor) pairs, or a checkpoint directory. Each is checked as at start-up (a name the
        model lacks, a wrong shape: WeightsMismatchError naming it). Then the prefix cache is reset and,
        when a vision or audio tower or projector changed, the encoder cache, so nothing computed on the
        old weights is served again (see reset_prefix_cache). Requests running now go on. If a tensor is
        refused, those before it stay loaded and the caches are reset all the same. Returns how many
        tensors were loaded."""
        stream = weight_stream(weights)
        loaded: list[str] = []
        with self.lock:
            try:
                self.runner.update_weights(stream, loaded)
            finally:
                if loaded:
                    self._reset_caches(encoders=updates_encoders(loaded))
        return len(loaded)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix, in every cache group and the host tier (e.g. after changing weights).
        Requests running now go on, but nothing they compute from here is cached: their KV and recurrent
        states were computed, at least in part, before the reset."""
        with self.lock:
            self.scheduler.caches.reset_prefix_cache()

    def reset_encoder_cache(self) -> None:
        """Drops every encoder output (e.g. after changing a vision or audio tower's weights; then reset the
        prefix cache too, whose blocks were computed from them: update_weights does both). KV blocks that
        pinned them leave the prefix cache first. An output a running request still reads stays its own:
        no other request is served it, and one that needs the item encodes it again."""
        with self.lock:
            self._reset_encoder_cache()

    def _reset_caches(self, encoders: bool) -> None:
        self.scheduler.caches.reset_prefix_cache()
        if encoders:
            self._reset_encoder_cache()

    def _reset_encoder_cache(self) -> None:
        self.encoder_cache.reset()
        self.runner.free_encoder_outputs(self.encoder_cache.take_freed(), self.encoder_cache.take_stale_freed())
        if self.encoder_host_tier is not None:
            self.encoder_host_tier.clear()

    def stats(self) -> dict[str, int]:
        with self.lock:
            return engine_stats(self.parts, self.steps)


class _ToNextStep(dict):
    """The owner (StepLoop.owners) of a request that read_final_output_only() turned: its final output, the
    only one the step loop hands an owner, goes to the next step()'s outputs."""

    def __init__(self, steps: StepLoop) -> None:
        super().__init__()
        self._steps = steps

    def __setitem__(self, request_id: str, output: RequestOutput) -> None:
        self._steps.pending.append(output)


def _has_audio_parts(conversation: Conversation) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") in ("audio", "input_audio") for p in m["content"])
               for m in conversation)
