"""The engine at tensor_parallel_size=2 (two gloo ranks on CPU, runner/parallel_runner.py): the greedy
tokens of TP 1 and of transformers with pictures, chunked prefill, a prefix hit and preemption, with async
scheduling and without; logprobs within 1e-4 of TP 1 in fp32; options it refuses by name before any process starts; a killed worker as EngineDeadError
within seconds; shutdown leaves no process behind.

One TP 2 engine serves the module (starting one costs two interpreters importing torch and transformers); the
last test kills one of its workers."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from conftest import CPU_FP32, hf_greedy
from helpers import wait_until
from mmengine import MMEngine, SamplingParams
from mmengine.errors import ConfigError, EngineDeadError
from mmengine.testing import TinyLlavaSpec, make_test_image

# A step takes at most 16 tokens (a picture's 16 placeholders fit; the prompts' prefills take two or three
# chunks), and 8 blocks of 16 tokens hold about three of the requests below at once: the batch preempts.
ENGINE_OPTIONS = {"max_model_len": 128, "max_num_batched_tokens": 16, "num_kv_blocks": 8, "max_num_seqs": 4,
                  "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
PROMPTS = [
    "USER: <image>\nWhat is shown here? ASSISTANT:",
    "USER: <image>\nDescribe the colours of this picture in detail. ASSISTANT:",
    "USER: Tell me a story about a cat. ASSISTANT:",
    "USER: <image>\n<image>\nCompare the two pictures. ASSISTANT:",
]
IMAGES = [[make_test_image(1)], [make_test_image(2)], [], [make_test_image(1), make_test_image(3)]]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)


def children() -> set[int]:
    """This process's live children but multiprocessing's resource tracker (one per process, for its lifetime)."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


@pytest.fixture(scope="module")
def llava(checkpoint_dir):
    """One KV head: at TP 2 each rank holds a replica of it (the split of KV heads is Qwen3-VL's test's)."""
    return checkpoint_dir(TinyLlavaSpec(num_key_value_heads=1))


