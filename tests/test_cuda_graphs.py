"""Decode-only steps replayed from captured graphs: buckets, padding, static buffers, and the same
tokens as eager steps. On CPU the capture is the EagerCapturer stand-in (a replay re-runs the
captured function over the same static buffers); on a GPU the real CUDA graphs are checked too."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import make_request
from mmengine import MMEngine, SamplingParams
from mmengine.runner.cuda_graphs import EagerCapturer, graph_batch_sizes, padded_batch_size
from mmengine.runner.inputs import PAD_SEQ_LEN, PAD_SLOT, InputBuffers
from mmengine.core.scheduler import ScheduledRequest
from mmengine.testing import make_test_image

PROMPTS = [
    "USER: <image>\nWhat is shown here? ASSISTANT:",
    "USER: hello there, tell me a story ASSISTANT:",
    "USER: <image> and <image>\nCompare them. ASSISTANT:",
    "<image>",
    "USER: a short one ASSISTANT:",
]
IMAGES = [[make_test_image(1)], [], [make_test_image(2), make_test_image(1)], [make_test_image(3)], []]


def test_bucket_sizes_and_padding():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, *range(80, 257, 16)]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64, max_size=6) == [1, 2, 4, 6]
    assert graph_batch_sizes(1) == [1]
    sizes = graph_batch_sizes(100)
    assert sizes[-1] == 100
    assert [padded_batch_size(n, sizes) for n in (1, 3, 5, 8, 9, 65, 100)] == [1, 4, 8, 8, 16, 80, 100]
    assert padded_batch_size(101, sizes) is None  # larger than every bucket: eager


def _decodes(num: int) -> tuple[list[ScheduledRequest], dict[str, list[int]]]:
    scheduled, tables = [], {}
    for i in range(num):
        request = make_request(f"r{i}", 5 + i, temperature=0.0)
        scheduled.append(ScheduledRequest(request, request.num_tokens - 1, 1, []))
        tables[request.request_id] = [10 + i, 20 + i]
    return scheduled, tables


def test_prepare_pads_a_decode_batch_with_rows_that_store_nothing():
    buffers = InputBuffers(max_tokens=16, max_reqs=8, max_blocks_per_req=4, block_size=4, vocab_size=32,
                           device=torch.device("cpu"))
    scheduled, tables = _decodes(3)
    inputs = buffers.prepare(scheduled, tables, graph_size=4)
    md = inputs.metadata
    assert inputs.num_tokens == 3 and inputs.input_ids.shape == (4,) and md.num_decodes == 4
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert md.seq_lens.tolist() == [5, 6, 7, PAD_SEQ_LEN]
    # real rows: the last prompt token's slot (positions 4, 5, 6: each request's second block);
    # the pad row stores nothing
    assert md.slot_mapping.tolist() == [20 * 4 + 0, 21 * 4 + 1, 22 * 4 + 2, PAD_SLOT]
    assert inputs.input_ids.tolist() == [5, 6, 7, 0] and inputs.positions.tolist() == [4, 5, 6, 0]
    assert md.block_tables[:3, :2].tolist() == [[10, 20], [11, 21], [12, 22]]
    assert inputs.logits_indices.tolist() == [0, 1, 2]
    assert inputs.sampling is None  # all greedy: no per-row sampling tensors at all

    # The same buffers serve the next step: views, not new tensors.
    again = buffers.prepare(*_decodes(2))
    assert again.metadata.slot_mapping.data_ptr() == md.slot_mapping.data_ptr() == buffers.slot_mapping.device.data_ptr()
    assert again.input_ids.data_ptr() == buffers.input_ids.device.data_ptr()
    assert again.graph_size is None and again.input_ids.shape == (2,)


def test_prepare_fills_sampling_rows_for_random_requests():
    buffers = InputBuffers(16, 8, 4, 4, vocab_size=32, device=torch.device("cpu"))
    scheduled, tables = _decodes(3)
    scheduled[1].request.sampling_params = SamplingParams(temperature=0.7, top_k=100, top_p=0.5)
    scheduled[2].request.sampling_params = SamplingParams()
    inputs = buffers.prepare(scheduled, tables)
    assert inputs.sampling is not None
    assert inputs.sampling.greedy.tolist() == [True, False, False]
    assert inputs.sampling.top_k.tolist() == [32, 32, 32]  # 100 is capped at the vocabulary
    assert inputs.sampling.top_p[1].item() == pytest.approx(0.5)
    assert inputs.sampling.temperature[1].item() == pytest.approx(0.7)


def _engine(path, graphs: bool, **kwargs) -> MMEngine:
    engine = MMEngine(str(path), device="cpu", max_model_len=256, max_num_seqs=8, block_size=16, **kwargs)
    if graphs:
        report = engine.runner.capture_cuda_graphs(EagerCapturer())
        assert report.sizes == [1, 2, 4, 8]
    return engine


def test_graph_steps_give_the_eager_tokens(checkpoint_dir):
    """Mixed batches: prefills run eager, decode-only steps replay a bucket padded beyond the batch,
    and the tokens equal a run without graphs (greedy and seeded sampling)."""
    path = checkpoint_dir()
    params = [SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True)] * 3 + [
        SamplingParams(max_tokens=7, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.0, top_k=7, seed=11, ignore_eos=True),
    ]
    results = {}
    for graphs in (False, True):
        engine = _engine(path, graphs)
        outs = engine.generate(PROMPTS, images=IMAGES, sampling_params=params, use_tqdm=False)
        results[graphs] = [o.token_ids for o in outs]
        if graphs:
            assert engine.runner.decode_graphs.num_replays >= 6  # every decode-only step after the prefills
            assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
    assert results[True] == results[False]


def test_static_buffers_are_reused_step_after_step(checkpoint_dir):
    engine = _engine(checkpoint_dir(), graphs=True)
    buffers = engine.runner.inputs
    pointers = {name: getattr(buffers, name).device.data_ptr() for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")}
    seen = []
    prepare = buffers.prepare

    def spy(*args, **kwargs):
        inputs = prepare(*args, **kwargs)
        seen.append((inputs.graph_size, inputs.input_ids.data_ptr(), inputs.metadata.block_tables.data_ptr()))
        return inputs

    buffers.prepare = spy
    engine.generate(PROMPTS[:3], images=IMAGES[:3], sampling_params=SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert {getattr(buffers, name).device.data_ptr() for name in pointers} == set(pointers.values())
    assert {(ids, tables) for _, ids, tables in seen} == {(pointers["input_ids"], pointers["block_tables"])}
    assert {size for size, _, _ in seen} >= {None, 4}  # eager prefills, then 3 decodes padded to 4


def test_a_decode_shaped_step_on_an_image_placeholder_runs_eager(checkpoint_dir):
    """A full prefix hit recomputes only the last prompt token; when that token is an image
    placeholder its embedding comes from the encoder cache, which a graph step cannot splice in."""
    engine = _engine(checkpoint_dir(), graphs=True)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    (first,) = engine.generate("<image>", images=[IMAGES[3][0]], sampling_params=params, use_tqdm=False)
    replays = engine.runner.decode_graphs.num_replays
    (second,) = engine.generate("<image>", images=[IMAGES[3][0]], sampling_params=params, use_tqdm=False)
    assert second.num_cached_tokens == len(second.prompt_token_ids) - 1  # one recomputed token
    assert engine.runner.decode_graphs.num_replays == replays  # ... run eagerly
    assert second.token_ids == first.token_ids
    # The same with a text last token (a prompt of whole blocks, so the hit is full) replays a graph.
    prompt = next(p for p in (f"USER: <image>\nhi{' so' * k} ASSISTANT:" for k in range(32))
                  if len(engine.input_processor.process(p, IMAGES[0], params).prompt_token_ids) % 16 == 0)
    engine.generate(prompt, images=IMAGES[0], sampling_params=params, use_tqdm=False)
    replays = engine.runner.decode_graphs.num_replays
    (hit,) = engine.generate(prompt, images=IMAGES[0], sampling_params=params, use_tqdm=False)
    assert hit.num_cached_tokens == len(hit.prompt_token_ids) - 1
    assert engine.runner.decode_graphs.num_replays == replays + 1


def test_batches_beyond_the_largest_bucket_run_eager(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), device="cpu", max_model_len=256, max_num_seqs=8, max_cuda_graph_batch_size=2)
    engine.runner.capture_cuda_graphs(EagerCapturer())
    assert engine.runner.decode_graphs.sizes == [1, 2]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate(["USER: hi ASSISTANT:"] * 3, sampling_params=params, use_tqdm=False)
    assert engine.runner.decode_graphs.num_replays == 0
    engine.generate(["USER: hi ASSISTANT:"] * 2, sampling_params=params, use_tqdm=False)
    assert engine.runner.decode_graphs.num_replays == 3


def test_enforce_eager_and_cpu_capture_nothing(checkpoint_dir):
    assert _engine(checkpoint_dir(), graphs=False).runner.decode_graphs is None  # CPU: no CUDA graphs by default
    assert not MMEngine(str(checkpoint_dir()), device="cpu", max_model_len=256, enforce_eager=True).runner.use_cuda_graphs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (the CPU stand-in covers the bookkeeping)")
def test_cuda_graphs_give_the_eager_tokens_on_gpu(checkpoint_dir):
    """Real CUDA graphs against eager steps on the same GPU, fp32 so greedy tokens are exact."""
    path = checkpoint_dir()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    results = {}
    for eager in (True, False):
        engine = MMEngine(str(path), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=8,
                          enforce_eager=eager, gpu_memory_utilization=0.3)
        assert (engine.runner.decode_graphs is None) == eager
        results[eager] = [o.token_ids for o in engine.generate(PROMPTS, images=IMAGES, sampling_params=params, use_tqdm=False)]
        if not eager:
            assert engine.runner.decode_graphs.num_replays > 0
    assert results[False] == results[True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (the CPU stand-in covers the bookkeeping)")
def test_graph_memory_is_measured_and_counted_against_the_kv_cache(checkpoint_dir, caplog):
    """The graphs' private pool is positive (a capture empties the allocator's cache first, which
    must not read as memory the graphs gave back) and comes off the KV cache's share."""
    with caplog.at_level(logging.INFO, logger="mmengine"):
        engine = MMEngine(str(checkpoint_dir()), device="cuda", dtype="float32", max_model_len=256, max_num_seqs=16,
                          gpu_memory_utilization=0.3)
    report = engine.runner.capture_cuda_graphs()
    assert report.memory_bytes > 0 and report.sizes == engine.runner.decode_graphs.sizes
    profile = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache profile")]
    assert profile and int(profile[0].split("CUDA graphs ")[1].split(" ")[0]) > 0
