"""Cascade attention end to end: cascade "on" gives the greedy tokens of "off" (CPU, fp32, tiny
shapes) for a batch with several groups under different prefixes, chunked prefills, images inside
the shared prefixes, and a recomputed last token inside its group's prefix. A spy on the step
inputs checks that each of those situations really ran through cascade.

(In the engine a query inside a group's prefix is always the prefix's last position: only the
last token of a full prefix hit is recomputed, so no later prefix key exists for it. Chunks that
start earlier inside the prefix, where the causal mask matters, are covered kernel-level in
test_cascade_kernels.py.)"""

from __future__ import annotations

from unittest.mock import patch

import pytest
import torch

from helpers import make_request
from mmengine import MMEngine, SamplingParams
from mmengine.layers.cascade import CascadeGroup
from mmengine.runner.cascade_plan import CascadePolicy, GraphBounds
from mmengine.runner.cuda_graphs import EagerCapturer
from mmengine.runner.inputs import PAD_SEQ_LEN, InputBuffers
from mmengine.core.scheduler import ScheduledRequest
from mmengine.testing import make_test_image

SYSTEMS = [
    ("USER: <image>\nYou are a careful assistant who describes pictures in plain words and short sentences.", [1]),
    ("USER: You answer questions about cooking, travel and small gardens with patience and practical details.", []),
    ("USER: <image>\nCompare the colours and the shapes in this picture with the ones you saw before.", [2]),
]
QUESTIONS = ["What is first?", "Tell me more about it, please.", "Why?"]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def block_aligned(engine: MMEngine, text: str, block_size: int = 16) -> str:
    """`text` extended word by word until its prompt is a whole number of blocks, so a repeat of it
    is a full prefix hit whose recomputed last token lies inside the shared blocks."""
    for extra in range(64):
        candidate = text + " a" * extra
        if len(engine.tokenizer(candidate)["input_ids"]) % block_size == 0:
            return candidate
    raise AssertionError("no block-aligned extension found")


def batch(engine: MMEngine) -> tuple[list[str], list[list]]:
    prompts, images = [], []
    for question in QUESTIONS:  # interleaved: every group is in flight at once
        for system, image_seeds in SYSTEMS:
            prompts.append(f"{system} {question} ASSISTANT:")
            images.append([make_test_image(seed) for seed in image_seeds])
    repeated = block_aligned(engine, "USER: one plain question asked twice word for word ASSISTANT:")
    return [*prompts, repeated, repeated], [*images, [], []]


class CascadeSpy:
    """Records what the cascade steps held: wraps InputBuffers.prepare."""

    def __init__(self, engine: MMEngine) -> None:
        self.steps: list[dict[str, int]] = []
        buffers = engine.runner.inputs
        prepare = buffers.prepare

        def spy(*args, **kwargs):
            inputs = prepare(*args, **kwargs)
            if inputs.cascade_groups:
                self.steps.append(self._summary(inputs.scheduled, inputs.cascade_groups, engine.config.cache_config.block_size))
            return inputs

        buffers.prepare = spy

    @staticmethod
    def _summary(scheduled: list[ScheduledRequest], groups: list[CascadeGroup], block_size: int) -> dict[str, int]:
        summary = {"groups": len(groups), "prefill_members": 0, "inside_prefix": 0, "image_in_prefix": 0}
        for group in groups:
            prefix = group.num_prefix_blocks * block_size
            members = [scheduled[row] for row in group.rows]
            summary["prefill_members"] += sum(s.num_new_tokens > 1 for s in members)
            summary["inside_prefix"] += sum(max(0, min(s.end, prefix) - s.start) for s in members)
            summary["image_in_prefix"] += any(item.end <= prefix for s in members for item in s.request.mm_items)
        return summary


def run(checkpoint_dir, cascade: str, backend: str = "torch", prompts=None, images=None, params=PARAMS, **kwargs):
    engine = MMEngine(
        str(checkpoint_dir()), attn_backend=backend, dtype="float32", max_model_len=256, block_size=16,
        max_num_batched_tokens=40, cascade_attention=cascade, **kwargs,
    )
    spy = CascadeSpy(engine)
    if prompts is None:
        prompts, images = batch(engine)
    outputs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    return [o.token_ids for o in outputs], engine.stats(), spy.steps


