"""A draft head (MTP, EAGLE-3) drafts within the step that samples: its pass over the step's positions and its chained
drafts run on the device right after sampling, the accepted run of each verify row is counted there, and the step's
tokens and drafts come back in one read; the step loop books them and hands the drafts on without running the head.
The drafts are the reference head's (transformers' pieces, over the tokens so far) after every step, accepted runs
included, and the tokens are those without speculation, with async scheduling on and off."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from books import assert_books_consistent
from chat_formats import user_turn
from helpers import make_request, record_draft_proposals
from mmengine import MMEngine, SamplingParams
from mmengine.core.scheduler import ScheduledRequest
from mmengine.runner.head_drafter import kept_counts
from mmengine.testing import make_test_image
from mmengine.testing.eagle3 import build_eagle3_head
from mmengine.testing.mtp import tiny_qwen3_5_mtp_path
from mmengine.testing.qwen_vl import qwen_vl_prompt

OPTIONS = dict(device="cpu", dtype="float32", max_model_len=256, block_size=8)
PICTURES = [make_test_image(71, size=(64, 64)), make_test_image(72, size=(48, 96))]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def test_kept_counts_are_each_verify_rows_accepted_run_on_the_device():
    """Two drafts kept of three: the last token and those two; a decode keeps its token, a prompt's last chunk all
    of it (a chunk short of the prompt's end samples nothing and has no count)."""
    verify, decode, chunk, none_kept = (make_request(name, 6) for name in "vdcn")
    for request, last in ((verify, 40), (decode, 50), (none_kept, 60)):
        request.all_token_ids.append(last)
    rows = [ScheduledRequest(decode, 6, 1, []), ScheduledRequest(verify, 6, 4, [], draft_token_ids=[41, 42, 43]),
            ScheduledRequest(chunk, 2, 4, []), ScheduledRequest(none_kept, 6, 3, [], draft_token_ids=[61, 62])]
    sampled = [rows[0], *[rows[1]] * 4, rows[2], *[rows[3]] * 3]
    tokens = torch.tensor([51, 41, 42, 9, 8, 7, 5, 62, 1])
    assert kept_counts(tokens, sampled).tolist() == [1, 3, 4, 1]


def _eagle3_head_that_is_sometimes_right(root, target, tokens: list[list[int]], often: int):
    """A random EAGLE-3 head whose draft vocabulary (d2t) maps onto tokens the target emits: every other entry onto
    `often`, the rest onto the emitted tokens, cycled. Some of its drafts are kept, runs of two too, so verify steps
    keep several positions (which draft it picks is still its own computation)."""
    head = build_eagle3_head(root, target, draft_vocab_size=200, own_embeddings=True)
    emitted = torch.as_tensor([t for run in tokens for t in run])
    targets = emitted[torch.arange(200) % len(emitted)]
    targets[::2] = often
    tensors = load_file(str(head / "model.safetensors"))
    save_file({**tensors, "d2t": targets - torch.arange(200)}, str(head / "model.safetensors"), metadata={"format": "pt"})
    return head


def _record_verified_drafts(engine) -> list[tuple[str, int, list[int]]]:
    """(request id, position of its last token, drafts) of every verify row the scheduler books, as booked (a row
    launched ahead of its request's verify step gets its start and drafts before it is booked)."""
    scheduler, verified = engine.scheduler, []

    def recording(method):
        def booked(*args, **kwargs):
            rows = args[0].scheduled if method == "update_from_output" else args[0]
            verified.extend((s.request.request_id, s.start, list(s.draft_token_ids)) for s in rows if s.draft_token_ids)
            return original(*args, **kwargs)
        original = getattr(scheduler, method)
        return booked
    for method in ("update_from_output", "resolve_runs"):
        setattr(scheduler, method, recording(method))
    return verified


def _outside_the_step(engine) -> list[str]:
    """Records each head forward that runs outside ModelRunner.launch/sample (the step loop's own work)."""
    runner, outside, inside = engine.runner, [], [0]
    for name in ("launch", "sample"):
        method = getattr(runner, name)

        def within(*args, _method=method, **kwargs):
            inside[0] += 1
            try:
                return _method(*args, **kwargs)
            finally:
                inside[0] -= 1
        setattr(runner, name, within)
    forward = runner.drafter.head.forward

    def recording(*args, **kwargs):
        if not inside[0]:
            outside.append("head forward")
        return forward(*args, **kwargs)
    runner.drafter.head.forward = recording
    return outside


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_eagle3_drafts_within_the_step_are_the_reference_heads_after_accepted_runs(family_checkpoint, tmp_path, async_scheduling):
    """Qwen3-VL with an EAGLE-3 head that is sometimes right, a prompt chunked over steps beside another request's
    decodes: every proposal equals the reference head's chain over the tokens so far, after verify steps that kept
    several positions too; the head never runs outside the step; the tokens are those without speculation."""
    from test_eagle3 import _reference_drafts

    path = family_checkpoint("qwen3_vl")
    prompts = [user_turn("qwen3_vl", "Hello."), user_turn("qwen3_vl", "Tell me a story about a cat who sails the sea.")]
    reference = MMEngine(str(path), **OPTIONS)
    expected = [o.token_ids for o in reference.generate(prompts, sampling_params=_greedy(12), use_tqdm=False)]
    reference.shutdown()
    assert expected[0][5:9] == [246] * 4  # (the tiny target repeats itself there)
    head = _eagle3_head_that_is_sometimes_right(tmp_path / "head", path, expected, often=246)
    engine = MMEngine(str(path), speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3,
                                                     "draft_backoff": False},
                      **OPTIONS, max_num_batched_tokens=12, max_num_seqs=2, async_scheduling=async_scheduling)
    outside = _outside_the_step(engine)
    verified = _record_verified_drafts(engine)
    outs = engine.generate(prompts, sampling_params=_greedy(12), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats["spec_accepted_position_1"] > 0 and not outside  # a run of two drafts kept
    tokens = {o.request_id: list(o.prompt_token_ids) + o.token_ids for o in outs}
    checked = 0
    for request_id, start, drafts in verified:
        if request_id != outs[0].request_id:
            continue
        known = tokens[request_id]
        assert drafts == _reference_drafts("qwen3_vl", path, head, known[:start], known[start], len(drafts)), start
        checked += 1
    assert checked >= 2
    assert_books_consistent(engine)
    engine.shutdown()


def test_mtp_drafts_within_the_step_keep_the_tokens_with_pictures_and_preemption():
    """Qwen3.5's MTP head, pictures, small chunks and too few blocks: the head runs only within the steps, and the
    tokens are those without speculation, with async scheduling on and off."""
    path = str(tiny_qwen3_5_mtp_path())
    prompts = [qwen_vl_prompt(f"Story number {i} about the sea.", i % 2) for i in range(3)]
    images = [PICTURES[:1] if i % 2 else None for i in range(3)]
    options = {**OPTIONS, "block_size": 4, "max_num_batched_tokens": 16, "num_kv_blocks": 26, "enable_prefix_grouping": False}
    reference = MMEngine(path, **options)
    expected = [o.token_ids for o in reference.generate(prompts, images=images, sampling_params=_greedy(16), use_tqdm=False)]
    reference.shutdown()
    for async_scheduling in ("off", "on"):
        engine = MMEngine(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3, "draft_backoff": False},
                          **options, async_scheduling=async_scheduling)
        outside = _outside_the_step(engine)
        proposals = record_draft_proposals(engine)
        outs = engine.generate(prompts, images=images, sampling_params=_greedy(16), use_tqdm=False)
        assert [o.token_ids for o in outs] == expected, async_scheduling
        stats = engine.stats()
        assert stats["num_preemptions"] > 0 and stats["spec_draft_tokens"] > 0 and not outside
        # (launched ahead, the drafts go from the device into the next step, not through the step loop's hands)
        assert any(proposals) or stats["steps_launched_ahead"] > 0
        assert_books_consistent(engine)
        engine.shutdown()


