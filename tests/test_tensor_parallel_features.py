"""Features that run at tensor_parallel_size=2 as at TP 1 (two gloo ranks on CPU, fp32): the KV host tier
(the driver's books decide, each rank copies its heads' slice of the blocks: the same tokens and hits as TP 1), the
encoder host tier (every rank keeps its copy of what the driver's tier holds), cascade_attention="on" (each rank
plans the same groups from the plan, for its heads), vision-side LoRA with mm_encoder_tp_mode="data", and update_weights (each rank loads its part of every new
weight; refusals raised on the driver, the engine still serving). The TP 2 engine and its TP 1 reference share their
options and run the same workloads, in order."""

from __future__ import annotations

import pytest
import torch

from helpers import tensor_parallel_pairs
from mmengine import SamplingParams
from mmengine.distributed.kv_host_moves import DriverHostBlocks, KVMoves, RemoteKV
from mmengine.errors import WeightsMismatchError
from mmengine.kv_cache.host_tier import HostBlock, KVCopy
from mmengine.testing import TinyLlavaSpec, make_test_image
from test_kv_host_tier import SYSTEM, _evict_then_ask_again
from test_weight_update import perturbed

# 24 KV blocks: the KV host tier's workload (tests/test_kv_host_tier.py's) pushes a shared prefix out and asks again;
# an encoder cache of 32 embeddings (and the room for pinned ones) evicts most of 40 pictures, of which the encoder host
# tier holds 5 (16 x 256 bytes each)
OPTIONS = dict(device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=24, enable_prefix_grouping=False,
               kv_cache_host_bytes=1 << 22, encoder_cache_size=32, encoder_cache_host_bytes=5 * 16 * 256,
               cascade_attention="on", enable_lora=True, max_loras=2, max_lora_rank=8, mm_encoder_tp_mode="data",
               async_scheduling="on")  # (the driver sends a step before it reads the last: an update waits for it)
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
ASK = "USER: <image>\nWhat is shown here, in a few words? ASSISTANT:"
PICTURE = make_test_image(5, size=(64, 48))
PICTURES = [make_test_image(100 + i, size=(64, 48)) for i in range(40)]


@pytest.fixture(scope="module")
def pair(checkpoint_dir):
    """(checkpoint, TP 1 engine, TP 2 engine); two KV heads, one a rank."""
    with tensor_parallel_pairs({"llava": checkpoint_dir(TinyLlavaSpec(num_key_value_heads=2))}, **OPTIONS) as pairs:
        yield pairs["llava"]


def tokens(engine, prompts, images=None) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, images=images, sampling_params=GREEDY, use_tqdm=False)]


def test_kv_blocks_spilled_to_host_memory_come_back_at_tp2_as_at_tp1(pair):
    _, one, two = pair
    expected, computed_at_tp1 = _evict_then_ask_again(one)
    assert _evict_then_ask_again(two) == (expected, computed_at_tp1)  # the same tokens, and only the same tail prefilled
    at_tp1, at_tp2 = one.stats(), two.stats()
    prompt_len = len(one.tokenizer(SYSTEM + " USER: second? ASSISTANT:")["input_ids"])
    assert at_tp2["kv_host_hits"] == at_tp1["kv_host_hits"] >= 10 and computed_at_tp1 < prompt_len - 10 * 16
    assert at_tp2["kv_host_blocks"] == at_tp1["kv_host_blocks"] > 0
    assert at_tp2["kv_host_bytes"] == at_tp2["kv_host_blocks"] * two.runner.kv_block_bytes  # each rank's half of a block


def two_rounds(engine) -> list[list[int]]:
    """Every picture asked about twice, the second round in reverse order (tests/test_encoder_host_tier.py's workload);
    the text before each picture differs, so no KV block is shared and the second round needs every output again."""
    found = []
    for order in (range(len(PICTURES)), reversed(range(len(PICTURES)))):
        order = list(order)
        found += tokens(engine, [f"USER: round {len(found)}: <image>\nWhat is {i}? ASSISTANT:" for i in order],
                        [[PICTURES[i]] for i in order])
    return found