@pytest.fixture(scope="module")
def tp1(llava):
    return MMEngine(str(llava), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def tp1_outputs(tp1):
    return tp1.generate(PROMPTS, images=IMAGES, sampling_params=GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def tp2(llava):
    before = children()
    # async scheduling: the driver sends the next step before it reads this one's tokens (the ranks fill in the
    # placeholders with the tokens they sampled); Qwen3-VL-MoE's test runs steps one at a time
    engine = MMEngine(str(llava), tensor_parallel_size=2, async_scheduling="on", **ENGINE_OPTIONS)
    engine.children_before = before
    yield engine
    engine.shutdown()


def test_batch_with_pictures_chunks_and_preemption_gives_tp1_and_transformers_tokens(tp2, tp1_outputs, llava):
    before = tp2.stats()
    outputs = tp2.generate(PROMPTS, images=IMAGES, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in tp1_outputs]
    for prompt, images, output in zip(PROMPTS, IMAGES, outputs):
        assert output.token_ids == hf_greedy(llava, prompt, images, GREEDY.max_tokens, CPU_FP32, ignore_eos=True)
    stats = tp2.stats()
    assert stats["num_preemptions"] > before["num_preemptions"]  # the 8 blocks did not hold the batch
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # every block back (cached or free)
    assert stats["encoder_cache_referenced"] == 0
    assert tp2.steps.async_scheduling and tp2.parallel.max_in_flight == 2  # a step sent while the one before ran


def test_a_repeat_computes_at_most_one_block_and_encodes_each_picture_once(tp2):
    prompt, images = PROMPTS[1], [make_test_image(7)]
    first = tp2.generate(prompt, images=images, sampling_params=GREEDY, use_tqdm=False)[0]
    before = tp2.stats()
    again = tp2.generate(prompt, images=images, sampling_params=GREEDY, use_tqdm=False)[0]
    after = tp2.stats()
    assert again.token_ids == first.token_ids
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] <= 16
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 16
    assert after["encoder_runs"] == before["encoder_runs"]  # the picture was encoded once, by the first


def test_logprobs_and_seeded_sampling_match_tp1(tp1, tp2):
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, logprobs=3, prompt_logprobs=2),
              SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, top_p=0.9, seed=11, logprobs=2)]
    prompts, images = [PROMPTS[0], PROMPTS[2]], [IMAGES[0], []]
    ones = tp1.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    twos = tp2.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    for one, two in zip(ones, twos):
        assert two.token_ids == one.token_ids
        for a, b in zip(one.logprobs, two.logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-4
    one_prompt, two_prompt = ones[0].prompt_logprobs, twos[0].prompt_logprobs
    assert len(one_prompt) == len(two_prompt) and one_prompt[0] is None and two_prompt[0] is None
    assert max(abs(a.logprob - b.logprob) for a, b in zip(one_prompt[1:], two_prompt[1:])) < 1e-4


@pytest.mark.parametrize(("options", "named"), [
    ({"tensor_parallel_size": 3}, "num_attention_heads=4 is not divisible by tensor_parallel_size=3"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "carrier-pigeon"}, "distributed_executor_backend"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive int"),
    ({"tensor_parallel_size": 2, "mm_encoder_tp_mode": "diagonal"}, "mm_encoder_tp_mode must be 'weights' or 'data'"),
])
def test_what_tensor_parallelism_refuses_is_named_before_any_process_starts(llava, options, named):
    before = children()
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
        MMEngine(str(llava), max_model_len=128, **options)
    assert children() <= before


def test_a_rank_that_fails_to_load_reports_what_failed_and_leaves_nothing(llava, tmp_path):
    """A checkpoint missing a tensor: the ranks' own WeightsMismatchError names it (the death it causes during
    start-up must not hide it), and no process is left."""
    import shutil

    from safetensors.torch import load_file, save_file

    from mmengine.errors import WeightsMismatchError

    broken = tmp_path / "broken"
    shutil.copytree(llava, broken)
    (weights,) = broken.glob("*.safetensors")
    tensors = load_file(weights)
    missing = next(name for name in tensors if "layers.1.mlp.down_proj" in name)
    del tensors[missing]
    save_file(tensors, weights, metadata={"format": "pt"})
    before = children()
    with pytest.raises(WeightsMismatchError, match="layers.1.mlp.down_proj"):
        MMEngine(str(broken), tensor_parallel_size=2, **ENGINE_OPTIONS)
    assert wait_until(lambda: children() <= before, timeout_s=10)


def test_lora_adapters_give_tp1_tokens(tp1, tp2, llava, tmp_path):
    """Adapters sharded like their base layers: A whole and B split on q/k/v and gate/up, A split and the shrink
    all-reduced on o and down (distributed/parallel_lora.py); two adapters and the base model in one batch."""
    from mmengine.lora.request import LoRARequest
    from mmengine.testing.lora import build_random_adapter

    every = build_random_adapter(llava, tmp_path / "every", 4, scale=0.5, seed=1)
    rows = build_random_adapter(llava, tmp_path / "rows", 8, targets=("o_proj", "down_proj", "v_proj"), scale=0.5, seed=2)
    prompts, images = [PROMPTS[0], PROMPTS[2], PROMPTS[2]], [IMAGES[0], [], []]
    loras = [LoRARequest("every", str(every)), LoRARequest("rows", str(rows)), None]
    ones = tp1.generate(prompts, images=images, sampling_params=GREEDY, lora=loras, use_tqdm=False)
    twos = tp2.generate(prompts, images=images, sampling_params=GREEDY, lora=loras, use_tqdm=False)
    assert [o.token_ids for o in twos] == [o.token_ids for o in ones]
    assert twos[1].token_ids != twos[2].token_ids  # the adapter changed the answer


def test_pictures_reach_the_ranks_in_shared_memory_which_is_unlinked_after_the_step(tp1, tp2, monkeypatch):
    from pathlib import Path

    from mmengine.runner import parallel_runner, shared_pixels

    created: list[str] = []  # this engine's segments (other processes' come and go in /dev/shm meanwhile)

    class Recorded(shared_pixels.PlanSegment):
        def __init__(self, items) -> None:
            super().__init__(items)
            if self.memory is not None:
                created.append(self.memory.name)

    monkeypatch.setattr(shared_pixels, "MIN_SHARED_BYTES", 0)  # the tiny pictures too
    monkeypatch.setattr(parallel_runner, "PlanSegment", Recorded)
    pictures = [[make_test_image(21)], [make_test_image(22), make_test_image(23)]]
    prompts = [PROMPTS[0], PROMPTS[3]]
    ones = tp1.generate(prompts, images=pictures, sampling_params=GREEDY, use_tqdm=False)
    twos = tp2.generate(prompts, images=pictures, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in twos] == [o.token_ids for o in ones]
    assert not tp2.parallel.segments and not tp2.parallel.segments_of
    assert created and not any((Path("/dev/shm") / name.lstrip("/")).exists() for name in created)


def test_budget_prints_each_ranks_weights_and_kv_cache_as_the_ranks_hold_them(tp2, llava, capsys):
    import re

    from mmengine.cli import main

    assert main(["budget", "--model", str(llava), "--tensor-parallel-size", "2", "--num-kv-blocks", "8"]) in (0, None)
    text = capsys.readouterr().out
    whole = int(re.search(r"^weights\s+(\d+)", text, re.M)[1])
    per_rank = int(re.search(r"weights per rank\s+(\d+)", text)[1])
    block = int(re.search(r"KV cache per rank, one block\s+(\d+)", text)[1])
    assert block == tp2.parallel.kv_block_bytes  # the one KV head on every rank: TP 1's block
    assert "1 of 1 KV heads" in text
    held = tp2.parallel.weight_bytes_per_rank
    # the checkpoint's tensors the model never loads (the tower's last layer, LLaVA's feature layer -2) aside
    assert per_rank < whole and held[0] == held[1] and whole - per_rank <= whole - held[0]


def test_a_killed_worker_is_engine_dead_within_seconds_and_shutdown_leaves_no_process(tp2):
    """(Last: it kills the module's engine.) A generate() in flight raises EngineDeadError, as does every later call."""
    pids = tp2.parallel.executor.pids
    assert set(pids) <= children()
    failure: list[BaseException] = []

    def generate() -> None:
        try:
            tp2.generate(PROMPTS[2], sampling_params=SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.0), use_tqdm=False)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            failure.append(err)

    thread = threading.Thread(target=generate)
    started = tp2.stats()["generation_tokens"]
    thread.start()
    while tp2.stats()["generation_tokens"] == started and thread.is_alive():  # the request is decoding
        time.sleep(0.002)
    killed = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - killed < 5
    assert failure and isinstance(failure[0], EngineDeadError) and "rank 1" in str(failure[0])
    with pytest.raises(EngineDeadError):
        tp2.generate(PROMPTS[2], sampling_params=GREEDY, use_tqdm=False)
    tp2.shutdown()
    deadline = time.monotonic() + 5
    while children() - tp2.children_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not children() - tp2.children_before