# -- launched ahead: the next step before the verify step's tokens are read ------------------------------------------

def _mtp_engine(async_scheduling: str, **options) -> MMEngine:
    return MMEngine(str(tiny_qwen3_5_mtp_path()), speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                                                       "draft_backoff": False},
                    **{**OPTIONS, "block_size": 16, **options}, async_scheduling=async_scheduling)


def _learn_first_drafts(engine, prompts, images, expected: list[list[int]]) -> dict[int, int]:
    """The MTP head's first draft at each step of a run without speculation's help, mapped to the token the target
    emits there: a head drafting through this table is right at many first drafts (its first draft depends only
    on the tokens so far, which never change), wrong at most later ones."""
    proposals = []
    propose = engine.steps.drafts.drafter.propose

    def recording(wanted):
        drafts = propose(wanted)
        proposals.extend((rid, engine.scheduler.requests[rid].num_output_tokens, d[0]) for rid, d in drafts.items() if d)
        return drafts
    engine.steps.drafts.drafter.propose = recording
    outs = engine.generate(prompts, images=images, sampling_params=_greedy(len(expected[0])), use_tqdm=False)
    del engine.steps.drafts.drafter.propose
    order = {o.request_id: i for i, o in enumerate(outs)}
    table: dict[int, int] = {}
    for request_id, num_output, draft in proposals:
        answer = expected[order[request_id]]
        if num_output < len(answer):
            table.setdefault(draft, answer[num_output])
    return table


