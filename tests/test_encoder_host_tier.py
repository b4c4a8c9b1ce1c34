"""The encoder cache's host tier (encoder_cache_host_bytes): outputs evicted from the device wait in
host memory and come back by a copy instead of a tower run; outputs equal a run without the tier,
with chunked prefill and async scheduling too; a full host tier evicts LRU and falls back to encoding;
the books end at idle."""

from __future__ import annotations

import pytest

from mmengine import MMEngine, SamplingParams
from mmengine.errors import ConfigError
from mmengine.testing import make_test_image

PICTURES = [make_test_image(100 + i, size=(64, 48)) for i in range(20)]
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
# 4 KV blocks of 16 tokens: the device tier holds 6 pictures of 16 embeddings (its pinned room plus
# one step's encodes), so a 20-picture workload evicts almost all of them
TIGHT = dict(device="cpu", dtype="float32", max_model_len=256, encoder_cache_size=32, num_kv_blocks=4)


def _two_rounds(engine: MMEngine, reverse_second: bool = False) -> list[list[int]]:
    """Every picture asked about twice; the text before the picture differs, so no KV block is shared
    and the second round needs every picture's embeddings again."""
    tokens = []
    for rnd in range(2):
        order = list(range(len(PICTURES)))[::-1] if rnd and reverse_second else range(len(PICTURES))
        prompts = [f"USER: round {rnd}: <image>\nWhat is {i}? ASSISTANT:" for i in order]
        outs = engine.generate(prompts, images=[[PICTURES[i]] for i in order], sampling_params=GREEDY, use_tqdm=False)
        tokens += [o.token_ids for o in outs]
    return tokens


def _idle(engine: MMEngine) -> None:
    stats = engine.stats()
    assert stats["encoder_cache_referenced"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert set(engine.runner.encoder_outputs) == set(engine.encoder_cache.entries)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_evicted_outputs_come_back_from_host_memory_instead_of_the_tower(checkpoint_dir, async_scheduling):
    path = str(checkpoint_dir())
    without = MMEngine(path, encoder_cache_host_bytes=0, async_scheduling=async_scheduling, **TIGHT)
    expected = _two_rounds(without)
    assert without.stats()["encoder_runs"] == 40 and without.encoder_host_tier is None
    engine = MMEngine(path, encoder_cache_host_bytes=20 * 16 * 256, async_scheduling=async_scheduling, **TIGHT)  # 20 pictures
    assert engine.encoder_cache.capacity < 7 * 16  # the device tier holds 6
    assert _two_rounds(engine) == expected
    stats = engine.stats()
    assert stats["encoder_runs"] == 20 and stats["encoder_host_hits"] == 20
    assert stats["encoder_host_entries"] == 20 and stats["encoder_host_bytes"] == 20 * 16 * 256
    assert stats["encoder_host_bytes_copied_out"] == 20 * 16 * 256
    _idle(engine)


def test_a_full_host_tier_evicts_lru_and_the_rest_is_encoded(checkpoint_dir):
    path = str(checkpoint_dir())
    expected = _two_rounds(MMEngine(path, encoder_cache_host_bytes=0, **TIGHT), reverse_second=True)
    engine = MMEngine(path, encoder_cache_host_bytes=5 * 16 * 256, **TIGHT)  # 5 of the 14 evicted pictures
    assert _two_rounds(engine, reverse_second=True) == expected  # the last evicted come back first
    stats = engine.stats()
    assert stats["encoder_host_entries"] <= 5 and stats["encoder_host_evictions"] > 0
    assert 0 < stats["encoder_host_hits"] <= 5 and 20 < stats["encoder_runs"] <= 40 - stats["encoder_host_hits"]
    _idle(engine)


def test_a_restored_picture_split_across_chunked_prefill_steps(checkpoint_dir):
    path = str(checkpoint_dir())
    chunked = dict(TIGHT, max_num_batched_tokens=8, block_size=4, num_kv_blocks=16)
    expected = _two_rounds(MMEngine(path, encoder_cache_host_bytes=0, **chunked))
    engine = MMEngine(path, encoder_cache_host_bytes=1 << 20, **chunked)
    assert _two_rounds(engine) == expected
    assert engine.stats()["encoder_host_hits"] > 0
    _idle(engine)


def test_reset_encoder_cache_empties_the_host_tier_and_options_are_checked(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), encoder_cache_host_bytes=1 << 20, **TIGHT)
    _two_rounds(engine)
    assert engine.stats()["encoder_host_entries"] > 0
    engine.reset_encoder_cache()
    assert engine.stats()["encoder_host_entries"] == 0 and engine.stats()["encoder_host_bytes"] == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="encoder_cache_host_bytes"):
            MMEngine(str(checkpoint_dir()), encoder_cache_host_bytes=bad, **{k: v for k, v in TIGHT.items()})
    assert MMEngine(str(checkpoint_dir()), **TIGHT).encoder_host_tier is None  # on CPU it is off unless asked for
