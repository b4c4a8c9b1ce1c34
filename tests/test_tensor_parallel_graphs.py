"""CUDA graphs on every tensor-parallel rank (runner/parallel_graphs.py, distributed/graph_capture.py). On CPU the
ranks capture with the EagerCapturer stand-in, sent by the driver (a replay re-runs the captured step over the
rank's static buffers, its collectives over gloo included), so the buckets, the padding, the static buffers and
each rank's replay-or-eager decision are the ones a GPU runs. At TP 2 in fp32, LLaVA (with n-gram speculation:
decode and verify graphs) and Qwen3.5 (Gated DeltaNet states read and written inside the graph) give TP 1's
greedy tokens and logprobs within 1e-4, rank 0 replays exactly as often as TP 1 and rank 1 as rank 0, a batch of
three replays the bucket of four, and a step with a prefill chunk runs eager. A rank whose capture fails fails
the capture with a typed error and stops the others. On two GPUs the real graphs give the eager tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import chat_formats
from helpers import tensor_parallel_pairs, wait_until
from mmengine import MMEngine, SamplingParams
from mmengine.errors import CudaGraphCaptureError
from mmengine.runner.cuda_graphs import EagerCapturer, Replay
from mmengine.testing import make_test_image

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 32,
           "async_scheduling": "off", "speculative_config": NGRAM}
# LLaVA with adapters: each bucket also has a LoRA variant, whose row-parallel delta reads the slots on the device
OWN_OPTIONS = {"llava": {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}, "qwen3_5": {}}
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=2)
PICTURE = make_test_image(41, size=(64, 64))


def prompts(family: str) -> tuple[list[str], list[list]]:
    """Three prompts (a batch of three pads to the bucket of four), one with a picture, one that repeats itself
    (the n-gram proposer finds drafts in it)."""
    texts = ["Describe the picture.", "one two three one two three one two", "Tell me a story about a cat."]
    return [chat_formats.user_turn(family, text, 1 if i == 0 else 0) for i, text in enumerate(texts)], [[PICTURE], [], []]


@pytest.fixture(scope="module")
def engines(family_checkpoint):
    """family -> (checkpoint, TP 1 engine, TP 2 engine), every one's graphs captured with the stand-in."""
    paths = {family: family_checkpoint(family) for family in OWN_OPTIONS}
    with tensor_parallel_pairs(paths, OWN_OPTIONS, **OPTIONS) as pairs:
        for _, one, two in pairs.values():
            one.runner.capture_cuda_graphs(EagerCapturer())
            two.runner.capture_cuda_graphs(EagerCapturer())
        yield pairs


def rank_counts(engine: MMEngine) -> list:
    return engine.parallel.executor.call("graph_counts")


@pytest.mark.parametrize("family", ["llava", "qwen3_5"])
def test_tp2_graph_steps_give_tp1_tokens_logprobs_and_replays(engines, family):
    _, one, two = engines[family]
    texts, images = prompts(family)
    assert two.runner.decode_graphs.sizes == one.runner.decode_graphs.sizes == [1, 2, 4]
    assert two.runner.decode_graphs.verify_sizes == one.runner.decode_graphs.verify_sizes == [1, 2, 4]
    expected = one.generate(texts, images=images, sampling_params=GREEDY, use_tqdm=False)
    got = two.generate(texts, images=images, sampling_params=GREEDY, use_tqdm=False)
    for a, b in zip(expected, got, strict=True):
        assert b.token_ids == a.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    ones, twos = one.runner.decode_graphs, two.runner.decode_graphs
    assert twos.num_replays > 0 and twos.num_replays == ones.num_replays  # decodes without drafts
    assert twos.num_verify_replays > 0 and twos.num_verify_replays == ones.num_verify_replays  # with n-gram drafts
    rank0, rank1 = rank_counts(two)
    assert rank0 == rank1 and rank0.num_replays == twos.num_replays  # the same decision on both ranks, every step
    stats = two.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_batch_of_three_replays_the_bucket_of_four_and_a_prefill_step_runs_eager(engines):
    """Step by step: a step that computes a prompt chunk (alone or beside decodes) runs eager on both ranks; a step
    of three decodes replays, padded to four (there is no graph of three)."""
    _, _, two = engines["qwen3_5"]
    texts, images = prompts("qwen3_5")
    long_prompt = chat_formats.user_turn("qwen3_5", "a longer question " * 6, 0)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    for i, (text, picture) in enumerate(zip(texts[:2] + [long_prompt], images[:2] + [[]])):
        two.add_request(text, images=picture, sampling_params=params, request_id=f"step-{i}")
    seen = {"mixed": 0, "padded_replays": 0}
    while two.has_unfinished_requests():
        before, replays = two.stats(), rank_counts(two)
        two.step()
        after, now = two.stats(), rank_counts(two)
        assert now[0] == now[1]
        replayed = sum(now[0].__dict__.values()) - sum(replays[0].__dict__.values())  # a decode or a verify graph
        prefill = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
        decoded = after["tokens_computed"] - before["tokens_computed"] - prefill
        if prefill:
            assert replayed == 0
            seen["mixed"] += decoded > 0
        elif before["requests_running"] == 3:
            assert replayed == 1
            seen["padded_replays"] += 1
    assert seen["mixed"] > 0 and seen["padded_replays"] > 0, seen