def _draft_through(engine, table: dict[int, int]) -> None:
    head = engine.runner.drafter.head
    greedy, lookup = head.greedy, torch.arange(engine.runner.text_config.vocab_size)
    for draft, token in table.items():
        lookup[draft] = token

    def mapped(output):
        return lookup.to(output.device)[greedy(output)]
    head.greedy = mapped


@pytest.fixture(scope="module")
def mtp_reference():
    """The tiny Qwen3.5 MTP checkpoint without speculation: the reference outputs (for other sampling params too)."""
    engine = MMEngine(str(tiny_qwen3_5_mtp_path()), **{**OPTIONS, "block_size": 16})
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def mtp_case(mtp_reference):
    """(prompts, images, the greedy tokens without speculation, a table that makes the random head often right)."""
    prompts = [qwen_vl_prompt("Say it again and again.", 0), qwen_vl_prompt("What is here?", 1),
               qwen_vl_prompt("Count to nine.", 0)]
    images = [None, PICTURES[:1], None]
    expected = [o.token_ids for o in mtp_reference.generate(prompts, images=images, sampling_params=_greedy(20), use_tqdm=False)]
    learner = _mtp_engine("off")
    table = _learn_first_drafts(learner, prompts, images, expected)
    learner.shutdown()
    return prompts, images, expected, table


def test_mtp_steps_are_launched_before_the_verify_steps_are_read(mtp_case):
    """Qwen3.5 (hybrid) with a head that is often right: with async scheduling the decodes' steps are launched
    before the verify step in flight is read (none were before), each row moved on the device by the drafts kept
    and its Gated DeltaNet state taken from the kept position's; the tokens, the drafts kept and the prefix cache's
    books are those of async scheduling off and of decoding without speculation."""
    prompts, images, expected, table = mtp_case
    runs = {}
    for mode in ("off", "on"):
        engine = _mtp_engine(mode)
        _draft_through(engine, table)
        outs = engine.generate(prompts, images=images, sampling_params=_greedy(20), use_tqdm=False)
        assert [o.token_ids for o in outs] == expected, mode
        assert_books_consistent(engine)
        runs[mode] = engine.stats()
        engine.shutdown()
    off, on = runs["off"], runs["on"]
    assert off["steps_launched_ahead"] == 0 < on["steps_launched_ahead"]
    assert on["spec_accepted_tokens"] > 0 and on["spec_accepted_position_0"] > 0
    assert on["spec_accepted_tokens"] == off["spec_accepted_tokens"] and on["decode_steps"] == off["decode_steps"]
    assert on["prefill_tokens_computed"] == off["prefill_tokens_computed"]