def test_qwen3_vl_moe_gives_tp1_and_transformers_tokens_with_pictures_encoded_on_both_ranks(family_checkpoint):
    """Qwen3-VL's decoder (M-RoPE positions, DeepStack levels, per-head q/k norms, two KV heads split) with routed
    experts split on their intermediate size and a dense layer (mlp_only_layers); the tower in data mode. Qwen3-VL and Qwen2.5-VL (q/k/v
    biases) run the same split decoder without the experts."""
    import chat_formats
    from conftest import hf_greedy as transformers_greedy

    path = family_checkpoint("qwen3_vl_moe")
    prompts = [chat_formats.user_turn("qwen3_vl_moe", "Compare the pictures.", 2), chat_formats.user_turn("qwen3_vl_moe", "Tell me a story.", 0)]
    images = [[make_test_image(11), make_test_image(12, size=(64, 30))], []]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=2)
    options = {"max_model_len": 256, "max_num_batched_tokens": 128}
    ones = MMEngine(str(path), **options).generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    # mm_encoder_tp_mode="data": the step's two pictures are encoded one on each rank, the outputs shared
    with MMEngine(str(path), tensor_parallel_size=2, mm_encoder_tp_mode="data", **options) as engine:
        twos = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
        assert engine.stats()["encoder_runs"] == 2
    for prompt, pictures, one, two in zip(prompts, images, ones, twos):
        assert two.token_ids == one.token_ids == transformers_greedy(path, prompt, pictures, 8, CPU_FP32, ignore_eos=True)
        assert max(abs(a.logprob - b.logprob) for a, b in zip(one.logprobs, two.logprobs)) < 1e-4