def test_cascade_on_gives_the_tokens_of_off(checkpoint_dir):
    on, on_stats, steps = run(checkpoint_dir, "on")
    off, off_stats, off_steps = run(checkpoint_dir, "off")
    assert on == off
    assert off_stats["cascade_steps"] == 0 and off_steps == []
    # cascade really ran, in the situations this test is about
    assert on_stats["cascade_steps"] == len(steps) > 0
    assert on_stats["cascade_groups"] == sum(s["groups"] for s in steps)
    assert on_stats["cascade_tokens"] > on_stats["cascade_steps"]
    assert max(s["groups"] for s in steps) >= 3, "several groups with different prefixes in one step"
    assert sum(s["prefill_members"] for s in steps) > 0, "a chunked prefill inside a group"
    assert sum(s["image_in_prefix"] for s in steps) > 0, "an image inside a shared prefix"
    assert sum(s["inside_prefix"] for s in steps) > 0, "a recomputed last token inside its group's prefix"
    assert on_stats["prefix_cache_hits"] == off_stats["prefix_cache_hits"] > 0


def test_auto_leaves_the_reference_backend_alone(checkpoint_dir):
    """"auto" weighs cascade for the Triton kernels; on the PyTorch path it never engages."""
    prompts = [f"{SYSTEMS[1][0]} {q} ASSISTANT:" for q in QUESTIONS]
    _, stats, steps = run(checkpoint_dir, "auto", prompts=prompts, images=None)
    assert stats["cascade_steps"] == 0 and steps == []