def test_mtp_prefix_hits_with_steps_launched_ahead_are_those_of_async_off(mtp_case):
    """A repeated pictured prompt, then a chat's next turn (token ids: its first turn, the answer, new tokens): the
    checkpoints a hybrid model resumes from are booked only at kept positions, so the hits and the prefill tokens
    computed are those with async scheduling off, and the next turn computes little more than its new tokens."""
    prompts, images, expected, table = mtp_case
    found, checkpoints = {}, {}
    for mode in ("off", "on"):
        engine = _mtp_engine(mode)
        _draft_through(engine, table)
        seen = []
        for _ in range(2):
            before = engine.stats()["prefill_tokens_computed"]
            out = engine.generate(prompts[1:2], images=images[1:2], sampling_params=_greedy(20), use_tqdm=False)[0]
            seen.append((out.token_ids, out.num_cached_tokens, engine.stats()["prefill_tokens_computed"] - before))
        chat = list(out.prompt_token_ids[:1]) + [11] * 30
        turn = engine.generate({"prompt_token_ids": chat}, sampling_params=_greedy(24), use_tqdm=False)[0]
        before = engine.stats()["prefill_tokens_computed"]
        last = engine.generate({"prompt_token_ids": chat + turn.token_ids + [12] * 5}, sampling_params=_greedy(4), use_tqdm=False)[0]
        seen.append((turn.token_ids + last.token_ids, last.num_cached_tokens, engine.stats()["prefill_tokens_computed"] - before))
        found[mode] = (seen, engine.stats()["steps_launched_ahead"])
        checkpoints[mode] = [torch.cat([torch.cat([layer.conv[slot].flatten(), layer.recurrent[slot].flatten()])
                                        for layer in engine.runner.recurrent_states])
                             for slot in engine.scheduler.states.checkpoint_slots().values()]
        assert_books_consistent(engine)
        engine.shutdown()
    (on, ahead), (off, _) = found["on"], found["off"]
    assert on == off and on[0][0] == expected[1] and ahead > 0
    assert on[1][1] > 0 and on[2][2] <= 5 + 16  # a hit; the next turn: its new tokens, at most a block more
    # as many checkpoints, holding the same states (the tiny model's tokens barely depend on them; the block hashes
    # are each engine's own)
    unmatched = list(checkpoints["off"])
    assert len(checkpoints["on"]) == len(unmatched) >= 3
    for state in checkpoints["on"]:
        match = next((i for i, other in enumerate(unmatched) if torch.allclose(state, other, atol=1e-4, rtol=1e-4)), None)
        assert match is not None, "a checkpoint whose state async scheduling off never had"
        unmatched.pop(match)