def test_adapters_replay_the_lora_graphs_and_give_tp1_tokens(engines, tmp_path):
    """Decodes with an adapter replay the bucket's LoRA variant on both ranks; its o/down projections' delta is
    all-reduced inside the step (distributed/parallel_lora.py reads each row's slot from the device)."""
    from mmengine.lora.request import LoRARequest
    from mmengine.testing.lora import build_random_adapter

    path, one, two = engines["llava"]
    adapter = LoRARequest("every", str(build_random_adapter(path, tmp_path / "every", 4, scale=0.5, seed=3)))
    texts, images = prompts("llava")
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=1)
    expected = one.generate(texts, images=images, sampling_params=params, lora=[adapter, None, adapter], use_tqdm=False)
    got = two.generate(texts, images=images, sampling_params=params, lora=[adapter, None, adapter], use_tqdm=False)
    for a, b in zip(expected, got, strict=True):
        assert b.token_ids == a.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    plain = two.generate(texts[2], sampling_params=params, use_tqdm=False)[0]
    assert plain.token_ids != got[2].token_ids  # the adapter changed the answer
    ones, twos = one.runner.decode_graphs, two.runner.decode_graphs
    assert twos.num_lora_replays > 0 and twos.num_lora_replays == ones.num_lora_replays
    rank0, rank1 = rank_counts(two)
    assert rank0 == rank1


def test_cuda_graphs_are_no_longer_refused_and_ranks_must_plan_the_same_graphs(engines):
    from mmengine.config import EngineConfig
    from mmengine.runner.parallel_graphs import RemoteGraphs, check_same_capture_orders
    from mmengine.runner.parallel_runner import check_parallel_options

    path, one, two = engines["qwen3_5"]
    config = EngineConfig(str(path), tensor_parallel_size=2, enforce_eager=False)
    check_parallel_options(config, one.runner.family, torch.device("cuda"))  # was a ConfigError: graphs per rank now
    order = one.runner.plan_cuda_graphs().capture_order()
    assert order[:3] == [("verify", 4, False, False), ("verify", 2, False, False), ("verify", 1, False, False)]
    assert two.parallel.executor.call("graph_plan") == [order, order]
    check_same_capture_orders([order, order])
    with pytest.raises(CudaGraphCaptureError, match="rank 1 plans other CUDA graphs than rank 0.*enforce_eager=True"):
        check_same_capture_orders([order, order[:-1]])
    mirror = RemoteGraphs(order, verify_query_len=3)
    assert (mirror.sizes, mirror.verify_sizes, mirror.lora_sizes) == ([1, 2, 4], [1, 2, 4], [])


class FailOnRank:
    """The stand-in capturer, except that rank `rank` raises at its first capture (as a CUDA capture that runs out
    of memory would) while the others go on into the step's collectives, waiting for it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def capture(self, fn: Callable[[], None]) -> Replay:
        if torch.distributed.get_rank() == self.rank:
            raise RuntimeError("out of graph memory")
        return EagerCapturer().capture(fn)

    def synchronize(self) -> None:
        pass


def test_a_rank_whose_capture_fails_stops_every_rank_with_a_typed_error(engines):
    """(Last: it ends a module engine.) Rank 0 is inside a collective when rank 1 fails: it is stopped, not left
    waiting, and the error names the rank and enforce_eager=True."""
    _, _, two = engines["llava"]
    pids = list(two.parallel.executor.pids)
    with pytest.raises(CudaGraphCaptureError, match=r"rank 1 \(RuntimeError: out of graph memory\).*enforce_eager=True"):
        two.runner.capture_cuda_graphs(FailOnRank(1))
    assert two.dead_error is not None

    def gone(pid: int) -> bool:
        try:
            import psutil

            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    assert wait_until(lambda: all(gone(pid) for pid in pids), timeout_s=10)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs: real CUDA graphs with NCCL all-reduces "
                    "inside, per rank (the CPU tests above run the same buffers and decisions with the stand-in)")
def test_real_cuda_graphs_on_two_gpus_give_the_eager_tokens(family_checkpoint):
    path = family_checkpoint("qwen3_5")
    texts, images = prompts("qwen3_5")
    options = {"dtype": "float32", "max_model_len": 128, "max_num_seqs": 4, "tensor_parallel_size": 2}
    results = {}
    for eager in (True, False):
        engine = MMEngine(str(path), enforce_eager=eager, **options)
        try:
            assert engine.runner.use_cuda_graphs is not eager
            outs = engine.generate(texts, images=images, sampling_params=GREEDY, use_tqdm=False)
            results[eager] = outs
            if not eager:
                assert engine.runner.decode_graphs.num_replays > 0
        finally:
            engine.shutdown()
    for a, b in zip(results[True], results[False], strict=True):
        assert b.token_ids == a.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
