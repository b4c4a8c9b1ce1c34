"""StepLoop: one scheduler step at a time, from the schedule to the outputs of the requests it advanced.

The loop owns the requests' engine-side state (detokenizers, the step in flight, who reads each
output) and the work counters; the scheduler decides, the caches keep their books, the runner
computes. Every method runs under the engine's lock (MMEngine holds it).

With async scheduling (on CUDA by default) a step launches the next step before it reads the tokens
of the one in flight, so the host work of a step overlaps the device's.

With speculative decoding by a draft head (MTP, EAGLE-3), the head drafts within the step on the device
(runner/head_drafter.py), and the next step is launched before the verify step in flight is read too:
the scheduler books each of its rows as if it kept only its last token (book_step), the next row of the
request starts there with a placeholder token and placeholder drafts, and the runner moves it on the
device by the drafts kept and fills in the bonus token and the head's drafts (runner/follow_drafts.py; at
tensor_parallel_size > 1 each rank so moves its own rows, from the step in flight it holds: runner/parallel_runner.py);
reading the step then books the kept run and moves the launched row's start by as much (resolve_runs).
A stop string inside the kept run cuts it there and ends the request (after_token), and the row launched ahead
for it is dropped unread, as a stop token's extra row is without drafts (its blocks, and a hybrid checkpoint
booked for it, go with the request); log-probabilities are read with the step's tokens, the kept run's; a
penalized request's kept run is counted on the device as soon as it is sampled (step_sampling.count_kept_runs),
and its row launched ahead counts the drafts the device gave it. A row that needs the host between the steps
makes the whole step wait (a grammar: its masks and the drafts it allows; DraftPlanner.resolves_first,
draft_planner.py, which also plans the drafts). Waiting, the step in flight is read, booked, its drafts handed on
(spec/head_drafts.py), and the next one launched while the outputs go out.

With n-gram drafts, a step whose successor needs its tokens (a verify step, whose kept run sets the next
positions; one after which drafts are expected) is read first, then the next one is launched and the
caller gets the outputs while it runs; steps without drafts overlap as usual.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from mmengine.config import EngineConfig
from mmengine.core.request import ProcessedPrompt, Request, RequestStatus
from mmengine.core.scheduler import Scheduler, SchedulerOutput
from mmengine.encoder_cache.hashing import hash_bytes
from mmengine.encoder_cache.manager import EncoderCacheManager
from mmengine.engine.draft_planner import DraftPlanner
from mmengine.errors import InvalidInputError, UnknownAdapterError
from mmengine.kv_cache.manager import KVCacheManager
from mmengine.lora.manager import LoRAManager
from mmengine.outputs import RequestOutput
from mmengine.runner import ModelRunner
from mmengine.runner.launched_step import LaunchedStep
from mmengine.sample.detokenizer import IncrementalDetokenizer
from mmengine.sample.params import SamplingParams
from mmengine.sample.reasoning import ReasoningGate, opening_token, prompt_opens_reasoning, split_reasoning
from mmengine.sample.structured_output.grammar import GrammarCompiler


@dataclass
class InFlightStep:
    out: SchedulerOutput
    launched: LaunchedStep


class StepLoop:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner, kv_cache: KVCacheManager,
                 encoder_cache: EncoderCacheManager, grammars: GrammarCompiler, loras: LoRAManager | None,
                 tokenizer: Any, eos_token_ids: frozenset[int], async_scheduling: bool) -> None:
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.kv_cache = kv_cache
        self.encoder_cache = encoder_cache
        self.grammars = grammars
        self.loras = loras
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.async_scheduling = async_scheduling
        self.in_flight: InFlightStep | None = None  # async scheduling: the step launched, not yet booked
        self._last_scheduled: SchedulerOutput | None = None  # this advance()'s step, for _recompute_lost_states
        self.pending: list[RequestOutput] = []  # outputs for step() to return (add_request's requests)
        self.owners: dict[str, dict[str, RequestOutput]] = {}  # request id -> its generate() call's results
        # steps_launched_ahead: async scheduling's overlap, steps launched before the step in flight's tokens were read
        self.counters = dict.fromkeys(("steps", "decode_steps", "tokens_computed", "prefill_tokens_computed", "prompt_tokens",
                                       "generation_tokens", "requests_finished", "steps_launched_ahead"), 0)
        # speculative decoding: the drafts each request verifies next, and whether a step may launch ahead of a verify
        self.drafts = DraftPlanner(config, scheduler, getattr(runner, "follows_drafts_on_device", False))
        self._ahead_of: SchedulerOutput | None = None  # launching ahead of a draft head's step: that step's plan
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._opens_reasoning: dict[str, bool] = {}  # with a reasoning parser: the prompt left <think> open
        self._opening_token = opening_token(tokenizer) if config.model_config.reasoning_parser is not None else None
        self._arrivals = itertools.count()

    # -- requests in and out ---------------------------------------------------

    def enqueue(self, processed: ProcessedPrompt, params: SamplingParams, request_id: str | None = None,
                cache_salt: str | None = None, lora_key: str | None = None) -> str:
        """Makes the request and hands it to the scheduler; returns its id (one is made when None)."""
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
            processed = _items_under_adapter(processed, lora_key, self.config.cache_config.prefix_caching_hash_algo)
        generator = self.runner.sampler.make_generator(params, self.runner.device)
        request = Request(request_id, processed, params, arrival, generator, cache_salt=cache_salt, lora_name=lora_key)
        prompt = request.prompt
        if prompt is None and self.config.model_config.reasoning_parser is not None:  # a token prompt
            prompt = self.tokenizer.decode(request.prompt_token_ids)
        if params.structured_output is not None:
            request.grammar = self.grammars.matcher(params.structured_output)
            if self.config.model_config.reasoning_parser is not None:
                request.grammar = ReasoningGate.for_prompt(request.grammar, prompt, self._opening_token)
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, stop=params.stop)
        self.scheduler.add_request(request)
        self._detokenizers[request_id] = detokenizer
        if self.config.model_config.reasoning_parser is not None:
            self._opens_reasoning[request_id] = prompt_opens_reasoning(prompt)
        self.counters["prompt_tokens"] += request.num_prompt_tokens
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stops a request and routes its final output (finish_reason "abort"); False if none is in flight."""
        request = self.scheduler.abort_request(request_id)
        if request is None:
            return False
        detokenizer = self._detokenizers.pop(request_id)
        detokenizer.flush()
        self.runner.penalties.release(request_id)
        self.drafts.forget(request_id)
        self.route(self._output(request, detokenizer))
        self._opens_reasoning.pop(request_id, None)
        return True

    def route(self, output: RequestOutput) -> None:
        """Hands an output to the generate() call that owns its request, else to the next step()."""
        results = self.owners.get(output.request_id)
        if results is None:
            self.pending.append(output)
        elif output.finished:
            results[output.request_id] = output
            del self.owners[output.request_id]

    # -- one step --------------------------------------------------------------

    def has_work(self) -> bool:
        """Requests to run, or a step in flight whose tokens someone still needs (a step left computing
        only for finished requests, e.g. after a stop token, is not waited for)."""
        step = self.in_flight
        if step is not None and all(s.request.is_finished for s in step.out.scheduled):
            self.in_flight = step = None
        return self.scheduler.has_unfinished_requests() or step is not None

    def advance(self) -> None:
        """One step, if there is work; routes each output to its owner (a generate() call, or step()).

        If the step fails (the exception propagates), no request has advanced past what its outputs
        say and the caches' books match the runner's tensors, so advancing again retries it."""
        if not self.has_work():
            return
        self._last_scheduled = None
        try:
            outputs = self._step_async() if self.async_scheduling else self._step()
        except BaseException:
            self._reconcile_encoder_books()
            self._recompute_lost_states()
            raise
        self._last_scheduled = None  # (it would keep the step's requests, and their pictures, alive)
        for output in outputs:
            self.route(output)

    def _step(self) -> list[RequestOutput]:
        out = self._schedule()
        launched = self.runner.launch(out, self._block_tables(out), window_tables=self._window_tables(out))
        if launched.pending is not None:  # the grammars are current: mask while the forward runs
            launched = self.runner.sample(launched)
        outputs = self._outputs(self._book(out, launched))
        if self.drafts.active:
            self.drafts.propose()
        return outputs

    def _book(self, out: SchedulerOutput, launched: LaunchedStep) -> list[Request]:
        """Waits for a step's tokens and books them (a verify step's: the run its samples keep); returns the
        requests that got tokens."""
        sampled = launched.result()
        self.drafts.received(launched)
        # penalized verify steps: their kept tokens go into the penalty counts once kept (a draft head's runner
        # counts them on the device, as soon as it has sampled them)
        verified = [(s.request, s.request.num_output_tokens) for s in out.scheduled
                    if s.draft_token_ids and s.request.sampling_params.penalized and self.drafts.drafter is None]
        updated = self.scheduler.update_from_output(out, sampled, self.eos_token_ids)
        for request, before in verified:
            if request.num_output_tokens > before:
                self.runner.count_kept_tokens(request, request.output_token_ids[before:])
        self.drafts.record_accepted(out.scheduled)
        self._record_logprobs(launched, updated)
        return updated

    def _step_async(self) -> list[RequestOutput]:
        """Books the step in flight with placeholder tokens, schedules and launches the next one, and
        only then waits for the step in flight's tokens.

        A request that stops on a token computes one more step, whose token is discarded. A failure
        before the launch leaves the step in flight to finish normally (its outputs are delivered),
        so the books match the tensors as in a synchronous step.
        """
        previous, self.in_flight = self.in_flight, None
        if previous is not None and self.drafts.resolves_first(previous.out, previous.launched):
            return self._step_after(previous)
        self.drafts.forget_predicted()
        pending = self.scheduler.book_step(previous.out) if previous is not None else []
        try:
            if self.drafts.drafter is not None and previous is not None:
                self._ahead_of = previous.out
                self.drafts.placeholders_to_follow(pending, previous.out.draft_depths)
            out = self._schedule(allow_empty=previous is not None)
            launched = self.runner.launch(out, self._block_tables(out), previous.launched if previous is not None else None,
                                          window_tables=self._window_tables(out))
        except BaseException:
            self._ahead_of = None
            if previous is not None:
                for output in self._resolve(previous, pending):
                    self.route(output)
            raise
        self._ahead_of = None
        step = InFlightStep(out, launched)
        if out.num_scheduled_tokens:
            self.in_flight = step
            self.counters["steps_launched_ahead"] += previous is not None
        try:
            outputs = self._resolve(previous, pending, out) if previous is not None else []
        finally:
            if launched.pending is not None:
                # Constrained rows: their masks need the tokens just resolved, so this step samples
                # now, while its forward runs on the device.
                step.launched = self.runner.sample(launched)
        if self.drafts.proposer is not None:
            self.drafts.expected = self.drafts.expect()
        return outputs

    def _step_after(self, previous: InFlightStep) -> list[RequestOutput]:
        """Async scheduling with speculation, when the next step needs the step in flight's tokens: books
        them, proposes drafts that follow them, launches the next step and returns the outputs while it
        runs. A failure before the launch delivers the booked outputs (the books match the tensors)."""
        # (the outputs come before the drafts: after_token feeds the tokens to the grammars, which check the drafts,
        # and a grammar's end or a stop string inside the run cuts it before any draft follows it)
        outputs = self._outputs(self._book(previous.out, previous.launched))
        try:
            self.drafts.propose()
            out = self._schedule()
            launched = self.runner.launch(out, self._block_tables(out), window_tables=self._window_tables(out))
        except BaseException:
            for output in outputs:
                self.route(output)
            raise
        step = InFlightStep(out, launched)
        if out.num_scheduled_tokens:
            self.in_flight = step
        if launched.pending is not None:  # the grammars have the tokens just booked
            step.launched = self.runner.sample(launched)
        drafting = any(s.draft_token_ids for s in out.scheduled)
        self.drafts.expected = drafting
        if self.drafts.proposer is not None and not drafting:
            self.drafts.expected = self.drafts.expect()
        return outputs

    def _resolve(self, step: InFlightStep, pending: list[Request], following: SchedulerOutput | None = None) -> list[RequestOutput]:
        sampled = step.launched.result()  # the wait for the device
        if self.drafts.drafter is not None:  # verify rows' runs; `following`'s rows move on by the drafts kept
            booked = {id(request) for request in pending}
            rows = [s for s in step.out.scheduled if id(s.request) in booked]
            updated = self.scheduler.resolve_runs(rows, sampled, self.eos_token_ids, step.launched.drafts(raw=True), following)
            self.drafts.record_accepted(rows)
        else:
            updated = self.scheduler.resolve_tokens(pending, sampled, self.eos_token_ids)
        self._record_logprobs(step.launched, updated)
        return self._outputs(updated)

    def _schedule(self, allow_empty: bool = False) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self._last_scheduled = out
        if out.kv_offloads or out.kv_restores:
            self._copy_kv_blocks(out)
        if self.loras is not None:
            self._activate_loras(out)
        if out.is_empty and not allow_empty and self.scheduler.has_unfinished_requests():
            raise RuntimeError(f"scheduler made no progress: {self.scheduler.running + list(self.scheduler.waiting)}")
        self.counters["steps"] += not out.is_empty
        self.counters["decode_steps"] += any(s.num_new_tokens and s.start >= s.request.num_prompt_tokens for s in out.scheduled)
        self.counters["tokens_computed"] += out.num_scheduled_tokens
        self.counters["prefill_tokens_computed"] += sum(
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
        if self.drafts.drafter is not None:
            self.counters["tokens_computed"] -= self.drafts.take_draft_blocks(out, self._ahead_of)  # (_schedule counted them)
        return {s.request.request_id: self.kv_cache.block_ids(s.request.request_id) for s in out.scheduled}

    def _window_tables(self, out: SchedulerOutput) -> dict[str, list[int]] | None:
        """The sliding-window pool's block tables (None without one)."""
        caches = self.scheduler.caches
        if caches.windows is None:
            return None
        return {s.request.request_id: caches.windows.block_ids(s.request.request_id) for s in out.scheduled}

    def _recompute_lost_states(self) -> None:
        """After a failed step, a hybrid model's requests in it recompute from a checkpoint (preempted):
        the step may have advanced their recurrent states in place, which running it again would
        apply twice. (KV writes are idempotent; a state update is not.)"""
        out, self._last_scheduled = self._last_scheduled, None
        if self.scheduler.states is None or out is None:
            return
        for s in out.scheduled:
            if s.num_new_tokens > 0:
                self.scheduler.recompute(s.request.request_id)

    def _reconcile_encoder_books(self) -> None:
        """After a failed step: the encoder cache books exactly the outputs the runner holds.

        Nothing advanced (no request's computed tokens moved), so the step can simply run again,
        except that entries booked for encodes that never ran must not look encoded: they are
        unbooked and their requests encode them next time. Outputs whose entries were evicted go.
        """
        self.encoder_cache.take_freed()
        stale = self.encoder_cache.take_stale_freed()
        outputs = self.runner.encoder_outputs
        self.scheduler.forget_encoder_entries([h for h in self.encoder_cache.entries if h not in outputs])
        self.runner.free_encoder_outputs([h for h in outputs if h not in self.encoder_cache.entries], stale)

    # -- the step's tokens -----------------------------------------------------

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
                if request.request_id in logprobs:  # one entry per token it got (a verify step's rows go on past them)
                    new = request.num_output_tokens - len(request.output_logprobs)
                    request.output_logprobs.extend(logprobs[request.request_id][:new])

    def _outputs(self, updated: list[Request]) -> list[RequestOutput]:
        outputs = (self.after_token(request) for request in updated)
        return [output for output in outputs if output is not None]

    def after_token(self, request: Request) -> RequestOutput | None:
        """Detokenizes the request's new tokens (one, or a verify step's run) and applies stop strings.
        Returns its output, or None for an unfinished request of a generate() call (which reads only final
        outputs): such a request's tokens are decoded all at once when it finishes, unless it has stop strings."""
        detokenizer = self._detokenizers[request.request_id]
        gate = request.grammar if isinstance(request.grammar, ReasoningGate) else None
        streamed = request.request_id not in self.owners or bool(request.sampling_params.stop) or gate is not None
        last = request.num_output_tokens - 1
        for index in range(detokenizer.num_appended, last + 1):
            token = request.output_token_ids[index]
            stop_string = detokenizer.append(token, decode=streamed)
            self.counters["generation_tokens"] += 1
            # a verify step's run may go on past where a stop string or the grammar ends the output (the
            # scheduler has cut it only at stop tokens and the length): that token ends it, as it would have
            ends_here = not request.is_finished or index < last
            ended = False
            if stop_string is not None and ends_here:
                ended = self._end_at(request, index, stop_string)
            elif request.grammar is not None and ends_here and _grammar_done(request.grammar, token):
                ended = self._end_at(request, index, None)
            if gate is not None:
                gate.see(detokenizer.text)
            if ended or stop_string is not None:
                break
        if request.is_finished:
            detokenizer.flush()  # release a trailing partial character held back while streaming
            del self._detokenizers[request.request_id]
            output = self._output(request, detokenizer)
            self._opens_reasoning.pop(request.request_id, None)
            self.runner.penalties.release(request.request_id)
            self.drafts.forget(request.request_id)
            self.counters["requests_finished"] += 1
            return output
        if request.request_id in self.owners:
            return None
        return self._output(request, detokenizer)

    def _end_at(self, request: Request, index: int, reason: str | None) -> bool:
        """The output ends with output token `index` (a stop string, or the grammar's end): a verify step's
        later tokens go, and the request stops for `reason` (a stop token or the length limit that the
        scheduler found later in the run gives way to this earlier end)."""
        _drop_tokens_after(request, index)
        request.stop_reason = reason
        if request.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        return True

    def _output(self, request: Request, detokenizer: IncrementalDetokenizer) -> RequestOutput:
        text, reasoning = detokenizer.text, None
        if self.config.model_config.reasoning_parser is not None:
            split = split_reasoning(text, self._opens_reasoning.get(request.request_id, False), final=request.is_finished)
            text, reasoning = split.content, split.reasoning
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=text,
            reasoning_content=reasoning,
            finish_reason=request.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            stop_reason=request.stop_reason,
            logprobs=list(request.output_logprobs) if request.sampling_params.logprobs is not None else None,
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
        )


def _drop_tokens_after(request: Request, index: int) -> None:
    """A stop string ended the output at output token `index`: a verify step's later tokens go (without
    speculation they would never have been sampled)."""
    extra = request.num_output_tokens - index - 1
    if extra:
        del request.output_token_ids[index + 1 :], request.all_token_ids[-extra:]
        del request.output_logprobs[index + 1 :]


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