def test_eagle3_steps_launched_ahead_keep_the_tokens_with_pictures_chunks_and_preemption(family_checkpoint, tmp_path):
    """Qwen3-VL (M-RoPE) with an EAGLE-3 head that is sometimes right: pictures, prompts chunked over steps, too few
    blocks (preemption, and rows launched ahead without the blocks for every draft kept: they verify no drafts, or
    wait a step), a request ending at max_tokens beside its run of repeated tokens. With async scheduling the tokens
    are those without speculation and most steps are launched before the one in flight is read."""
    path = str(family_checkpoint("qwen3_vl"))
    prompts = [user_turn("qwen3_vl", "Hello."), user_turn("qwen3_vl", "What is here?", 1),
               user_turn("qwen3_vl", "Tell me a story about a cat who sails the sea."), user_turn("qwen3_vl", "Compare them.", 2)]
    images = [None, PICTURES[:1], None, PICTURES]
    params = [_greedy(7), _greedy(12), _greedy(12), _greedy(12)]  # the first ends inside its run of 246s
    reference = MMEngine(path, **OPTIONS)
    expected = [o.token_ids for o in reference.generate(prompts, images=images, sampling_params=params, use_tqdm=False)]
    full = reference.generate(prompts[:1], sampling_params=_greedy(12), use_tqdm=False)[0].token_ids
    reference.shutdown()
    assert full[5:9] == [246] * 4
    head = _eagle3_head_that_is_sometimes_right(tmp_path / "head", path, [full, *expected[1:]], often=246)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "draft_backoff": False}
    for options in ({"max_num_batched_tokens": 16}, {"block_size": 4, "num_kv_blocks": 22, "max_num_batched_tokens": 24,
                                                     "enable_prefix_grouping": False}):
        engine = MMEngine(path, speculative_config=spec, **{**OPTIONS, **options}, async_scheduling="on")
        outs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
        assert [o.token_ids for o in outs] == expected, options
        assert outs[0].finish_reason == "length"
        stats = engine.stats()
        assert stats["steps_launched_ahead"] > stats["steps"] // 2 and stats["spec_accepted_tokens"] > 0, stats
        assert_books_consistent(engine)
        if "num_kv_blocks" in options:
            assert stats["num_preemptions"] > 0
        engine.shutdown()


def test_max_tokens_inside_a_run_kept_by_a_step_launched_ahead(mtp_case, monkeypatch):
    """A row launched ahead takes drafts as the books stood before the step in flight was read, so its run can go
    past max_tokens where the drafts kept in flight moved the request on: booking cuts it there, and the tokens and
    the finish are those of async scheduling off."""
    from mmengine.core.scheduler import Scheduler

    prompts, images, expected, table = mtp_case
    cuts, cut = [], Scheduler._cut

    def recording(self, request, tokens, eos_token_ids):
        kept = cut(self, request, tokens, eos_token_ids)
        cuts.extend([request.request_id] if len(kept) < len(tokens) else [])
        return kept
    monkeypatch.setattr(Scheduler, "_cut", recording)
    engine = _mtp_engine("on")
    _draft_through(engine, table)
    outs = engine.generate(prompts, images=images, sampling_params=[_greedy(13), _greedy(20), _greedy(20)], use_tqdm=False)
    assert [o.token_ids for o in outs] == [expected[0][:13], *expected[1:]]
    assert outs[0].finish_reason == "length" and cuts == [outs[0].request_id]
    assert_books_consistent(engine)


def test_a_grammar_row_waits_and_the_free_rows_keep_their_tokens(mtp_case):
    """A constrained request needs the host between steps (its masks, the drafts it allows): while it samples, each
    step is read before the next is launched; the free rows and the JSON are those of async scheduling off."""
    from mmengine.sample.structured_output.params import StructuredOutputParams

    prompts, images, expected, table = mtp_case
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"]}
    params = [_greedy(20), SamplingParams(max_tokens=20, temperature=0, structured_output=StructuredOutputParams(json=schema)),
              _greedy(20)]
    found = {}
    for mode in ("off", "on"):
        engine = _mtp_engine(mode)
        _draft_through(engine, table)
        outs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
        found[mode] = [(o.token_ids, o.text, o.finish_reason) for o in outs]
        assert_books_consistent(engine)
        engine.shutdown()
    assert found["on"] == found["off"]
    assert [found["on"][0][0], found["on"][2][0]] == [expected[0], expected[2]]


def _launched_beside(engine, asks) -> list[bool]:
    """For each step in flight with a row whose request `asks` (of its SamplingParams), whether the next step was
    launched before it was read."""
    planner, seen = engine.steps.drafts, []
    resolves_first = planner.resolves_first

    def recording(out, launched):
        waits = resolves_first(out, launched)
        if any(s.samples and not s.request.is_finished and asks(s.request.sampling_params) for s in out.scheduled):
            seen.append(not waits)
        return waits
    planner.resolves_first = recording
    return seen


