"""The prefix cache's host tier (kv_cache_host_bytes): full blocks evicted from the device keep their
KV in host memory and come back by a copy; a shared prefix evicted under pressure and asked again
costs only its uncached tail; outputs equal a run without tiers; blocks that pin a picture stay out;
a copy that cannot be made falls back to recomputing."""

from __future__ import annotations

import pytest
import torch

from books import assert_books_consistent
from mmengine import MMEngine, SamplingParams
from mmengine.kv_cache.host_tier import HostBlock, KVCopy
from mmengine.testing import make_test_image

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
SYSTEM = "SYSTEM: " + " ".join(f"rule {i} is that answers are short and clear." for i in range(12))
PRESSURE = [f"USER: unrelated question number {i} about boats and rivers and the sea? ASSISTANT:" * 3 for i in range(6)]
OPTIONS = dict(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=24, enable_prefix_grouping=False)


def _evict_then_ask_again(engine: MMEngine, images=None, system: str = SYSTEM) -> tuple[list[list[int]], int]:
    """The system prompt once, unrelated prompts that push its blocks out, then the system prompt with a
    new question: the tokens, and the prefill tokens that last request computed."""
    first = engine.generate(system + " USER: first? ASSISTANT:", images=images, sampling_params=GREEDY, use_tqdm=False)[0]
    engine.generate(PRESSURE, sampling_params=GREEDY, use_tqdm=False)
    before = engine.stats()["prefill_tokens_computed"]
    again = engine.generate(system + " USER: second? ASSISTANT:", images=images, sampling_params=GREEDY, use_tqdm=False)[0]
    return [first.token_ids, again.token_ids], engine.stats()["prefill_tokens_computed"] - before


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_an_evicted_shared_prefix_comes_back_from_host_memory(checkpoint_dir, async_scheduling):
    path = str(checkpoint_dir())
    without = MMEngine(path, kv_cache_host_bytes=0, async_scheduling=async_scheduling, **OPTIONS)
    expected, computed_without = _evict_then_ask_again(without)
    engine = MMEngine(path, kv_cache_host_bytes=1 << 22, async_scheduling=async_scheduling, **OPTIONS)
    tokens, computed = _evict_then_ask_again(engine)
    assert tokens == expected
    prompt_len = len(engine.tokenizer(SYSTEM + " USER: second? ASSISTANT:")["input_ids"])
    assert computed_without == prompt_len  # without the tier the whole prompt is prefilled again
    stats = engine.stats()
    shared_blocks = stats["kv_host_hits"]
    assert shared_blocks >= 10 and computed == prompt_len - shared_blocks * 16  # only the tail past the shared blocks
    assert stats["kv_host_blocks"] > 0 and stats["kv_host_bytes"] == stats["kv_host_blocks"] * engine.runner.kv_block_bytes
    assert_books_consistent(engine)
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_fp8_blocks_come_back_from_host_memory_bit_for_bit(checkpoint_dir):
    """kv_cache_dtype="fp8": the tier copies the e4m3 bytes out and back (index_copy_ has no FP8 kernel,
    so the restore scatters bytes): the tokens equal the same FP8 engine without a tier."""
    path = str(checkpoint_dir())
    without = MMEngine(path, kv_cache_host_bytes=0, kv_cache_dtype="fp8", **OPTIONS)
    expected, _ = _evict_then_ask_again(without)
    engine = MMEngine(path, kv_cache_host_bytes=1 << 22, kv_cache_dtype="fp8", **OPTIONS)
    tokens, _ = _evict_then_ask_again(engine)
    assert tokens == expected and engine.stats()["kv_host_hits"] >= 10
    assert engine.stats()["kv_host_bytes"] == engine.stats()["kv_host_blocks"] * engine.runner.kv_block_bytes


def _prompt_len(engine: MMEngine, prompt: str, picture) -> int:
    return len(engine.input_processor.process(prompt, picture, GREEDY).prompt_token_ids)


