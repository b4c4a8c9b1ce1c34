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
    drafter, made = engine.steps.drafter, []
    propose = drafter.propose

    def recording(wanted):
        drafts = propose(wanted)
        made.extend((rid, engine.scheduler.requests[rid].num_output_tokens, d) for rid, d in drafts.items())
        return drafts
    drafter.propose = recording
    outs = engine.generate(prompts, sampling_params=_greedy(12), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    stats = engine.stats()
    assert stats["spec_accepted_position_1"] > 0 and not outside  # a run of two drafts kept
    by_id = {o.request_id: o for o in outs}
    checked = 0
    for request_id, num_output, drafts in made:
        out = by_id[request_id]
        if request_id != outs[0].request_id or num_output < 2:
            continue
        known = list(out.prompt_token_ids) + out.token_ids[: num_output - 1]
        assert drafts == _reference_drafts("qwen3_vl", path, head, known, out.token_ids[num_output - 1], len(drafts)), num_output
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
        assert stats["num_preemptions"] > 0 and stats["spec_draft_tokens"] > 0 and any(proposals) and not outside
        assert_books_consistent(engine)
        engine.shutdown()
