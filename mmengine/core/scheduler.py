"""Scheduler: decides, every step, which requests compute how many tokens and which items to encode.

vLLM v1 style: a request has `num_computed_tokens` and a step gives each scheduled request
some new tokens, so prefill chunks and decodes share one token budget. Images are encoded
whole, once per step at most, against a per-step encoder budget, and their outputs are shared
through the global encoder cache. When the encoder budget or cache cannot take an item, the
request computes only the text before it, or zero tokens: it keeps its blocks and stays in the
batch. When KV blocks run out, the most recently admitted running request is preempted (its
blocks are freed and it is recomputed later from its prompt and outputs so far). Prefix-sharing holds
give way first: every hold that keeps a block no running request uses, in the KV pool or the window
pool, goes before anyone is preempted. So no hold stands between the oldest running request and the
blocks of its next chunk: it runs alone at worst, and a lone request always fits (see prefix_sharing.py).
No tensors here: the scheduler decides, the managers keep books, the runner computes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from mmengine.config import EngineConfig
from mmengine.encoder_cache.host_tier import EncoderHostTier
from mmengine.encoder_cache.manager import EncoderCacheManager
from mmengine.kv_cache.manager import KVCacheManager
from mmengine.kv_cache.coordinator import CacheCoordinator, PrefixHit
from mmengine.kv_cache.recurrent_state import RecurrentStateManager, StatePlan
from mmengine.kv_cache.sliding_window import SlidingWindowManager
from mmengine.core.prefix_sharing import PrefixSharing
from mmengine.core.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from mmengine.spec.verify import SpecCounters, accepted_prefix

# A waiting request skipped this many times (later requests admitted ahead of it) stops
# anything behind it from being admitted until it is: bounded skipping, no starvation.
MAX_ADMISSION_SKIPS = 16
# How many unadmittable waiting requests one step looks past before it stops searching.
MAX_ADMISSION_LOOKAHEAD = 32


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step (= num_computed_tokens when scheduled)
    num_new_tokens: int  # may be 0: the request keeps its place and blocks but computes nothing
    encoder_items: list[int]  # indices of the request's mm items to encode this step
    restored_items: list[int] = field(default_factory=list)  # items copied back from the host tier this step
    state: StatePlan | None = None  # hybrid models: the recurrent state's slot, start and checkpoints this step
    # Speculative decoding: draft tokens computed after the request's last token (the last num_new_tokens - 1
    # positions); every position is sampled and the drafts the samples repeat are kept (spec/verify.py)
    draft_token_ids: list[int] = field(default_factory=list)
    num_accepted: int | None = None  # of those, how many the step's samples kept (set when it is booked)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token, so its logits give a new token."""
        return self.num_new_tokens > 0 and self.end == self.request.num_tokens + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    freed_encoder_hashes: list[str] = field(default_factory=list)  # evicted: the runner drops them
    stale_encoder_hashes: list[str] = field(default_factory=list)  # of those, made before a reset: kept nowhere
    kv_offloads: list = field(default_factory=list)  # KVCopy: evicted blocks' KV to the host tier, before the forward
    kv_restores: list = field(default_factory=list)  # KVCopy: host-tier hits' KV back into their new blocks
    lora_slots: dict[str, int] = field(default_factory=dict)  # request id -> its adapter's device slot (set by the engine)
    encoder_lora_slots: dict[str, int] = field(default_factory=dict)  # the same, for adapters on the vision side
    # A draft head's chain length for each sampling request, at most (set by the engine; None: every request the full k)
    draft_depths: dict[str, int] | None = None
    # Recurrent states to copy (source slot, checkpoint slot) before anything else of the step: the checkpoints of
    # rows launched ahead of their verify step, booked once their positions were known (Scheduler.resolve_runs)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_encoder_items(self) -> int:
        return sum(len(s.encoder_items) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return self.num_scheduled_tokens == 0 and self.num_encoder_items == 0


@dataclass
class EncoderPlan:
    """What one request's chunk needs from the encoder cache."""

    encode: list[int] = field(default_factory=list)  # misses: items to encode
    reuse: list[int] = field(default_factory=list)  # resident, or encoded this step by another request
    cost: int = 0  # embeddings to encode
    restore: list[int] = field(default_factory=list)  # misses the host tier holds: copied back, not encoded
    restore_room: int = 0  # their embeddings (cache room, no encoder budget)


@dataclass
class _Admission:
    """What admitting a waiting request now takes (Scheduler._plan_admission)."""

    hit: PrefixHit  # its cached prefix, in every cache group
    num_new: int  # tokens it computes this step
    plan: EncoderPlan  # the encoder work those tokens need

    @property
    def num_computed(self) -> int:
        return self.hit.num_computed


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache: KVCacheManager,
        encoder_cache: EncoderCacheManager,
        encoder_compute_budget: int,
        max_model_len: int,
        encoder_host_tier: EncoderHostTier | None = None,
        states: RecurrentStateManager | None = None,
        whole_span_modalities: frozenset[str] = frozenset(),
        windows: SlidingWindowManager | None = None,
    ) -> None:
        """`states`: the recurrent-state books of a hybrid model (None for attention-only models).
        `windows`: the sliding-window layers' pool (None: every cached layer keeps every token).
        `whole_span_modalities`: items whose placeholder tokens attend to each other both ways (Gemma 4's
        pictures): a prefill chunk never ends inside one, so every query of a span sees all of it."""
        self.config = config
        self.whole_span_modalities = whole_span_modalities
        self.caches = CacheCoordinator(kv_cache, states, config.cache_config.block_size, windows)
        self.encoder_host_tier = encoder_host_tier  # asked whether a missing item can be copied back
        self.kv_cache = kv_cache
        self.encoder_cache = encoder_cache
        self.encoder_compute_budget = encoder_compute_budget
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._held: dict[str, set[int]] = {}  # item indices each request holds an encoder reference for
        self.num_preemptions = 0
        self.num_reencodes_after_prefix_hit = 0
        self.num_zero_token_schedules = 0  # running requests held back a step by the encoder budget
        self.spec = SpecCounters(config.spec_config.num_speculative_tokens)
        # for the next step's SchedulerOutput.state_copies, by the request whose row launched ahead saves them
        self._state_copies: dict[str, list[tuple[int, int]]] = {}
        # Prefix-sharing groups of batches, their held blocks, and cache-affinity admission.
        self.sharing = PrefixSharing(kv_cache, config.cache_config.block_size, max_model_len, config.scheduler_config.enable_prefix_grouping, windows)

    @property
    def states(self) -> RecurrentStateManager | None:
        """A hybrid model's recurrent-state books (None for attention-only models)."""
        return self.caches.states

    # -- queue management -------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.kv_cache.hash_new_blocks(request)
        self.waiting.append(request)

    def group_batch(self, request_ids: list[str]) -> None:
        """Reorders a batch of just-added requests (the last ones queued) group by group."""
        batch = [self.requests[request_id] for request_id in request_ids]
        assert list(self.waiting)[len(self.waiting) - len(batch) :] == batch, "the batch is the tail of the queue"
        ordered = self.sharing.plan(batch)
        for _ in batch:
            self.waiting.pop()
        self.waiting.extend(ordered)

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
        self.sharing.finished(request)
        del self.requests[request.request_id]

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    # -- scheduling -------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.scheduler_config.max_num_batched_tokens
        encoder_budget = self.encoder_compute_budget
        encoding_now: set[str] = set()  # mm_hashes encoded this step

        # Running requests first, in admission order: decodes and unfinished prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            start = request.num_computed_tokens
            drafts = self._drafts_of(request, budget)
            num_new = self._whole_spans(request, start, min(request.num_tokens - start + len(drafts), budget))
            num_new, plan = self._plan_encoder(request, start, num_new, encoder_budget, encoding_now)
            if num_new == 0:
                self.num_zero_token_schedules += 1
                out.scheduled.append(ScheduledRequest(request, start, 0, []))
                i += 1
                continue
            while not self.caches.can_allocate(request, num_new):
                if drafts:  # drafts are optional: they go before any hold or request
                    num_new, drafts = num_new - len(drafts), []
                    continue
                if self.sharing.release_idle_hold():  # holds give way before any request (either pool)
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                request.spec_token_ids = drafts
                scheduled = self._commit(request, start, num_new, plan, encoding_now)
                scheduled.draft_token_ids, request.spec_token_ids = drafts, []
                scheduled.state = self.caches.plan_running(request, start, num_new, len(drafts))
                out.scheduled.append(scheduled)
                budget -= num_new
                encoder_budget -= plan.cost
                i += 1
                continue
            break

        # Then admit waiting requests, unless this step had to preempt.
        if not out.preempted_ids:
            self._admit_waiting(out, budget, encoder_budget, encoding_now)
        if out.is_empty and self.waiting and self.sharing.release_idle_holds():  # held blocks stalled everything
            self._admit_waiting(out, budget, encoder_budget, encoding_now)
        out.freed_encoder_hashes = self.encoder_cache.take_freed()
        out.stale_encoder_hashes = self.encoder_cache.take_stale_freed()
        out.kv_offloads, out.kv_restores = self.kv_cache.take_copies()
        out.state_copies = [copy for copies in self._state_copies.values() for copy in copies]
        self._state_copies = {}
        return out

    def _drafts_of(self, request: Request, budget: int) -> list[int]:
        """The request's drafts that this step can verify: a decode's (its one uncomputed token is its last,
        and no picture lies ahead), as many as the token budget holds after that token. Taken once: a
        request not scheduled this step drops them (the next step proposes again)."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or request.num_tokens - request.num_computed_tokens != 1:
            return []
        if request.mm_items and request.mm_items[-1].end > request.num_computed_tokens:
            return []
        return drafts[: max(0, budget - 1)]

    def _admit_waiting(self, out: SchedulerOutput, budget: int, encoder_budget: int, encoding_now: set[str]) -> None:
        """Admits waiting requests, charging only uncached tokens and blocks. They are tried in queue
        order or, with prefix grouping on, longest cached prefix first; members of prefix-sharing
        groups must also pass the groups' KV gate (see prefix_sharing.py).

        A request that cannot be admitted now (not enough free blocks, no encoder budget or room
        for its next image, or its next uncached block is being computed by a running request
        and will be a hit soon) is skipped so that requests behind it can run. Skipping is
        bounded: a request skipped MAX_ADMISSION_SKIPS times blocks everything behind it.
        """
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.scheduler_config.max_num_seqs:
            return
        in_flight = self._blocks_in_flight()
        window = MAX_ADMISSION_LOOKAHEAD + self.config.scheduler_config.max_num_seqs - len(self.running) + 1
        candidates = self.sharing.admission_order(self.waiting, window, MAX_ADMISSION_SKIPS)
        self.sharing.begin_admission(self.running)
        skipped: list[Request] = []
        admitted: list[int] = []  # queue positions
        adapters = {r.lora_name for r in self.running if r.lora_name is not None}  # each needs a device slot
        for position, request in candidates:
            if budget <= 0 or len(self.running) >= self.config.scheduler_config.max_num_seqs or len(skipped) > MAX_ADMISSION_LOOKAHEAD:
                break
            starving = request.num_admission_skips >= MAX_ADMISSION_SKIPS
            if self.sharing.surely_refused(request, starving):
                skipped.append(request)
                continue
            if request.lora_name is not None and request.lora_name not in adapters and len(adapters) >= self.config.lora_config.max_loras:
                if starving:  # its adapter gets a slot once the running ones drain
                    break
                skipped.append(request)
                continue
            admission = self._plan_admission(request, budget, encoder_budget, encoding_now)
            num_hit_blocks, num_computed, num_new = admission.hit.num_hit_blocks, admission.num_computed, admission.num_new
            wait_for_hit = (
                not starving and num_hit_blocks < len(request.block_hashes) and request.block_hashes[num_hit_blocks] in in_flight
            )
            fits = self.caches.can_allocate(request, num_new, admission.hit, num_computed)
            while not fits and starving and self.sharing.release_idle_hold():
                fits = self.caches.can_allocate(request, num_new, admission.hit, num_computed)
            if wait_for_hit or num_new == 0 or not fits or not self.sharing.admits(request, admission.hit.hits, num_computed, starving):
                if starving:
                    break
                skipped.append(request)
                continue
            out.scheduled.append(self._admit(request, admission, encoding_now))
            if request.lora_name is not None:
                adapters.add(request.lora_name)
            in_flight.update(self._pending_block_hashes(request))
            budget -= num_new
            encoder_budget -= admission.plan.cost
            admitted.append(position)
        if admitted:
            _count_skips(candidates, admitted, window)

    def _plan_admission(self, request: Request, budget: int, encoder_budget: int, encoding_now: set[str]) -> _Admission:
        """What admitting the request now would take: its cached prefix (device blocks, then host blocks),
        the tokens it computes within the budget, and the encoder work they need."""
        # Prompt logprobs need every prompt position computed: such a request reads no cached blocks.
        hit = self.caches.find_hit(request, request.sampling_params.prompt_logprobs is not None, self._can_pin)
        while True:
            num_new = self._whole_spans(request, hit.num_computed, min(request.num_tokens - hit.num_computed, budget))
            num_new, plan = self._plan_encoder(request, hit.num_computed, num_new, encoder_budget, encoding_now)
            if not hit.host_hits or self._plan_pinned_items(request, hit.host_hits, plan, encoding_now):
                return _Admission(hit, num_new, plan)
            hit = self.caches.without_host_hits(request, hit)  # the pictures its host blocks pin do not fit now: compute them

    def _admit(self, request: Request, admission: _Admission, encoding_now: set[str]) -> ScheduledRequest:
        """Moves the request from waiting to running with its first chunk scheduled."""
        num_computed = admission.num_computed
        hit = admission.hit
        scheduled = self._commit(request, num_computed, admission.num_new, admission.plan, encoding_now, hit)
        scheduled.state = self.caches.plan_admitted(request, hit, admission.num_new)
        self.waiting.remove(request)
        self.kv_cache.record_lookup(request.num_tokens, num_computed)
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_computed
        request.num_computed_tokens = num_computed
        request.num_prefix_hit_tokens = hit.num_hit_blocks * self.config.cache_config.block_size
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.sharing.admitted(request, num_computed)
        return scheduled

    def _can_pin(self, mm_hash: str) -> bool:
        """Whether a host-tier block pinning this picture can come back: its output is resident, or the
        encoder host tier holds it (it is copied back too), so the block never needs it re-encoded."""
        return mm_hash in self.encoder_cache or (self.encoder_host_tier is not None and self.encoder_host_tier.holds(mm_hash))

    def _plan_pinned_items(self, request: Request, host_hits: list, plan: EncoderPlan, encoding_now: set[str]) -> bool:
        """Adds to `plan` the pictures the host hits pin (referenced while the request is admitted, so
        the blocks' pins find them resident); False when the copies back would not fit the cache."""
        pinned = {mm_hash for entry in host_hits for mm_hash in entry.pins}
        planned = {request.mm_items[i].mm_hash for i in plan.reuse + plan.encode + plan.restore}
        for idx, item in enumerate(request.mm_items):
            if item.mm_hash not in pinned or item.mm_hash in planned:
                continue
            planned.add(item.mm_hash)
            if item.mm_hash in self.encoder_cache or item.mm_hash in encoding_now:
                plan.reuse.append(idx)
            else:
                plan.restore.append(idx)
                plan.restore_room += item.length
        reused = [request.mm_items[j].mm_hash for j in plan.reuse]
        return self.encoder_cache.can_allocate(plan.cost + plan.restore_room, reused)

    def _whole_spans(self, request: Request, start: int, num_new: int) -> int:
        """num_new shortened so that the chunk [start, start + num_new) does not end strictly inside a
        span: to the span's start, or to nothing when the chunk starts inside it (a prefix hit may end
        there: the cached part was computed whole, and the rest waits for a budget that holds it)."""
        end = start + num_new
        for item in request.mm_items:
            if item.offset >= end:
                break
            if item.offset < end < item.end and item.modality in self.whole_span_modalities:
                return max(0, item.offset - start)
        return num_new

    def _plan_encoder(
        self, request: Request, start: int, num_new: int, encoder_budget: int, encoding_now: set[str]
    ) -> tuple[int, EncoderPlan]:
        """Walks the items overlapping [start, start + num_new) and shortens num_new before the
        first item that can be neither reused nor encoded this step (possibly to zero)."""
        plan = EncoderPlan()
        if not request.mm_items or request.mm_items[-1].end <= start:  # text only from here on (decodes)
            return num_new, plan
        held = self._held.get(request.request_id, ())
        planned: set[str] = set()
        for idx, item in enumerate(request.mm_items):
            if item.offset >= start + num_new:
                break
            if item.end <= start or idx in held:
                continue  # wholly computed already (e.g. inside a prefix hit), or referenced since an earlier chunk
            if item.mm_hash in encoding_now or item.mm_hash in planned or item.mm_hash in self.encoder_cache:
                plan.reuse.append(idx)
                continue
            reused = [request.mm_items[j].mm_hash for j in plan.reuse]
            room = plan.cost + plan.restore_room + item.length
            host = self.encoder_host_tier is not None and self.encoder_host_tier.holds(item.mm_hash)
            over_budget = not host and plan.cost + item.length > encoder_budget
            if over_budget or not self.encoder_cache.can_allocate(room, reused):
                num_new = max(0, item.offset - start)  # compute the text before the item, or nothing
                break
            planned.add(item.mm_hash)
            if host:  # a copy back costs no encoder budget, only cache room
                plan.restore.append(idx)
                plan.restore_room += item.length
                continue
            plan.encode.append(idx)
            plan.cost += item.length
        assert num_new >= 0, (request, start, num_new)
        return num_new, plan

    def _commit(
        self,
        request: Request,
        start: int,
        num_new: int,
        plan: EncoderPlan,
        encoding_now: set[str],
        hit: PrefixHit | None = None,
    ) -> ScheduledRequest:
        """Takes the KV blocks and encoder entries a planned chunk needs: all of them, or (when a
        check fails) none. Reuse references are added before new encodes allocate, so an allocation
        can never evict an entry this same chunk is about to reuse."""
        assert num_new > 0 and start + num_new <= request.num_tokens + len(request.spec_token_ids), (request, start, num_new)
        if not plan.encode and not plan.reuse and not plan.restore:  # text only: just the KV blocks
            if not self.caches.can_allocate(request, num_new, hit, start):
                raise RuntimeError(f"KV blocks for {request} are no longer free")
            self.caches.allocate(request, num_new, hit, start)
            return ScheduledRequest(request, start, num_new, [])
        items = request.mm_items
        planned = {items[idx].mm_hash for idx in plan.encode + plan.restore}
        resident = [idx for idx in plan.reuse if items[idx].mm_hash in self.encoder_cache]
        shared = [idx for idx in plan.reuse if items[idx].mm_hash not in self.encoder_cache]
        if any(items[idx].mm_hash not in planned for idx in shared) or any(
            items[idx].mm_hash in self.encoder_cache for idx in plan.encode + plan.restore
        ):
            raise RuntimeError(f"stale encoder plan for {request}: {plan}")
        if not self.encoder_cache.can_allocate(plan.cost + plan.restore_room, [items[idx].mm_hash for idx in resident]):
            raise RuntimeError(f"encoder plan for {request} no longer fits the encoder cache: {plan}")
        if not self.caches.can_allocate(request, num_new, hit, start):
            raise RuntimeError(f"KV blocks for {request} are no longer free")

        held = self._held.setdefault(request.request_id, set())
        for idx in resident:
            self.encoder_cache.add_reference(items[idx].mm_hash, (request.request_id, idx))
            self.encoder_cache.num_hits += 1
            held.add(idx)
        for idx in plan.encode:
            item = items[idx]
            self.encoder_cache.allocate(item.mm_hash, item.length, (request.request_id, idx))
            self.encoder_cache.num_misses += 1
            encoding_now.add(item.mm_hash)
            held.add(idx)
            if item.offset < start:  # part of this item's KV came from the prefix cache
                self.num_reencodes_after_prefix_hit += 1
        for idx in plan.restore:  # booked like an encode; the runner copies the output back instead
            item = items[idx]
            self.encoder_cache.allocate(item.mm_hash, item.length, (request.request_id, idx))
            encoding_now.add(item.mm_hash)
            held.add(idx)
        for idx in shared:  # the same picture shown twice in this chunk: its encode is above
            self.encoder_cache.add_reference(items[idx].mm_hash, (request.request_id, idx))
            self.encoder_cache.num_hits += 1
            held.add(idx)
        # After the encoder bookings: a host-tier block that pins a picture re-pins its (now resident) entry.
        self.caches.allocate(request, num_new, hit, start)
        return ScheduledRequest(request, start, num_new, list(plan.encode), list(plan.restore))

    def _blocks_in_flight(self) -> set[bytes]:
        """Hashes of blocks that running requests are still computing (future cache hits)."""
        return {h for request in self.running for h in self._pending_block_hashes(request)}

    def _pending_block_hashes(self, request: Request) -> list[bytes]:
        if not self.kv_cache.enable_prefix_caching:
            return []
        return request.block_hashes[request.num_computed_tokens // self.config.cache_config.block_size :]

    def recompute(self, request_id: str) -> None:
        """Sends a running request back to the queue to compute again from its first token (its
        blocks freed): after a step whose copies into its blocks could not be made."""
        request = self.requests.get(request_id)
        if request is not None and request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._preempt(request)

    def _preempt(self, request: Request) -> None:
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_prefix_hit_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        self.caches.release(request)
        copies = self._state_copies.pop(request.request_id, None)
        if copies:
            # its row launched ahead ends unbooked (a stop string in the run before it, an abort, a preemption): the
            # saves the release dropped are copied nowhere; those it registered (computed already) still are
            registered = set(self.states.checkpoint_slots().values())
            kept = [copy for copy in copies if copy[1] in registered]
            if kept:
                self._state_copies[request.request_id] = kept
        for idx in self._held.pop(request.request_id, ()):
            self.encoder_cache.release(request.mm_items[idx].mm_hash, (request.request_id, idx))

    def forget_encoder_entries(self, mm_hashes: list[str]) -> None:
        """Unbooks encoder entries whose outputs do not exist (a failed step never computed them).
        Requests that referenced them plan them again: their next chunk encodes them."""
        for mm_hash in mm_hashes:
            for request_id, idx in self.encoder_cache.drop(mm_hash):
                self._held[request_id].discard(idx)

    # -- after the model ran ---------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int | list[int]], eos_token_ids: frozenset[int]
    ) -> list[Request]:
        """Advances the scheduled requests; returns those that got new tokens this step. `sampled`: each
        sampling request's token, or its tokens at every position of the step (a verify step's). No step is in
        flight here, so the blocks a running request holds past its tokens (drafts it did not keep, a draft head's
        chain) go back."""
        updated = []
        for s in out.scheduled:
            request = s.request
            samples = sampled.get(request.request_id)
            if s.draft_token_ids and samples is not None and not request.is_finished:
                token = self._book_verified(s, samples, eos_token_ids)
            elif not self._book_computed(s) or samples is None:
                continue
            else:
                token = _last(samples)
            request.append_output_token(token)
            self.kv_cache.hash_new_blocks(request)
            status = RequestStatus.FINISHED_STOPPED if self._stops_on(request, token, eos_token_ids) else None
            if status is None and self._reached_length(request):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self.finish_request(request, status)
            elif request.status == RequestStatus.RUNNING:  # nothing is in flight: its blocks past its tokens go
                self.caches.free_past(request, request.num_tokens)
            updated.append(request)
        return updated

    def _book_verified(self, s: ScheduledRequest, samples: list[int], eos_token_ids: frozenset[int]) -> int:
        """A verify step (spec/verify.py): appends the drafts the samples accept, cut after a stop token or at
        the length limit, books the positions computed with them, rolls a hybrid model's state back to the
        last of those, and returns the token that follows them (appended by the caller, as a decode's)."""
        request = s.request
        accepted = s.num_accepted = accepted_prefix(s.draft_token_ids, samples)
        self.spec.record(len(s.draft_token_ids), accepted)
        emitted = self._cut(request, samples[: accepted + 1], eos_token_ids)
        for token in emitted[:-1]:
            request.append_output_token(token)
        self.kv_cache.hash_new_blocks(request)
        self._book_computed(s, s.start + len(emitted))
        if self.states is not None:
            self.states.rollback(request, len(emitted), s.num_new_tokens)
        return emitted[-1]

    def _cut(self, request: Request, tokens: list[int], eos_token_ids: frozenset[int]) -> list[int]:
        """`tokens` up to the first that ends the request (a stop token, max_tokens, max_model_len)."""
        for i, token in enumerate(tokens):
            if _is_stop(request, token, eos_token_ids) or request.num_output_tokens + i + 1 >= request.sampling_params.max_tokens or request.num_tokens + i + 1 >= self.max_model_len:
                return tokens[: i + 1]
        return tokens

    def book_step(self, out: SchedulerOutput) -> list[Request]:
        """Async scheduling, before the step's sampled tokens are read: advances the scheduled
        requests as update_from_output() does, giving each request that samples a placeholder token
        (its next step reads the value on the device). Requests at their length limit finish now, so
        no step is scheduled for them. Returns the requests holding a placeholder, for resolve_tokens().
        A verify row (a draft head's, launched ahead) is booked as if it kept its last token alone: the
        least it keeps, so nothing booked here can be a rejected draft's; resolve_runs() books the rest."""
        pending = []
        for s in out.scheduled:
            samples = s.samples  # read before booking
            if not self._book_computed(s, s.end - len(s.draft_token_ids)) or not samples:
                continue
            request = s.request
            request.append_output_token(PLACEHOLDER_TOKEN)
            if self._reached_length(request):
                self.finish_request(request, RequestStatus.FINISHED_LENGTH)
            pending.append(request)
        return pending

    def resolve_tokens(
        self, pending: list[Request], sampled: dict[str, int], eos_token_ids: frozenset[int]
    ) -> list[Request]:
        """Async scheduling: fills in the placeholders of book_step() and applies the stop tokens;
        the end state is update_from_output()'s. Returns the requests (all of them got a token)."""
        for request in pending:
            token = _last(sampled[request.request_id])
            request.resolve_placeholder(token)
            stops = self._stops_on(request, token, eos_token_ids)
            if request.is_finished:  # at its length limit: a stop token on the last step still names the reason
                if stops and request.status == RequestStatus.FINISHED_LENGTH:
                    request.status = RequestStatus.FINISHED_STOPPED
                continue
            self.kv_cache.hash_new_blocks(request)
            if stops:
                self.finish_request(request, RequestStatus.FINISHED_STOPPED)
        return pending

    def resolve_runs(self, rows: list[ScheduledRequest], sampled: dict[str, list[int]], eos_token_ids: frozenset[int],
                     drafts: dict[str, list[int]], following: SchedulerOutput | None) -> list[Request]:
        """Async scheduling with a draft head: fills in the rows book_step() booked (`rows`, each holding a
        placeholder) with the run their samples keep, as update_from_output() would have booked it: the kept
        drafts and the token after them, cut at a stop token or the length, the positions computed with them,
        a hybrid model's saves past them dropped. The step launched meanwhile (`following`) was planned from
        the placeholder: its row of each request moves on by the drafts kept (the runner moved it so on the
        device, and restored a hybrid state there) and verifies the drafts the head made (`drafts`, as the
        device used them); a request that ended in the run keeps no row there (its results are dropped), nor does one
        that a stop string in the run ends once the step loop reads its text (its row's saves go as it leaves).
        Returns the requests (all of them got tokens)."""
        nexts = {s.request.request_id: s for s in following.scheduled} if following is not None else {}
        for s in rows:
            request = s.request
            samples = sampled[request.request_id]
            if s.draft_token_ids:
                accepted = s.num_accepted = accepted_prefix(s.draft_token_ids, samples)
                self.spec.record(len(s.draft_token_ids), accepted)
                run = samples[: accepted + 1]
            else:
                run = samples[-1:]
            assert request.output_token_ids[-1] == PLACEHOLDER_TOKEN, request
            del request.output_token_ids[-1], request.all_token_ids[-1]
            emitted = self._cut(request, run, eos_token_ids)
            for token in emitted:
                request.append_output_token(token)
            stops = self._stops_on(request, emitted[-1], eos_token_ids)
            if request.is_finished:  # at its length limit when booked: a stop token there still names the reason
                if stops and request.status == RequestStatus.FINISHED_LENGTH:
                    request.status = RequestStatus.FINISHED_STOPPED
                continue
            running = request.status == RequestStatus.RUNNING  # (else preempted meanwhile: it computes again)
            if running:
                request.num_computed_tokens += len(emitted) - 1
            self.kv_cache.hash_new_blocks(request)
            if running:
                self.caches.booked(request)
                self.sharing.progressed(request)
                if self.states is not None and s.draft_token_ids:
                    self.states.rollback(request, len(emitted), s.num_new_tokens)
            status = RequestStatus.FINISHED_STOPPED if stops else None
            if status is None and self._reached_length(request):
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                self.finish_request(request, status)
                continue
            following_row = nexts.get(request.request_id)
            if following_row is not None and running:
                following_row.start = request.num_computed_tokens
                if following_row.num_new_tokens:
                    following_row.draft_token_ids = list(drafts.get(request.request_id, []))[: len(following_row.draft_token_ids)]
                    if self.states is not None:
                        self.states.restored_on_device(request)
                        self._book_moved_saves(following_row)
            if running:
                self.caches.free_past(request, self._tokens_in_flight(request, following_row, following))
        return [s.request for s in rows]

    def _tokens_in_flight(self, request: Request, row: ScheduledRequest | None, step: SchedulerOutput | None) -> int:
        """The tokens whose blocks a request keeps once a step is booked: those it holds and, while its row of the
        step launched meanwhile (`row`, moved to its start) runs, every position that row may write: its tokens and
        its own chain past them (the head stores a row's chain only as far as its draft depth: head_drafter.py)."""
        if row is None or not row.num_new_tokens:
            return request.num_tokens
        k = self.config.spec_config.num_speculative_tokens
        chain = k if step.draft_depths is None else step.draft_depths.get(request.request_id, k)
        # a chain of d drafts writes d - 1 positions past the row's tokens (its first draft comes from the row itself)
        return max(request.num_tokens, row.end + max(chain, 1) - 1)

    def _book_moved_saves(self, s: ScheduledRequest) -> None:
        """A hybrid model's row launched ahead, now that its positions are known: the checkpoints it passes are
        booked as its chunk's would have been (plan_saves), each copied from the slot that holds the state there
        once the row has run (its draft slot after that many tokens, or its live slot after all of them) before
        the next step (state_copies) overwrites either; booking the row keeps those at kept positions only."""
        plan = StatePlan(s.state.slot)
        self.states.plan_saves(s.request, plan, s.start, s.num_new_tokens)
        after = {j: slot for j, (_, slot) in enumerate(s.state.draft_saves, start=1)}
        after[s.num_new_tokens] = s.state.slot
        if plan.saves:
            self._state_copies.setdefault(s.request.request_id, []).extend(
                (after[position - s.start], slot) for position, slot in plan.saves)

    def _book_computed(self, s: ScheduledRequest, end: int | None = None) -> bool:
        """Books a scheduled chunk as computed up to `end` (None: the whole chunk): caches its full blocks,
        releases consumed encoder entries; False when there was nothing to book."""
        request = s.request
        if request.is_finished or s.num_new_tokens == 0:
            return False
        request.num_computed_tokens = s.end if end is None else end
        self.caches.booked(request)  # pins items first: consumed ones are released next
        self.sharing.progressed(request)
        self._release_consumed(request)
        return True

    def _release_consumed(self, request: Request) -> None:
        held = self._held.get(request.request_id)
        if not held:
            return
        for idx in [i for i in held if request.mm_items[i].end <= request.num_computed_tokens]:
            held.discard(idx)
            self.encoder_cache.release(request.mm_items[idx].mm_hash, (request.request_id, idx))

    @staticmethod
    def _stops_on(request: Request, token: int, eos_token_ids: frozenset[int]) -> bool:
        """Whether `token` is one of the request's stop tokens (EOS unless ignored); records the reason."""
        if _is_stop(request, token, eos_token_ids):
            request.stop_reason = token
            return True
        return False

    def _reached_length(self, request: Request) -> bool:
        return request.num_output_tokens >= request.sampling_params.max_tokens or request.num_tokens >= self.max_model_len


def _last(samples: int | list[int]) -> int:
    return samples if isinstance(samples, int) else samples[-1]


def _is_stop(request: Request, token: int, eos_token_ids: frozenset[int]) -> bool:
    params = request.sampling_params
    return (not params.ignore_eos and token in eos_token_ids) or token in params.stop_token_ids


def _count_skips(candidates: list[tuple[int, Request]], admitted: list[int], window: int) -> None:
    """Every request still waiting counts one skip per request admitted from behind it."""
    last = max(admitted)
    for index, (position, request) in enumerate(candidates):
        if index >= window and position >= last:  # past the reordered head, the queue is in order
            break
        if position < last and request.status != RequestStatus.RUNNING:
            request.num_admission_skips += sum(1 for p in admitted if p > position)