@pytest.mark.parametrize("picture_output", ["resident", "evicted", "in the encoder host tier"])
def test_blocks_that_pin_a_picture_come_back_only_with_its_output(checkpoint_dir, picture_output):
    """A picture early in the prompt: the block it ends in pins it. That block (and the chain after it)
    comes back from the host tier while the picture's output is resident or in the encoder's host tier;
    when it is gone, the chain stops before that block. Never a re-encode after a prefix hit."""
    path = str(checkpoint_dir())
    picture = [make_test_image(9, size=(64, 48))]
    system = "USER: <image>\n" + SYSTEM
    options = dict(OPTIONS, encoder_cache_host_bytes=1 << 22 if picture_output == "in the encoder host tier" else 0)
    expected, _ = _evict_then_ask_again(MMEngine(path, kv_cache_host_bytes=0, **OPTIONS), picture, system)
    engine = MMEngine(path, kv_cache_host_bytes=1 << 22, **options)
    engine.generate(system + " USER: first? ASSISTANT:", images=picture, sampling_params=GREEDY, use_tqdm=False)
    engine.generate(PRESSURE, sampling_params=GREEDY, use_tqdm=False)  # the system prompt's blocks go to the host tier
    if picture_output != "resident":
        engine.encoder_cache.reset()  # the picture's output leaves the device (to the encoder host tier, if any)
        engine.runner.free_encoder_outputs(engine.encoder_cache.take_freed())
    runs = engine.stats()["encoder_runs"]
    (again,) = engine.generate(system + " USER: second? ASSISTANT:", images=picture, sampling_params=GREEDY, use_tqdm=False)
    assert again.token_ids == expected[1]
    stats = engine.stats()
    assert stats["reencodes_after_prefix_hit"] == 0
    item = engine.input_processor.process(system, picture, GREEDY).mm_items[0]
    pinning_block = item.offset // 16  # the first block that ends inside the picture (or at its end) pins it
    full_blocks = _prompt_len(engine, system + " USER: second? ASSISTANT:", picture) // 16
    if picture_output == "evicted":
        assert stats["kv_host_hits"] == pinning_block and stats["encoder_runs"] == runs + 1  # stops before it; encoded anew
    else:
        assert stats["kv_host_hits"] >= (item.end + 15) // 16 + 5 and stats["kv_host_hits"] <= full_blocks
        assert stats["encoder_runs"] == runs  # the picture is not encoded again
        if picture_output == "in the encoder host tier":
            assert stats["encoder_host_hits"] == 1
    assert_books_consistent(engine)
    assert stats["encoder_cache_referenced"] == 0


def test_a_copy_that_fails_falls_back_to_recomputing(checkpoint_dir):
    path = str(checkpoint_dir())
    expected, _ = _evict_then_ask_again(MMEngine(path, kv_cache_host_bytes=0, **OPTIONS))
    engine = MMEngine(path, kv_cache_host_bytes=1 << 22, **OPTIONS)
    engine.generate(SYSTEM + " USER: first? ASSISTANT:", sampling_params=GREEDY, use_tqdm=False)
    engine.generate(PRESSURE, sampling_params=GREEDY, use_tqdm=False)
    copy = engine.runner.copy_kv_blocks
    failures = []

    def failing(offloads, restores):
        if restores and not failures:
            failures.append(len(restores))
            raise RuntimeError("copy failed")
        copy(offloads, restores)

    engine.runner.copy_kv_blocks = failing
    request_id = engine.add_request(SYSTEM + " USER: second? ASSISTANT:", sampling_params=GREEDY)
    with pytest.raises(RuntimeError, match="copy failed"):
        engine.step()
    assert failures
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id and o.finished]
    assert outputs[0].token_ids == expected[1]
    assert_books_consistent(engine)


def test_budget_prints_both_host_tiers(checkpoint_dir, capsys):
    from mmengine.cli import main

    assert main(["budget", "--model", str(checkpoint_dir()), "--device", "cpu", "--encoder-cache-host-bytes", "65536",
                 "--kv-cache-host-bytes", "81920"]) == 0
    out = capsys.readouterr().out
    assert "65536   bytes (--encoder-cache-host-bytes): 16 items" in out  # 16 embeddings x 256 bytes per picture
    assert "81920   bytes (--kv-cache-host-bytes): 10 blocks of 8192 bytes" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tiers' copies are asynchronous on a GPU only (on a CPU each completes in place)")
def test_a_block_restored_right_after_its_offload_reads_the_copied_values(checkpoint_dir):
    """The offload's device-to-host copy is queued behind the device's work; a restore in the next step
    stacks the host copy on the host, so it must wait for that copy (under async scheduling the host runs
    a step or two ahead). The device is kept busy so the copy is still queued when the restore comes."""
    engine = MMEngine(str(checkpoint_dir()), kv_cache_host_bytes=1 << 22, enforce_eager=True,
                      **{**OPTIONS, "device": "cuda"})
    runner = engine.runner
    for group in runner.kv_cache.groups:
        group.normal_()
    expected = [group[:, :, 3].clone() for group in runner.kv_cache.groups]
    entry = HostBlock(block_hash=b"offloaded", key=(), parent_hash=None)
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(50):
        busy = busy @ busy / 4096
    runner.copy_kv_blocks([KVCopy(entry, 3)], [])
    runner.copy_kv_blocks([], [KVCopy(entry, 5, restore=True)])
    torch.cuda.synchronize()
    assert all(torch.equal(group[:, :, 5], want) for group, want in zip(runner.kv_cache.groups, expected))
