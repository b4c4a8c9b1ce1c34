"""Prefix-sharing groups through generate(): the same greedy tokens as without grouping (images in
the shared prefix too), the issue's shuffled workload within 5% of the minimum prefill work, and
books that balance when the batch is done."""

from __future__ import annotations

import random

from books import assert_books_consistent
from mmengine import MMEngine, SamplingParams
from mmengine.testing import make_test_image

# Words the tiny checkpoint's tokenizer encodes as one token each after a space.
ONE_TOKEN_WORDS = "the and are at be car dog image in is of on read small there this to was with you".split()


def exact_prompt(rng: random.Random, num_words: int) -> str:
    return "".join(" " + rng.choice(ONE_TOKEN_WORDS) for _ in range(num_words))


def test_shuffled_groups_under_kv_pressure_through_generate(checkpoint_dir):
    """The issue's CPU workload: 8 groups x 8 prompts, 64 shared (BOS included) + 16 unique tokens,
    shuffled, 24 KV blocks of 16."""
    rng = random.Random(0)
    prompts = []
    for _ in range(8):
        shared = exact_prompt(rng, 63)
        prompts += [shared + exact_prompt(rng, 16) for _ in range(8)]
    rng.shuffle(prompts)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    runs = {}
    for grouping in (True, False):
        # No KV host tier (on by default on CUDA): it would bring evicted prefixes back instead of LRU
        # recomputing them, and the work measured below is the device cache's alone, on any machine.
        # fp32: the two runs batch the prompts differently, and their greedy tokens are compared.
        engine = MMEngine(str(checkpoint_dir()), max_model_len=128, num_kv_blocks=24, enable_prefix_grouping=grouping,
                          kv_cache_host_bytes=0, dtype="float32")
        outputs = engine.generate(prompts, sampling_params=params, use_tqdm=False)
        assert all(len(o.prompt_token_ids) == 80 for o in outputs)
        runs[grouping] = ([o.token_ids for o in outputs], engine.stats())
        assert_books_consistent(engine)
    minimum = 8 * 64 + 64 * 16
    (grouped, stats), (plain, plain_stats) = runs[True], runs[False]
    assert grouped == plain
    assert stats["prefill_tokens_computed"] <= 1.05 * minimum
    assert plain_stats["prefill_tokens_computed"] > 1.5 * minimum  # LRU alone recomputes evicted prefixes
    assert stats["prefix_groups_planned"] == 8
    assert stats["prefix_group_shared_tokens_planned"] == 8 * 7 * 64
    assert stats["prefix_group_shared_tokens_achieved"] >= 0.95 * stats["prefix_group_shared_tokens_planned"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["prefix_group_blocks_held"] == 0
    assert plain_stats["prefix_groups_planned"] == 0


def test_grouped_equals_ungrouped_with_images_in_the_shared_prefix(checkpoint_dir):
    """Groups whose shared prefix shows one or two pictures (some prompts show another in their own
    part), chunked prefill crossing the prefix boundary, KV pressure: grouping changes the order
    and the work, never the tokens."""
    rng = random.Random(1)
    images = [make_test_image(seed) for seed in range(5)]
    batch = []
    for group in range(3):
        shown = [images[group]] + ([images[3]] if group == 2 else [])
        shared = "USER:" + "".join(f"<image>{exact_prompt(rng, 7)}" for _ in shown)
        for member in range(4):
            extra = [images[4]] if member == 3 else []
            own = exact_prompt(rng, rng.randint(1, 12)) + ("<image>" if extra else "") + " ASSISTANT:"
            batch.append((shared + own, shown + extra, rng.randint(1, 6)))
    batch.append(("USER: a prompt of its own ASSISTANT:", [], 3))
    rng.shuffle(batch)
    prompts, image_lists = [p for p, _, _ in batch], [i for _, i, _ in batch]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, _, n in batch]
    kwargs = dict(max_model_len=160, block_size=8, max_num_batched_tokens=24, num_kv_blocks=28)
    results = {}
    for grouping in (True, False):
        engine = MMEngine(str(checkpoint_dir()), **kwargs, enable_prefix_grouping=grouping)
        outputs = engine.generate(prompts, images=image_lists, sampling_params=params, use_tqdm=False)
        results[grouping] = [o.token_ids for o in outputs]
        stats = engine.stats()
        assert_books_consistent(engine)
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["prefix_group_blocks_held"] == 0
        assert stats["prefix_groups_planned"] == (3 if grouping else 0)
        assert (stats["prefix_group_shared_tokens_achieved"] > 0) == grouping
    assert results[True] == results[False]