def _state_copies_at_finish(engine) -> list[tuple[str, int, list[int]]]:
    """(request id, its rows' state copies queued before it finished, the queued copies into slots the books hold free
    after) at each finish: a row launched ahead saves a hybrid checkpoint by a copy before the next step."""
    scheduler, found = engine.scheduler, []
    finish = scheduler.finish_request

    def finishing(request, status):
        queued = len(scheduler._state_copies.get(request.request_id, []))
        finish(request, status)
        states = scheduler.states
        booked = set(states.checkpoint_slots().values()) | {save.slot for saves in states._pending.values() for save in saves}
        stray = [target for copies in scheduler._state_copies.values() for _, target in copies if target not in booked]
        found.append((request.request_id, queued, stray))
    scheduler.finish_request = finishing
    return found


def _logprob_rows(entries) -> tuple[list, list[float]]:
    """(token and top ids, the log-probabilities): ids compared exactly, values within float noise (a batch's other
    rows differ between the modes, e.g. a finished request's dropped row)."""
    entries = [e for e in entries or [] if e is not None]
    return ([(e.token_id, [t for t, _ in e.top]) for e in entries],
            [v for e in entries for v in (e.logprob, *(v for _, v in e.top))])


def _stop_logprobs_and_penalties() -> list[SamplingParams]:
    """For mtp_case's prompts: a stop string inside the first one's answer, log-probabilities, and penalties that
    change the second one's."""
    return [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=["What"], logprobs=2),
            SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=1,
                           presence_penalty=0.3, frequency_penalty=0.2, repetition_penalty=1.1), _greedy(20)]


def test_stop_strings_logprobs_and_penalties_launch_ahead_with_the_results_of_async_off(mtp_case, mtp_reference, monkeypatch):
    """A request with a stop string and log-probabilities, a penalized one with log-probabilities of its tokens and its
    prompt, and a plain one: their steps are launched before the verify step in flight is read. The stop string ends
    its request inside a verify step's kept run, which is cut there, and the row launched ahead for it is dropped with
    the blocks and the hybrid checkpoint booked for it (no copy is left queued into a slot the books hold free). The
    penalized row launched ahead counts the drafts before each position and its request's kept run on the device.
    Tokens, text, finish and log-probabilities are those without speculation; the drafts kept and the caches' books
    after the requests are those of async scheduling off."""
    import mmengine.engine.step_loop as step_loop

    prompts, images, expected, table = mtp_case
    params = _stop_logprobs_and_penalties()
    reference = mtp_reference.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    assert reference[1].token_ids[:11] == expected[1][:11] != reference[1].token_ids  # the penalties change the answer
    assert reference[0].finish_reason == "stop" and reference[0].token_ids == expected[0][: len(reference[0].token_ids)]
    cuts, drop = [], step_loop._drop_tokens_after

    def cutting(request, index):
        cuts.append((request.request_id, request.num_output_tokens - index - 1))
        drop(request, index)
    monkeypatch.setattr(step_loop, "_drop_tokens_after", cutting)
    found = {}
    for mode in ("off", "on"):
        cuts.clear()
        engine = _mtp_engine(mode, block_size=4)  # (the dropped row passes a block's end: a checkpoint is booked there)
        _draft_through(engine, table)
        launched = _launched_beside(engine, lambda p: bool(p.stop) or p.logprobs is not None)
        beside_penalties = _launched_beside(engine, lambda p: p.penalized)
        finishes = _state_copies_at_finish(engine)
        verified = _record_verified_drafts(engine)
        outs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
        for out, ref in zip(outs, reference):
            assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (ref.token_ids, ref.text, ref.finish_reason, ref.stop_reason)
            assert _logprob_rows(out.logprobs)[0] == _logprob_rows(ref.logprobs)[0]
            assert _logprob_rows(out.prompt_logprobs)[0] == _logprob_rows(ref.prompt_logprobs)[0]
            assert _logprob_rows(out.logprobs)[1] == pytest.approx(_logprob_rows(ref.logprobs)[1], abs=1e-4)
            assert _logprob_rows(out.prompt_logprobs)[1] == pytest.approx(_logprob_rows(ref.prompt_logprobs)[1], abs=1e-4)
        assert cuts and cuts[0][0] == outs[0].request_id and cuts[0][1] > 0, cuts  # inside the run kept
        assert all(not stray for _, _, stray in finishes), finishes
        stats = engine.stats()
        found[mode] = dict(verified=verified, spec={k: v for k, v in stats.items() if k.startswith("spec_accepted")},
                           books=(engine.kv_cache.num_free_blocks, engine.kv_cache.num_cached_blocks,
                                  engine.scheduler.states.num_cached_checkpoints),
                           launched=launched, beside_penalties=beside_penalties, finishes=finishes,
                           penalized=sum(len(d) for request_id, _, d in verified if request_id == outs[1].request_id))
        assert engine.runner.penalties.num_rows_in_use == 0
        assert_books_consistent(engine)
        engine.shutdown()
    on, off = found["on"], found["off"]
    # the drafts verified and kept; launched ahead, a request near max_tokens may verify a draft more (its room is
    # taken before the step in flight is read), which is never kept
    assert [row for row in on["verified"] if row in off["verified"]] == off["verified"] and on["spec"] == off["spec"]
    assert on["penalized"] >= 10  # drafts the penalized request verified
    assert on["books"] == off["books"]
    assert not any(off["launched"]) and sum(on["launched"]) >= 5, on["launched"]
    assert sum(on["beside_penalties"]) >= 5, on["beside_penalties"]
    assert on["finishes"][0][1] > 0  # the dropped row had booked a checkpoint


