"""Speculative decoding's verify steps replayed from captured graphs (runner/verify_graphs.py): a batch of
decodes and verifies, padded to a bucket of num_speculative_tokens + 1 rows a request, gives the tokens of
eager steps, on a dense decoder (LLaVA, n-gram drafts) and a hybrid one whose recurrent states advance token
by token inside the graph and roll back past rejected drafts (Qwen3.5, its MTP head's drafts). On CPU the
capture is the EagerCapturer stand-in (a replay re-runs the captured function over the same buffers); on a
GPU the real CUDA graphs are checked too."""

from __future__ import annotations

import random

import pytest
import torch

from books import assert_books_consistent
from mmengine import MMEngine, SamplingParams
from mmengine.core.scheduler import ScheduledRequest
from mmengine.runner.cuda_graphs import EagerCapturer
from mmengine.runner.inputs import PAD_SLOT, InputBuffers
from mmengine.runner.verify_graphs import verify_graph_sizes, verify_query_len
from mmengine.testing import make_test_image
from mmengine.testing.mtp import tiny_qwen3_5_mtp_path
from helpers import make_request

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 2, "draft_backoff": False}
OPTIONS = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4)
LLAVA_PROMPTS = ["USER: Say it again and again. ASSISTANT:", "USER: <image>\nWhat is here? ASSISTANT:",
                 "USER: one two one two one two ASSISTANT:"]
LLAVA_IMAGES = [None, [make_test_image(31, size=(64, 64))], None]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _verify(request_id: str, length: int, drafts: list[int]) -> ScheduledRequest:
    request = make_request(request_id, length, temperature=0.0)
    return ScheduledRequest(request, request.num_tokens - 1, 1 + len(drafts), [], draft_token_ids=drafts)


def test_which_steps_a_verify_graph_takes():
    assert verify_graph_sizes([1, 2, 4, 8], 4, max_tokens=16) == [1, 2, 4]
    decode, verify = _verify("a", 5, []), _verify("b", 6, [7, 8])
    assert verify_query_len([decode], 4) == 1
    assert verify_query_len([decode, verify], 4) == 3
    assert verify_query_len([_verify("c", 6, [1, 2, 3, 4])], 4) is None  # more drafts than the graph holds
    prompt = make_request("d", 9, temperature=0.0)
    assert verify_query_len([ScheduledRequest(prompt, 0, 3, []), verify], 4) is None  # a prompt chunk runs eager


def test_prepare_packs_a_verify_batch_and_pads_it_to_the_bucket():
    buffers = InputBuffers(max_tokens=32, max_reqs=8, max_blocks_per_req=4, block_size=4, vocab_size=64,
                           device=torch.device("cpu"), max_sampled_rows=32)
    scheduled = [_verify("a", 5, []), _verify("b", 6, [40, 41]), _verify("c", 7, [50])]
    tables = {"a": [10, 20], "b": [11, 21], "c": [12, 22]}
    inputs = buffers.prepare(scheduled, tables, graph_size=4, graph_query_len=3)
    md = inputs.metadata
    assert (inputs.graph_size, inputs.graph_query_len) == (4, 3)
    assert inputs.input_ids.shape == (12,) and inputs.num_tokens == 6
    # packed as an eager step (the decode first), then a padding request's row, then rows of no request
    assert md.query_start_loc.tolist() == [0, 1, 4, 6, 7]
    assert inputs.input_ids.tolist()[:6] == [5, 6, 40, 41, 7, 50]
    assert md.slot_mapping.tolist()[6:] == [PAD_SLOT] * 6
    # each verify row's logits, the drafts' positions included
    assert inputs.logits_indices.tolist() == [0, 1, 2, 3, 4, 5]
    # with adapters in the step there is no verify graph to take
    eager = buffers.prepare(scheduled, tables, graph_size=4, graph_query_len=3, lora_slots={"b": 0})
    assert eager.graph_size is None and eager.input_ids.shape == (6,)


def _captured(path, graphs: bool, **kwargs) -> MMEngine:
    engine = MMEngine(str(path), **OPTIONS, **kwargs)
    if graphs:
        engine.runner.capture_cuda_graphs(EagerCapturer())
    return engine