def test_triton_cascade_gives_the_reference_tokens(checkpoint_dir, no_tf32):
    """The Triton kernels (in the interpreter on CPU) with cascade on, against the reference with it
    off: two groups (one prefix holds an image), short prompts, as the interpreter is slow."""
    systems = [("USER: <image>\nDescribe it", [make_test_image(1)]), ("USER: You answer questions about small gardens", [])]
    prompts = [f"{system} {q} ASSISTANT:" for q in ("first?", "why?") for system, _ in systems]
    images = [systems[i % 2][1] for i in range(len(prompts))]
    inputs = dict(prompts=prompts, images=images, params=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    triton_on, stats, steps = run(checkpoint_dir, "on", backend="triton", **inputs)
    torch_off, _, _ = run(checkpoint_dir, "off", **inputs)
    assert triton_on == torch_off
    assert stats["cascade_steps"] > 0 and max(s["groups"] for s in steps) >= 2


def _shared_decodes(num: int, shared: list[int]) -> tuple[list[ScheduledRequest], dict[str, list[int]]]:
    scheduled, tables = [], {}
    for i in range(num):
        request = make_request(f"r{i}", 9, temperature=0.0)
        scheduled.append(ScheduledRequest(request, request.num_tokens - 1, 1, []))
        tables[request.request_id] = [*shared, 10 + i]
    return scheduled, tables


def test_a_cascade_step_runs_eager_when_its_bucket_has_no_cascade_graph():
    """Decode rows sharing blocks, and only a plain graph for their bucket: "on" takes the step
    eagerly, so it is not padded to the bucket."""
    policy = CascadePolicy(mode="on", block_size=4, tokens_per_tile=32, kv_bytes_per_token=8)
    buffers = InputBuffers(16, 8, 4, 4, vocab_size=32, device=torch.device("cpu"), cascade=policy)
    scheduled, tables = _shared_decodes(3, [5, 6])  # the first two blocks shared
    inputs = buffers.prepare(scheduled, tables, graph_size=4)
    assert inputs.graph_size is None and not inputs.graph_cascade
    assert inputs.num_tokens == 3 and inputs.metadata.num_reqs == 3
    cascade = inputs.metadata.cascade
    assert cascade.prefix_lens_cpu == [8] and cascade.suffix_seq_lens_cpu == [1, 1, 1]
    assert cascade.suffix_block_tables[:, 0].tolist() == [10, 11, 12]
    assert [g.rows for g in inputs.cascade_groups] == [[0, 1, 2]]
    off = InputBuffers(16, 8, 4, 4, vocab_size=32, device=torch.device("cpu"))
    assert off.prepare(scheduled, tables, graph_size=4).graph_size == 4


def test_a_cascade_step_fills_its_buckets_cascade_graph():
    """With a cascade graph for the bucket, the step stays padded to it and writes its layout into
    the buffers the graph was captured over: the counts it reads on the device, the padding rows'
    one-key suffixes. Groups beyond the graph's tiles send an "on" step back to eager."""
    policy = CascadePolicy(mode="on", block_size=4, tokens_per_tile=32, kv_bytes_per_token=8, num_kv_heads=2, num_sms=4)
    buffers = InputBuffers(16, 8, 4, 4, vocab_size=32, device=torch.device("cpu"), cascade=policy)
    captured = buffers.cascade_graph_metadata(4, GraphBounds(max_tiles=1, max_splits=2))
    assert (captured.max_work, captured.max_tokens, captured.max_splits) == (2, 4, 2)
    assert captured.counts.tolist() == [0, 1, 0]  # a capture runs no prefix work
    scheduled, tables = _shared_decodes(3, [5, 6])
    inputs = buffers.prepare(scheduled, tables, graph_size=4)
    assert inputs.graph_size == 4 and inputs.graph_cascade and [g.rows for g in inputs.cascade_groups] == [[0, 1, 2]]
    assert captured.counts.data_ptr() == inputs.metadata.cascade.counts.data_ptr()
    assert captured.counts.tolist() == [1, 1, 3]  # one tile, one split (an 8-key prefix), three tokens
    assert captured.suffix_seq_lens.tolist() == [1, 1, 1, PAD_SEQ_LEN]
    assert captured.token_indices[:3].tolist() == [0, 1, 2] and captured.prefix_lens[:1].tolist() == [8]
    # two groups, but the graph holds one tile: eager
    scheduled, tables = _shared_decodes(4, [])
    for i, blocks in enumerate(([5, 6], [5, 6], [7, 8], [7, 8])):
        tables[f"r{i}"] = [*blocks, 10 + i]
    inputs = buffers.prepare(scheduled, tables, graph_size=4)
    assert inputs.graph_size is None and not inputs.graph_cascade and len(inputs.cascade_groups) == 2


def test_cascade_graphs_give_the_eager_tokens(checkpoint_dir, no_tf32):
    """Decode steps replay the cascade variant of their bucket (the CPU stand-in for the capture,
    the Triton kernels in the interpreter) and give the tokens of cascade-free eager steps: two
    groups under different prefixes and an ungrouped request, padded to a bucket, with requests
    finishing at different steps so the groups change from replay to replay."""
    gardens = "USER: You answer questions about small gardens with patience and practical details, always."
    cooking = "USER: You are a cook who explains every recipe slowly, with the reasons for each step."
    prompts = [f"{gardens} {q} ASSISTANT:" for q in ("first?", "why?", "how so?")]
    prompts += [f"{cooking} {q} ASSISTANT:" for q in ("soup?", "bread?")] + ["USER: hi ASSISTANT:"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (5, 3, 4, 5, 2, 4)]
    tokens, replays = {}, {}
    for cascade in ("off", "auto"):
        engine = MMEngine(str(checkpoint_dir()), attn_backend="triton", dtype="float32", max_model_len=128, block_size=16,
                          max_num_seqs=8, cascade_attention=cascade)
        engine.runner.capture_cuda_graphs(EagerCapturer())
        graphs = engine.runner.decode_graphs
        assert graphs.cascade_sizes == ([] if cascade == "off" else [2, 4, 8])
        with patch("mmengine.runner.cascade_plan.MIN_SAVED_BYTES_PER_LAYER", 0):  # tiny K/V: always worth it
            tokens[cascade] = [o.token_ids for o in engine.generate(prompts, sampling_params=params, use_tqdm=False)]
        replays[cascade] = (graphs.num_replays, graphs.num_cascade_replays)
        assert engine.stats()["cascade_steps"] >= graphs.num_cascade_replays
    assert tokens["auto"] == tokens["off"]
    # the same decode steps replayed graphs; with cascade, those that had a group their cascade variant
    assert replays["off"] == (replays["auto"][0], 0) and replays["auto"][1] >= 2


@pytest.mark.parametrize("value", ["on", "off"])
def test_cascade_option_reaches_the_runner(checkpoint_dir, value):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=128, cascade_attention=value)
    assert (engine.runner.inputs.cascade is None) == (value == "off")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (the test above uses the CPU stand-in)")
def test_real_cascade_cuda_graphs_give_the_eager_tokens(checkpoint_dir, no_tf32):
    """Real cascade CUDA graphs (fp32, so greedy tokens are exact) against eager steps without
    cascade, with requests joining and leaving: the groups change from replay to replay."""
    prompt = "USER: You answer questions about small gardens with patience and practical details, always."
    prompts = [f"{prompt} {q} ASSISTANT:" for q in ("first?", "why?", "how so?", "and then?", "really?")]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 4, 12, 6, 7)]
    tokens = {}
    for cascade, eager in (("off", True), ("auto", False)):
        engine = MMEngine(str(checkpoint_dir()), device="cuda", dtype="float32", max_model_len=128, block_size=16,
                          max_num_seqs=8, cascade_attention=cascade, enforce_eager=eager, gpu_memory_utilization=0.3)
        with patch("mmengine.runner.cascade_plan.MIN_SAVED_BYTES_PER_LAYER", 0):  # tiny K/V: always worth it
            tokens[cascade] = [o.token_ids for o in engine.generate(prompts, sampling_params=params, use_tqdm=False)]
        if not eager:
            assert engine.runner.decode_graphs.num_cascade_replays >= 8
    assert tokens["auto"] == tokens["off"]
