"""Scheduler: decides, every step, which requests compute how many tokens.

vLLM v1 style: a request has `num_computed_tokens` and a step gives each scheduled
request some new tokens, so prefill chunks and decodes share one token budget. When
KV blocks run out, the most recently admitted running request is preempted (its
blocks are freed and it is recomputed later from its prompt and outputs so far).
No tensors here: the scheduler decides, the managers keep books, the runner computes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mmengine.config import EngineConfig
from mmengine.kv_cache.manager import KVCacheManager
from mmengine.request import Request, RequestStatus


# A waiting request skipped this many times (later requests admitted ahead of it) stops
# anything behind it from being admitted until it is: bounded skipping, no starvation.
MAX_ADMISSION_SKIPS = 16
# How many unadmittable waiting requests one step looks past before it stops searching.
MAX_ADMISSION_LOOKAHEAD = 32


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (= num_computed_tokens when scheduled)
    num_new_tokens: int
    encoder_items: list[int]  # indices of the request's mm items to encode this step

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token, so its logits give a new token."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # (request_id, item index) pairs whose encoder outputs are no longer needed
    freed_encoder_outputs: list[tuple[str, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # Encoder outputs the runner holds, per request (item indices). Outputs live until the
        # item's placeholder run is fully computed, or the request leaves the running set.
        self._encoded: dict[str, set[int]] = {}
        self._freed_encoder_outputs: list[tuple[str, int]] = []
        self.num_preemptions = 0

    # -- queue management -------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.kv_cache.hash_new_blocks(request)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        assert status.is_finished, status
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        self._release(request)
        del self.requests[request.request_id]

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    # -- scheduling -------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # Running requests first, in admission order: decodes and unfinished prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, request
            while not self.kv_cache.can_allocate(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                self.kv_cache.allocate(request, num_new)
                out.scheduled.append(self._make_scheduled(request, num_new))
                budget -= num_new
                i += 1
                continue
            break

        # Then admit waiting requests, oldest first, unless this step had to preempt.
        if not out.preempted_ids:
            self._admit_waiting(out, budget)

        out.freed_encoder_outputs = self._freed_encoder_outputs
        self._freed_encoder_outputs = []
        return out

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admits waiting requests in order, charging only uncached tokens and blocks.

        A request that cannot be admitted now (not enough free blocks, or its next uncached
        block is being computed by a running request and will be a hit soon) is skipped so
        smaller or cache-friendlier requests behind it can run. Skipping is bounded: a request
        skipped MAX_ADMISSION_SKIPS times blocks everything behind it until it is admitted.
        """
        in_flight = self._blocks_in_flight()
        index = 0
        skipped: list[Request] = []
        while (
            index < len(self.waiting)
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(skipped) <= MAX_ADMISSION_LOOKAHEAD
        ):
            request = self.waiting[index]
            fresh = request.num_computed_tokens == 0
            hits = self.kv_cache.get_computed_blocks(request) if fresh else []
            # A full hit still recomputes the last token: its logits are needed.
            num_computed = min(len(hits) * self.config.block_size, request.num_tokens - 1) if hits else request.num_computed_tokens
            num_new = min(request.num_tokens - num_computed, budget)
            starving = request.num_admission_skips >= MAX_ADMISSION_SKIPS
            wait_for_hit = not starving and len(hits) < len(request.block_hashes) and request.block_hashes[len(hits)] in in_flight
            if wait_for_hit or not self.kv_cache.can_allocate(request, num_new, hits, num_computed):
                if starving:
                    break
                skipped.append(request)
                index += 1
                continue
            del self.waiting[index]
            self.kv_cache.allocate(request, num_new, hits, num_computed)
            if fresh:
                self.kv_cache.record_lookup(request.num_tokens, num_computed)
                if request.num_preemptions == 0:
                    request.num_cached_tokens = num_computed
            request.num_computed_tokens = num_computed
            request.num_prefix_hit_tokens = len(hits) * self.config.block_size
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._make_scheduled(request, num_new))
            in_flight.update(self._pending_block_hashes(request))
            budget -= num_new
            for earlier in skipped:
                earlier.num_admission_skips += 1

    def _blocks_in_flight(self) -> set[bytes]:
        """Hashes of prompt blocks that running requests are still computing (future cache hits)."""
        if not self.kv_cache.enable_prefix_caching:
            return set()
        return {h for request in self.running for h in self._pending_block_hashes(request)}

    def _pending_block_hashes(self, request: Request) -> list[bytes]:
        if not self.kv_cache.enable_prefix_caching:
            return []
        return request.block_hashes[request.num_computed_tokens // self.config.block_size :]

    def _make_scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        assert num_new > 0 and start + num_new <= request.num_tokens, (request, num_new)
        encoded = self._encoded.setdefault(request.request_id, set())
        to_encode = [
            idx
            for idx, item in enumerate(request.mm_items)
            if item.overlaps(start, start + num_new) and idx not in encoded
        ]
        encoded.update(to_encode)
        return ScheduledRequest(request, start, num_new, to_encode)

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_prefix_hit_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.kv_cache.free(request)
        for idx in sorted(self._encoded.pop(request.request_id, ())):
            self._freed_encoder_outputs.append((request.request_id, idx))

    # -- after the model ran ---------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int], eos_token_ids: frozenset[int]
    ) -> list[Request]:
        """Advances the scheduled requests; returns those that got a new token this step."""
        updated = []
        for s in out.scheduled:
            request = s.request
            if request.is_finished:  # aborted between schedule() and now
                continue
            request.num_computed_tokens = s.end
            self.kv_cache.cache_blocks(request)
            self._drop_consumed_encoder_outputs(request)
            if request.request_id not in sampled:
                continue
            token = sampled[request.request_id]
            request.append_output_token(token)
            self.kv_cache.hash_new_blocks(request)
            status = self._check_stop(request, token, eos_token_ids)
            if status is not None:
                self.finish_request(request, status)
            updated.append(request)
        return updated

    def _drop_consumed_encoder_outputs(self, request: Request) -> None:
        encoded = self._encoded.get(request.request_id)
        if not encoded:
            return
        done = {idx for idx in encoded if request.mm_items[idx].end <= request.num_computed_tokens}
        if done:
            encoded -= done
            self._freed_encoder_outputs.extend((request.request_id, idx) for idx in sorted(done))

    def _check_stop(self, request: Request, token: int, eos_token_ids: frozenset[int]) -> RequestStatus | None:
        params = request.sampling_params
        if not params.ignore_eos and token in eos_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