def test_llava_verify_graphs_give_the_eager_tokens(family_checkpoint):
    path = family_checkpoint("llava")
    results = {}
    for graphs in (False, True):
        engine = _captured(path, graphs, speculative_config=NGRAM)
        outs = engine.generate(LLAVA_PROMPTS, images=LLAVA_IMAGES, sampling_params=_greedy(16), use_tqdm=False)
        results[graphs] = [o.token_ids for o in outs]
        stats = engine.stats()
        assert stats["spec_draft_tokens"] > 0
        if graphs:
            assert engine.runner.decode_graphs.verify_sizes == [1, 2, 4]
            assert engine.runner.decode_graphs.num_verify_replays > 0
            assert_books_consistent(engine)
    assert results[True] == results[False]  # (the eager verify's are those without speculation: test_speculative.py)


def test_hybrid_verify_graphs_roll_back_and_save_checkpoints_as_eager_steps():
    """The random MTP head's drafts are nearly all rejected: every verify restores a draft state; decodes
    that cross block ends save checkpoints from inside the graph's step, which the next turn resumes from."""
    path = tiny_qwen3_5_mtp_path()
    prompts = [{"prompt_token_ids": [random.Random(i).randrange(10, 300) for _ in range(9 + 5 * i)]} for i in range(3)]
    results, counts = {}, {}
    for graphs in (False, True):
        engine = _captured(path, graphs, speculative_config=MTP, block_size=4)
        first = [o.token_ids for o in engine.generate(prompts, sampling_params=_greedy(9), use_tqdm=False)]
        follow = [{"prompt_token_ids": p["prompt_token_ids"] + t + [42]} for p, t in zip(prompts, first)]
        results[graphs] = first + [o.token_ids for o in engine.generate(follow, sampling_params=_greedy(5), use_tqdm=False)]
        stats = engine.stats()
        counts[graphs] = (stats["state_checkpoint_hits"], stats["prefill_tokens_computed"], stats["spec_draft_tokens"],
                          stats["spec_accepted_tokens"])
        if graphs:
            assert engine.runner.decode_graphs.num_verify_replays >= 6
            assert_books_consistent(engine)
    assert results[True] == results[False]
    assert counts[True] == counts[False] and counts[True][0] == 3 and counts[True][2] > 0


@pytest.mark.parametrize("family, template", [
    ("gemma4", "<bos><|turn>user\n{}<turn|>\n<|turn>model\n"),
    ("llama4", "<|begin_of_text|><|header_start|>user<|header_end|>\n\n{}<|eot|><|header_start|>assistant<|header_end|>\n\n"),
], ids=["gemma4", "llama4"])
def test_windowed_and_chunked_pools_verify_in_graphs(family_checkpoint, family, template):
    """Sliding-window (Gemma 4) and chunked local attention (Llama 4) layers read their own pool's slots and
    block tables from the graph's buffers; drafts cross the windows' and chunks' edges (block_size 4)."""
    path = family_checkpoint(family)
    results = {}
    for graphs in (False, True):
        engine = _captured(path, graphs, speculative_config=NGRAM, block_size=4)
        prompts = [template.format("Say it again and again, again and again."), template.format("one two one two")]
        results[graphs] = [o.token_ids for o in engine.generate(prompts, sampling_params=_greedy(24), use_tqdm=False)]
        assert engine.stats()["spec_draft_tokens"] > 0
        if graphs:
            assert engine.runner.decode_graphs.num_verify_replays > 0
            assert_books_consistent(engine)
    assert results[True] == results[False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (the CPU stand-in covers the bookkeeping)")
def test_verify_cuda_graphs_give_the_eager_tokens_on_gpu(family_checkpoint):
    path = family_checkpoint("llava")
    results = {}
    for eager in (True, False):
        engine = MMEngine(str(path), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=4, enforce_eager=eager,
                          gpu_memory_utilization=0.3, speculative_config=NGRAM)
        outs = engine.generate(LLAVA_PROMPTS, images=LLAVA_IMAGES, sampling_params=_greedy(16), use_tqdm=False)
        results[eager] = [o.token_ids for o in outs]
        if not eager:
            assert engine.runner.decode_graphs.num_verify_replays > 0
    assert results[False] == results[True]
