"""DraftPlanner: speculative decoding's part of the step loop. Which drafts each running request verifies next
(n-gram lookups, or a prefix of the draft head's chain), the blocks a head's chain writes, and, with async
scheduling, whether the next step may be launched before the step in flight is read.

The proposers themselves live in spec/ (ngram.py, head_drafts.py, backoff.py) and the head in runner/head_drafter.py;
the step loop (step_loop.py) asks this planner at fixed points of a step and keeps the stepping.
"""

from __future__ import annotations

from mmengine.config import EngineConfig
from mmengine.core.request import PLACEHOLDER_TOKEN, Request, RequestStatus
from mmengine.core.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from mmengine.runner.launched_step import LaunchedStep
from mmengine.sample.reasoning import ReasoningGate
from mmengine.spec.backoff import DraftBackoff
from mmengine.spec.head_drafts import HeadDrafts
from mmengine.spec.ngram import NgramProposer
from mmengine.spec.proposer import Proposer


class DraftPlanner:
    def __init__(self, config: EngineConfig, scheduler: Scheduler, follows_on_device: bool) -> None:
        spec = config.spec_config
        self.scheduler = scheduler
        self.k = spec.num_speculative_tokens
        self.proposer: Proposer | None = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                                        spec.prompt_lookup_max) if spec.method == "ngram" else None
        # a draft head (the checkpoint's MTP head, or an EAGLE-3 head) drafts within each sampling step, on the device
        # (runner/head_drafter.py); its drafts come back with the step's tokens and are handed out here
        self.drafter = HeadDrafts() if spec.method in ("mtp", "eagle3") else None
        self.backoff = DraftBackoff() if spec.method is not None and spec.draft_backoff else None
        # async scheduling with a draft head: the next step may be launched before a verify step is read, its rows
        # moved on the device by the drafts kept (a runner that can: TP 1's ModelRunner, and at TP > 1 the
        # ParallelRunner, whose ranks each move their rows so)
        self.follows_on_device = self.drafter is not None and follows_on_device
        # async scheduling with a proposer: whether the next step should read the one in flight first (its drafts
        # follow its tokens), and the back-off's answers for that step, asked when it was predicted
        self.expected = False
        self._allowed_ahead: dict[str, bool] = {}

    @property
    def active(self) -> bool:
        return self.proposer is not None or self.drafter is not None

    def forget(self, request_id: str) -> None:
        """The request left (finished or aborted)."""
        if self.proposer is not None:
            self.proposer.forget(request_id)
        if self.backoff is not None:
            self.backoff.forget(request_id)

    def received(self, launched: LaunchedStep) -> None:
        """A step was read: a draft head's drafts came back with its tokens."""
        if self.drafter is not None:
            self.drafter.received(launched.drafts())

    def record_accepted(self, rows: list[ScheduledRequest]) -> None:
        """The back-off learns each verify row's accepted count, once the step is booked."""
        if self.backoff is not None:
            for s in rows:
                if s.num_accepted is not None:
                    self.backoff.record(s.request.request_id, s.num_accepted)

    # -- the drafts each request verifies next --------------------------------------

    def propose(self) -> None:
        """Drafts for each running decode's next step, never more than the request can still emit. A grammar
        keeps the drafts it allows (each verify row is masked as the grammar stands after the drafts before it;
        a penalized row counts them as output); none for a grammar behind a reasoning gate (which reads the text,
        so a verify step cannot follow it token by token)."""
        rooms = self.rooms()
        proposed = self.drafter.propose({request_id: min(self.k, room) for request_id, room in rooms.items()}) \
            if self.drafter is not None else {}
        for request in self.scheduler.running:
            room, grammar = rooms.get(request.request_id), request.grammar
            if room is None:
                continue
            if self.drafter is not None:
                drafts = proposed.get(request.request_id, [])
            else:
                drafts = self.proposer.propose(request.request_id, request.all_token_ids, room)
            if drafts and grammar is not None:
                drafts = [] if grammar.is_stopped() or grammar.is_error() else drafts[: grammar.validate_tokens(drafts)]
            request.spec_token_ids = drafts

    def rooms(self) -> dict[str, int]:
        """The drafts each running decode may take next step (what it can still emit), for those that draft:
        not behind a reasoning gate, not paused by the back-off (asked once a step: the answers asked when
        the step was predicted, if it was)."""
        ahead, self._allowed_ahead = self._allowed_ahead, {}
        rooms: dict[str, int] = {}
        for request in self.scheduler.running:
            grammar = request.grammar
            if isinstance(grammar, ReasoningGate) or request.num_tokens - request.num_computed_tokens != 1:
                continue
            if self.backoff is not None:
                allowed = ahead.get(request.request_id)
                if not (self.backoff.allows(request.request_id) if allowed is None else allowed):
                    continue
            rooms[request.request_id] = self._room(request)
        return rooms

    def _room(self, request: Request, tokens_ahead: int = 0) -> int:
        """The drafts a request can take at its next verify step: what it can still emit and hold, beyond the one token
        the step keeps at least, once `tokens_ahead` more tokens are booked."""
        return min(request.sampling_params.max_tokens - request.num_output_tokens - 1,
                   self.scheduler.max_model_len - request.num_tokens) - tokens_ahead

    def forget_predicted(self) -> None:
        """A step predicted to draft nothing is launched: its back-off answers are spent."""
        self._allowed_ahead = {}

    def expect(self) -> bool:
        """Async scheduling with a proposer, after a step without drafts was launched: whether the next step
        should read it first, so that its drafts can follow its tokens. Predicted from the tokens known now,
        one behind the step in flight (a request whose lookup matches now usually matches one token later);
        it only decides what overlaps, never a token. The back-off is asked here for the next step."""
        rooms = self.rooms()
        self._allowed_ahead = dict.fromkeys(rooms, True)
        if self.backoff is not None:  # the paused ones were asked (and counted) too
            self._allowed_ahead.update({r.request_id: False for r in self.scheduler.running
                                        if r.request_id not in rooms and r.num_tokens - r.num_computed_tokens == 1
                                        and not isinstance(r.grammar, ReasoningGate)})
        requests = {r.request_id: r for r in self.scheduler.running}
        return any(self.proposer.propose(request_id, requests[request_id].all_token_ids, room)
                   for request_id, room in rooms.items())

    # -- async scheduling: wait for the step in flight, or launch ahead of it --------

    def resolves_first(self, out: SchedulerOutput, launched: LaunchedStep) -> bool:
        """Whether the next step must wait for the step in flight's tokens: after a verify step (its kept run sets
        the next positions) unless a draft head's rows can follow it on the device, or when drafts are expected."""
        if not self.active:
            return False
        if self.drafter is not None:
            return not self._may_launch_ahead(out, launched)
        return self.expected or any(s.draft_token_ids for s in out.scheduled)

    def _may_launch_ahead(self, out: SchedulerOutput, launched: LaunchedStep) -> bool:
        """With a draft head: whether the next step can be launched before the step in flight is read (its
        rows follow the head's drafts and each verify row's kept run on the device). Not when a row that samples
        needs the host between the two steps (the whole step then waits, as before): a grammar (its masks and the
        drafts it allows); nor with a sliding-window pool (it frees blocks by the booked position). Stop strings,
        log-probabilities and penalties need nothing in between: a stop string found in a kept run ends the request
        when the run is booked (its row launched ahead is dropped, as a stop token's extra row is without drafts),
        the log-probabilities of the kept run are read with its tokens, and a penalized request's kept run is
        counted on the device where it was sampled (step_sampling.count_kept_runs)."""
        if not self.follows_on_device or launched.pending is not None or self.scheduler.caches.windows is not None:
            return False
        for s in out.scheduled:
            request = s.request
            if not s.samples or request.is_finished:
                continue
            if request.grammar is not None:
                return False
        return True

    def placeholders_to_follow(self, pending: list[Request], depths: dict[str, int] | None) -> None:
        """Launching ahead of a draft head's step: each request that samples there (`pending`, each booked with a
        placeholder) and may draft next takes placeholder drafts, as many as its drafts there (`depths`) and what
        it may take (rooms(), from the books so far: a run cut by the length drops the rest at booking); the
        runner fills them in with the head's drafts on the device."""
        depths = depths or {}
        rooms = self.rooms()
        for request in pending:
            room = rooms.get(request.request_id)
            if room is not None and request.status == RequestStatus.RUNNING:
                wanted = min(self.k, room, depths.get(request.request_id, 0))
                request.spec_token_ids = [PLACEHOLDER_TOKEN] * max(0, wanted)

    # -- a draft head's blocks --------------------------------------------------------

    def take_draft_blocks(self, out: SchedulerOutput, ahead_of: SchedulerOutput | None) -> int:
        """A draft head drafts within the step that samples (runner/head_drafter.py): each sampling request's chain
        is as long as it may take drafts after the step (out.draft_depths), and the blocks its chained drafts write,
        past the step's tokens, are taken before the step is launched, where free; those its kept run does not reach
        go back once the step is booked (Scheduler.update_from_output; resolve_runs keeps what a row launched
        meanwhile may write). A row launched ahead of its request's verify step (`ahead_of`, the step in flight)
        starts up to that step's drafts later. Returns the tokens the step no longer computes (rows launched ahead
        that were cut for want of blocks)."""
        caches = self.scheduler.caches
        out.draft_depths = {}
        shifts = {s.request.request_id: len(s.draft_token_ids) for s in ahead_of.scheduled} if ahead_of is not None else {}
        dropped = 0
        for s in out.scheduled:
            if not s.samples:
                continue
            request = s.request
            shift = shifts.get(request.request_id, 0) if request.all_token_ids[s.start] == PLACEHOLDER_TOKEN else 0
            if shift and not caches.can_allocate(request, s.num_new_tokens + shift):
                dropped += self._shrink_ahead(s, shift)
                if not s.samples:
                    continue
            depth = out.draft_depths[request.request_id] = self._draft_depth(request)
            # the chain reaches depth - 1 positions past the step's tokens at most
            need = s.num_new_tokens + shift
            more = min(need + depth - 1, self.scheduler.max_model_len - s.start)
            while more > need and not caches.can_allocate(request, more):
                more -= 1
            if more > s.num_new_tokens:
                caches.allocate(request, max(more, need))
        return dropped

    def _shrink_ahead(self, s: ScheduledRequest, shift: int) -> int:
        """A row launched ahead whose furthest tokens' blocks are not free: without drafts, or (no block for even
        its one token that far) it computes nothing this step and waits for its verify step's books. Returns the
        tokens it no longer computes."""
        before = s.num_new_tokens
        s.num_new_tokens, s.draft_token_ids = 1, []
        if s.state is not None:
            s.state.draft_saves = []
        if not self.scheduler.caches.can_allocate(s.request, 1 + shift):
            s.num_new_tokens = 0
        return before - s.num_new_tokens

    def _draft_depth(self, request: Request) -> int:
        """The most drafts a sampling request may take after this step (rooms() asks again once it is booked):
        none behind a reasoning gate or in a back-off pause; else up to k, within what it can still emit (the step
        keeps at least one token)."""
        if isinstance(request.grammar, ReasoningGate) or (self.backoff is not None and self.backoff.paused(request.request_id)):
            return 0
        return max(0, min(self.k, self._room(request, tokens_ahead=1)))