def test_budget_prints_each_ranks_host_tiers_as_the_engine_sizes_them(pair, capsys):
    from mmengine.cli import main

    path, _, two = pair
    assert main(["budget", "--model", str(path), "--device", "cpu", "--tensor-parallel-size", "2",
                 "--encoder-cache-host-bytes", "65536", "--kv-cache-host-bytes", "81920"]) == 0
    out = capsys.readouterr().out
    assert "65536   bytes (--encoder-cache-host-bytes, each rank's): 16 items" in out  # every rank keeps every output
    block = two.runner.kv_block_bytes  # a rank's heads' share of a block (4096 bytes: half of TP 1's)
    assert f"81920   bytes (--kv-cache-host-bytes, each rank's): {81920 // block} blocks of {block} bytes" in out


def test_encoder_outputs_spilled_to_host_memory_come_back_at_tp2_as_at_tp1(pair):
    _, one, two = pair
    keys = ("encoder_runs", "encoder_host_hits", "encoder_host_evictions", "encoder_host_entries", "encoder_host_bytes",
            "encoder_host_bytes_copied_out")
    before = [{key: engine.stats()[key] for key in keys} for engine in (one, two)]
    assert two_rounds(two) == two_rounds(one)
    at_tp1, at_tp2 = ({key: engine.stats()[key] - was[key] for key in keys} for engine, was in zip((one, two), before))
    assert at_tp2 == at_tp1 and at_tp1["encoder_host_hits"] > 0 and at_tp1["encoder_host_evictions"] > 0


def test_cascade_attention_on_at_tp2_gives_tp1s_tokens_and_groups(pair):
    _, one, two = pair
    keys = ("cascade_steps", "cascade_groups", "cascade_tokens", "prefix_cache_hits")
    before = [{key: engine.stats()[key] for key in keys} for engine in (one, two)]
    prompts = [SYSTEM + f" USER: question {i}, in one word? ASSISTANT:" for i in range(4)]  # one shared prefix
    assert tokens(two, prompts) == tokens(one, prompts)
    at_tp1, at_tp2 = ({key: engine.stats()[key] - was[key] for key in keys} for engine, was in zip((one, two), before))
    assert at_tp2 == at_tp1 and at_tp1["cascade_steps"] > 0 and at_tp1["cascade_groups"] >= at_tp1["cascade_steps"]


def test_a_vision_adapter_with_the_tower_in_data_mode_gives_tp1s_tokens(pair, tmp_path):
    """Three pictures in one step, split over the ranks' towers (mm_encoder_tp_mode="data"): each rank's adapter rows
    are its own items' (the first and third under the vision adapter, the second not)."""
    from conftest import save_peft_adapter
    from mmengine.lora.request import LoRARequest
    from test_lora_engine import VISION_TARGETS

    path, one, two = pair
    vision = LoRARequest("vision", str(save_peft_adapter(path, tmp_path / "vision", 4, 8, False, VISION_TARGETS["llava"], seed=11)))
    pictures = [[PICTURE], [PICTURE], [PICTURES[0]]]
    runs = two.stats()["encoder_runs"]
    outputs = [[o.token_ids for o in engine.generate([ASK] * 3, images=pictures, sampling_params=GREEDY, use_tqdm=False,
                                                     lora=[vision, None, vision])] for engine in (one, two)]
    assert outputs[1] == outputs[0] and outputs[1][0] != outputs[1][1]  # the adapter changed the answer
    assert two.stats()["encoder_runs"] - runs == 3


def test_a_rank_tiles_its_cascade_layout_for_its_own_heads():
    """4 query heads and 1 KV head replicated at TP 2: a rank's layers hold 2 query heads a KV head, not 4, and check
    the step's layout against that GQA group (layers/attention.py), so the rank's policy is tiled for it."""
    from types import SimpleNamespace

    from mmengine.kernels.tiling import tokens_per_tile
    from mmengine.runner.cascade_plan import CascadePolicy
    from mmengine.runner.worker import rank_cascade_policy

    whole = CascadePolicy(mode="on", block_size=16, tokens_per_tile=tokens_per_tile(4, 1), kv_bytes_per_token=128, num_kv_heads=1)
    family = SimpleNamespace(kv_cache_layout=lambda: [(1, 16)] * 2, kv_cache_windows=lambda: [None, None])
    runner = SimpleNamespace(text_config=SimpleNamespace(num_attention_heads=4), family=family, kv_element_bytes=4,
                             inputs=SimpleNamespace(cascade=whole))
    policy = rank_cascade_policy(runner, 2)
    assert policy.tokens_per_tile == tokens_per_tile(2, 1) != whole.tokens_per_tile and policy.mode == "on"