def test_an_abort_while_a_step_is_launched_ahead_drops_only_that_request(mtp_case):
    prompts, images, expected, table = mtp_case
    engine = _mtp_engine("on")
    _draft_through(engine, table)
    keep = [engine.add_request(prompts[i], images[i], _greedy(20)) for i in (0, 2)]
    drop = engine.add_request(prompts[1], images[1], _greedy(20))
    seen: dict[str, list] = {}
    for step in range(40):
        if step == 4:
            assert engine.steps.in_flight is not None and engine.abort_request(drop)
        for output in engine.step():
            seen.setdefault(output.request_id, []).append(output)
        if not engine.has_unfinished_requests():
            break
    assert [seen[r][-1].token_ids for r in keep] == [expected[0], expected[2]]
    assert seen[drop][-1].finish_reason == "abort" and len(seen[drop][-1].token_ids) < 20
    assert engine.stats()["steps_launched_ahead"] > 0
    assert_books_consistent(engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU tests above check the same logic")
def test_steps_launched_ahead_on_cuda_give_the_tokens_of_async_off(mtp_case):
    """On a GPU: verify graphs replay with rows moved on the device (Triton kernels, host lengths as bounds); beside
    them a stop string, log-probabilities and penalties (their drafts read from the graph's inputs)."""
    prompts, images, expected, table = mtp_case
    found = {}
    for mode in ("off", "on"):
        engine = _mtp_engine(mode, device="cuda")
        _draft_through(engine, table)
        found[mode] = [o.token_ids for o in engine.generate(prompts, images=images, sampling_params=_greedy(20), use_tqdm=False)]
        mixed = engine.generate(prompts, images=images, sampling_params=_stop_logprobs_and_penalties(), use_tqdm=False)
        found[mode] += [(o.token_ids, o.text, o.finish_reason, [e.token_id for e in o.logprobs or []]) for o in mixed]
        if mode == "on":
            assert engine.stats()["steps_launched_ahead"] > 0
        engine.shutdown()
    assert found["on"] == found["off"]