def test_gemma4_gives_transformers_tokens_with_pictures_across_both_pools(family_checkpoint):
    """Gemma 4's decoder split: per-layer inputs (their embedding table split over the vocabulary), KV-shared layers
    reading their source's split cache, sliding and global layers (two pools, each its own KV heads), pictures
    attended both ways. (Gemma 3's decoder is split by the same code, and Llama 4's attention by it too, checked by
    hand.)"""
    import chat_formats
    from conftest import hf_greedy as transformers_greedy

    path = family_checkpoint("gemma4")
    prompts = [chat_formats.user_turn("gemma4", "What is shown here?", 1), chat_formats.user_turn("gemma4", "Tell me a story.", 0)]
    images = [[make_test_image(11)], []]
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    with MMEngine(str(path), tensor_parallel_size=2, max_model_len=256) as engine:
        outputs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
        assert engine.runner.window_pool is not None and engine.runner.num_window_blocks > 0  # the sliding layers' own pool
    for prompt, pictures, output in zip(prompts, images, outputs):
        assert output.token_ids == transformers_greedy(path, prompt, pictures, 8, CPU_FP32, ignore_eos=True)


def test_a_rank_in_process_runs_a_plan_as_the_engine_runs_the_step_and_applies_the_plans_grammar_mask(llava, tp1):
    """runner/worker.py's ModelWorker at TP 1 (no process, no collective): a plan's request gives the engine's greedy
    token, and a row's bitmask (what the driver's grammar allows) decides the token."""
    import torch

    from mmengine.config import EngineConfig
    from mmengine.distributed.process_group import single_rank_group
    from mmengine.engine.startup import build_input_parts
    from mmengine.runner.step_plan import NewRequest, PlannedRow, StepPlan
    from mmengine.runner.worker import ModelWorker

    config = EngineConfig(str(llava), max_model_len=128)
    parts = build_input_parts(config)
    worker = ModelWorker(single_rank_group(), config=config, family=parts.family, model_dir=str(llava), dtype=torch.float32,
                         max_model_len=parts.max_model_len)
    worker.allocate_kv_cache(8)
    prompt = parts.input_processor.tokenizer("USER: Tell me a story about a cat. ASSISTANT:").input_ids
    expected = tp1.generate({"prompt_token_ids": prompt}, sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                            use_tqdm=False)[0].token_ids
    vocab = parts.family.text_config.vocab_size
    mask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    mask[0, 42 // 32] = 1 << (42 % 32)  # the grammar allows token 42 alone
    for request_id, row_mask, tokens in (("free", None, expected), ("masked", mask, [42])):
        plan = StepPlan(new_requests=[NewRequest(request_id, prompt, [], None, SamplingParams(max_tokens=4, temperature=0.0))],
                        rows=[PlannedRow(request_id, 0, len(prompt), [], len(prompt), [], 0, row_mask)],
                        block_tables={request_id: [0, 1]})
        assert worker.execute_step(plan).tokens == {request_id: tokens}
        worker.execute_step(StepPlan(forget=[request_id]))
    assert worker.requests == {}


def test_qwen3_5_moe_hybrid_decoder_gives_tp1_and_transformers_tokens_with_chunks_and_a_checkpoint_restored(family_checkpoint):
    """Gated DeltaNet layers split by their key and value heads (each rank's recurrent states hold its heads; the
    16-token checkpoints are taken and restored on every rank in the same step) and the gated attention by its
    heads, the routed experts (stored one by one in this checkpoint) on their intermediate size, the gated shared
    expert as an MLP: the tokens of TP 1 and of transformers with a picture in chunks, then a repeat that resumes
    from a checkpoint. (Dense Qwen3.5 runs the same layers without the experts.)"""
    import chat_formats
    from conftest import hf_greedy as transformers_greedy

    path = family_checkpoint("qwen3_5_moe")
    prompt = chat_formats.user_turn("qwen3_5_moe", "What is shown here? Describe it.", 1)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
    penalized = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, frequency_penalty=-2.0)  # (repeats its answer)
    options = {"max_model_len": 256, "max_num_batched_tokens": 32}
    reference = MMEngine(str(path), **options)
    one = reference.generate(prompt, images=[make_test_image(11)], sampling_params=params, use_tqdm=False)[0]
    assert one.token_ids == transformers_greedy(path, prompt, [make_test_image(11)], 8, CPU_FP32, ignore_eos=True)
    speculative = {"method": "ngram", "num_speculative_tokens": 2}
    with MMEngine(str(path), tensor_parallel_size=2, speculative_config=speculative, **options) as engine:
        first = engine.generate(prompt, images=[make_test_image(11)], sampling_params=params, use_tqdm=False)[0]
        again = engine.generate(prompt, images=[make_test_image(11)], sampling_params=params, use_tqdm=False)[0]
        stats = engine.stats()
        # drafts the model keeps (the answer itself, but a wrong one every second proposal): verify steps on the ranks
        engine.steps.drafts.proposer = AnswerProposer(one.prompt_token_ids, one.token_ids)
        drafted = engine.generate(prompt, images=[make_test_image(12)], sampling_params=params, use_tqdm=False)[0]
        spec = engine.stats()
        # penalized: the ranks count each verify row's kept tokens, known once the driver books them (StepPlan.kept_tokens)
        penalized_answer = reference.generate(prompt, images=[make_test_image(12)], sampling_params=penalized, use_tqdm=False)[0]
        engine.steps.drafts.proposer = AnswerProposer(one.prompt_token_ids, penalized_answer.token_ids)
        drafted_penalized = engine.generate(prompt, images=[make_test_image(12)], sampling_params=penalized, use_tqdm=False)[0]
        kept = engine.stats()["spec_accepted_tokens"] - spec["spec_accepted_tokens"]
    assert first.token_ids == again.token_ids == one.token_ids
    assert again.num_cached_tokens > 0 and stats["state_checkpoint_hits"] >= 1 and stats["encoder_runs"] == 1
    assert drafted.token_ids == reference.generate(prompt, images=[make_test_image(12)], sampling_params=params, use_tqdm=False)[0].token_ids
    assert spec["spec_accepted_tokens"] > stats["spec_accepted_tokens"] and spec["spec_draft_tokens"] > spec["spec_accepted_tokens"]
    assert drafted_penalized.token_ids == penalized_answer.token_ids != drafted.token_ids and kept > 0