def test_the_ranks_drop_a_host_block_once_the_drivers_tier_drops_it():
    books = DriverHostBlocks()
    entry = HostBlock(block_hash=7, key=(), parent_hash=None)
    books.book([KVCopy(entry, block_id=3)], [])
    assert books.take() == KVMoves(offloads=[(3, 0)]) and entry.kv == RemoteKV(0)
    books.book([], [KVCopy(entry, block_id=5, restore=True)])
    assert books.take() == KVMoves(restores=[(5, 0)])
    del entry  # the tier forgot it (LRU, reset): the ranks drop their copy with the next plan
    assert books.take() == KVMoves(dropped=[0]) and books.take() is None


def test_update_weights_gives_tp1s_tokens_after_the_same_update(pair):
    path, one, two = pair
    before = tokens(two, [ASK], [[PICTURE]])
    weights = perturbed(path, seed=11)  # every weight: split, fused, vocabulary-parallel and replicated ones
    assert two.update_weights(weights) == one.update_weights(weights) > len(weights) // 2
    after = tokens(two, [ASK], [[PICTURE]])
    assert after == tokens(one, [ASK], [[PICTURE]]) and after != before
    name = "language_model.model.layers.0.self_attn.k_proj.weight"
    bad = {name: torch.zeros(1)}
    for engine in (one, two):
        with pytest.raises(WeightsMismatchError, match=rf"tensor '{name}' has shape \[1\], expected"):
            engine.update_weights(bad)
        with pytest.raises(WeightsMismatchError, match=r"unexpected tensor 'no.such.weight'"):
            engine.update_weights({"no.such.weight": torch.zeros(2)})
        with pytest.raises(WeightsMismatchError, match=rf"tensor '{name}' loads the same parameter"):
            engine.update_weights([(name, weights[name]), (name, weights[name])])
    assert tokens(two, [ASK], [[PICTURE]]) == tokens(one, [ASK], [[PICTURE]])  # still serving, the same weights
    assert two.update_weights(str(path)) == one.update_weights(str(path))  # a checkpoint directory: the weights of before
    assert tokens(two, [ASK], [[PICTURE]]) == before


def test_an_update_with_a_step_in_flight_waits_for_it_and_gives_tp1s_tokens(pair):
    path, one, two = pair
    weights = perturbed(path, seed=12, only="language_model")
    found = []
    for engine in (one, two):
        engine.add_request("USER: Tell me a story about boats and rivers. ASSISTANT:", None, GREEDY, request_id="across")
        for _ in range(3):
            engine.step()
        if engine is two:
            assert two.runner.num_submitted - two.runner.num_collected == 1  # a step sent, its reply not read
        engine.update_weights(weights)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        found.append([o.token_ids for o in outputs if o.finished])
    assert found[1] == found[0] and found[0]


def test_a_ranks_encoder_host_copies_follow_the_drivers_tier():
    """The driver's tier (sizes on the meta device, LRU by bytes) evicts; each plan's moves make a rank keep what it
    newly holds and drop what it evicted, so a rank's host memory never outgrows the driver's books."""
    from mmengine.distributed.encoder_host_moves import DriverEncoderHost, RankEncoderHostTier
    from mmengine.encoder_cache.host_tier import EncoderHostTier

    books = DriverEncoderHost(EncoderHostTier(capacity_bytes=2 * 64), embedding_bytes=16)  # room for two outputs of 4
    rank = RankEncoderHostTier()
    for name in ("a", "b", "c", "d"):
        books.encoded(name, 4)
        books.free([name], stale=[])
        moves = books.take()
        rank.keep = set(moves.keep)
        rank.store(name, torch.zeros(4, 4))  # the rank frees its output: kept, as the plan says
        rank.drop_all(moves.dropped)
    assert [h for h in "abcd" if rank.holds(h)] == [h for h in "abcd" if books.tier.holds(h)] == ["c", "d"]
    assert rank.num_bytes == books.tier.num_bytes == 2 * 64