class AnswerProposer:
    """Proposes a known answer's next tokens for a prompt of the same length (the image differs: the answer is
    right until it is not), and a wrong token every second proposal."""

    def __init__(self, prompt_ids: list[int], answer: list[int]) -> None:
        self.prompt_length, self.answer, self.proposals = len(prompt_ids), answer, 0

    def propose(self, request_id: str, token_ids: list[int], max_drafts: int) -> list[int]:
        done = len(token_ids) - self.prompt_length
        drafts = list(self.answer[done : done + min(2, max_drafts)])
        self.proposals += 1
        if drafts and self.proposals % 2 == 0:
            drafts[0] = (drafts[0] + 1) % 50
        return drafts

    def forget(self, request_id: str) -> None:
        pass


def test_data_mode_splits_a_steps_pictures_by_size_alike_on_every_rank():
    import torch

    from mmengine.distributed.encoder_data_parallel import split_items

    items = [{"pixel_values": torch.zeros(n)} for n in (10, 40, 25, 5, 30)]
    # largest first to the lighter rank: 40 -> 0, 30 -> 1, 25 -> 1, 10 -> 0, 5 -> 0: 55 and 55
    assert split_items(items, 2) == [0, 0, 1, 0, 1]
    assert split_items(items, 1) == [0] * 5


def test_a_plans_pictures_share_one_segment_request_by_request_and_come_back_equal():
    import torch

    from mmengine.core.request import MMItem
    from mmengine.runner.shared_pixels import PlanSegment, SharedTensor, take_shared

    items = [MMItem("image", f"h{i}", 0, 4, {"pixel_values": torch.randn(3, 96, 96 + i), "image_grid_thw": torch.tensor([1, 2, 2])})
             for i in range(3)]
    segment = PlanSegment(items)
    shared = segment.share(items[:1]) + segment.share(items[1:])  # two requests of one plan
    try:
        assert all(isinstance(item.encoder_inputs["pixel_values"], SharedTensor) for item in shared)
        assert all(isinstance(item.encoder_inputs["image_grid_thw"], torch.Tensor) for item in shared)  # small: in the plan
        for original, back in zip(items, take_shared(shared)):
            assert torch.equal(original.encoder_inputs["pixel_values"], back.encoder_inputs["pixel_values"])
    finally:
        segment.release()
