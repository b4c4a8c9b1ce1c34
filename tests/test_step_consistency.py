"""A step commits its plan whole or changes nothing, and the books of both caches always agree
with the runner's tensors: the encoder-cache reuse/evict crash, a failing runner, and a seeded
randomized workload on tight caches audited after every step."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from books import assert_books_consistent
from helpers import FailOnce
from mmengine import MMEngine, SamplingParams
from mmengine.config import EngineConfig
from mmengine.models.loader import checkpoint_dtype
from mmengine.testing import make_test_image

M = 16  # embeddings per image of the default tiny checkpoint
# The default tiny checkpoint's sizes per element of its dtype: an embedding (hidden size 64) and a KV block
# of 8 tokens (2 layers, K and V, 2 KV heads of 16 dims). Host tiers are sized in bytes, so a test that
# means "4 pictures" or "12 blocks" scales them by the dtype's size: fp32 on CPU, bf16 on CUDA.
EMBEDDING_ELEMENTS = 64
KV_BLOCK_ELEMENTS = 2 * 2 * 8 * 2 * 16
IMAGES = [make_test_image(300 + i) for i in range(10)]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TWO = "USER: <image><image> ASSISTANT:"
ONE = "USER: <image>\nWhat is it? ASSISTANT:"


def _reference(checkpoint_dir, prompts: list[str], images: list[list]) -> list[list[int]]:
    roomy = MMEngine(str(checkpoint_dir()), max_model_len=256, enable_prefix_caching=False)
    return [o.token_ids for o in roomy.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("prefix_caching,third", [(False, "AE"), (True, "BE")])
def test_reusing_the_lru_entry_while_encoding_a_new_image(checkpoint_dir, prefix_caching, third):
    """Issue 9 item 0: one step reuses the unreferenced LRU entry and encodes a new image with room
    for one image. The reuse is referenced before the allocation, so nothing it needs is evicted."""
    a, b, c, d, e = IMAGES[:5]
    named = dict(zip("ABCDE", IMAGES))
    engine = MMEngine(
        str(checkpoint_dir()), block_size=16, num_kv_blocks=3, encoder_cache_size=M, max_model_len=48,
        enable_prefix_caching=prefix_caching,
    )
    calls = [[a, b], [c, d], [named[third[0]], named[third[1]]]]
    outs = [engine.generate(TWO, images=imgs, sampling_params=PARAMS, use_tqdm=False)[0].token_ids for imgs in calls]
    assert_books_consistent(engine)
    assert outs == _reference(checkpoint_dir, [TWO] * 3, calls)
    engine.reset_encoder_cache()  # broke too, before the fix
    assert engine.stats()["encoder_cache_entries"] == 0 and engine.runner.encoder_outputs == {}
    (again,) = engine.generate(TWO, images=calls[2], sampling_params=PARAMS, use_tqdm=False)
    assert again.token_ids == outs[2]
    assert_books_consistent(engine)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("where", ["encode_items", "forward"])
def test_a_failing_step_leaves_consistent_books_and_can_be_retried(checkpoint_dir, where, async_scheduling):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256, block_size=8, encoder_cache_size=2 * M, num_kv_blocks=24,
                      async_scheduling=async_scheduling)
    prompts = [ONE, TWO, ONE]
    images = [[IMAGES[0]], [IMAGES[1], IMAGES[0]], [IMAGES[2]]]
    ids = [engine.add_request(p, imgs, PARAMS) for p, imgs in zip(prompts, images)]
    engine.step()  # something resident and in flight before the failure
    model = engine.runner.model
    failing = FailOnce(getattr(model, where))
    setattr(model, where, failing)
    with pytest.raises(MemoryError, match="injected"):
        while failing.armed:
            engine.step()
    assert_books_consistent(engine)  # no entry is booked for an encode that never ran
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            results[output.request_id] = output
        assert_books_consistent(engine)
    assert [results[i].token_ids for i in ids] == _reference(checkpoint_dir, prompts, images)
    assert engine.encoder_cache.num_referenced == 0


def _element_bytes(path: str) -> int:
    """Bytes per element of the dtype an engine on this machine picks for the checkpoint (dtype "auto")."""
    config = EngineConfig(model=path)
    return config.resolve_dtype(checkpoint_dtype(Path(path)), config.resolve_device()).itemsize


def _check_kv_host_tier(engine: MMEngine) -> None:
    """Between steps: every host entry sits under its own hash with its KV (its offload was queued), none
    is held for a restore, the tier is within capacity, and no copy is left unqueued."""
    tier, kv = engine.kv_cache.host_tier, engine.kv_cache
    if tier is None:
        return
    assert len(tier) <= tier.capacity_blocks and not tier._held, "host tier over capacity or still holding hits"
    for block_hash, entry in tier._entries.items():
        assert entry.block_hash == block_hash and entry.kv is not None, "host entry without its KV or under a wrong hash"
    assert not kv._offloads and not kv._restores and all(copy.done for copy in kv._handed_out), "copies left unqueued"


def _random_workload(checkpoint_dir, seed: int, prefix_caching: bool, async_scheduling: str = "off", tiers: bool = False,
                     kv_host_blocks: int = 12) -> None:
    """Tight KV, an encoder cache at its minimum (one image), many distinct images, and the
    least-recently-seen image shown again often: steps interleaved with adds and aborts. With `tiers`,
    both host tiers are on (small, so they evict too): 4 pictures and `kv_host_blocks` blocks, whatever
    the dtype."""
    rng = random.Random(seed)
    path = str(checkpoint_dir())
    elem = _element_bytes(path)
    host = dict(encoder_cache_host_bytes=4 * M * EMBEDDING_ELEMENTS * elem,
                kv_cache_host_bytes=kv_host_blocks * KV_BLOCK_ELEMENTS * elem) if tiers else {}
    engine = MMEngine(
        path, max_model_len=128, block_size=8, num_kv_blocks=12, encoder_cache_size=M,
        max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling,
        **host,
    )
    if tiers:  # the sizes meant, in the engine's own units
        assert engine.kv_cache.host_tier.capacity_blocks == kv_host_blocks
        assert engine.encoder_host_tier.capacity_bytes == 4 * M * engine.runner.embedding_bytes
    last_seen = {i: -1 for i in range(len(IMAGES))}
    requests: dict[str, tuple[str, list]] = {}
    aborted: set[str] = set()
    finished: dict[str, list[int]] = {}
    reported_aborts: set[str] = set()
    clock = 0

    def pick() -> int:
        nonlocal clock
        clock += 1
        index = min(last_seen, key=last_seen.get) if rng.random() < 0.5 else rng.randrange(len(IMAGES))
        last_seen[index] = clock
        return index

    def step() -> None:
        for output in engine.step():
            if output.finish_reason == "abort":
                assert output.request_id in aborted
                reported_aborts.add(output.request_id)
            elif output.finished:
                finished[output.request_id] = output.token_ids
        assert_books_consistent(engine)
        _check_kv_host_tier(engine)

    for _ in range(40):
        roll = rng.random()
        if roll < 0.45:
            picked = [IMAGES[pick()] for _ in range(rng.choice((1, 2)))]
            prompt = ONE if len(picked) == 1 else TWO
            requests[engine.add_request(prompt, picked, PARAMS)] = (prompt, picked)
        elif roll < 0.5 and engine.scheduler.requests:
            victim = rng.choice(sorted(engine.scheduler.requests))
            assert engine.abort_request(victim)
            aborted.add(victim)
            assert_books_consistent(engine)
        elif engine.has_unfinished_requests():
            step()
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        step()
    assert not engine.has_unfinished_requests()
    assert set(finished) == set(requests) - aborted and reported_aborts == aborted
    done = sorted(finished)
    reference = _reference(checkpoint_dir, [requests[i][0] for i in done], [requests[i][1] for i in done])
    assert [finished[i] for i in done] == reference
    stats = engine.stats()
    assert stats["encoder_cache_evictions"] > 0 and stats["encoder_cache_hits"] > 0  # the caches really churned
    assert engine.encoder_cache.num_referenced == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    if tiers:
        assert stats["encoder_host_hits"] > 0 and stats["encoder_host_evictions"] > 0  # the host tier served and churned
        # and the KV tier's blocks came back (12 blocks churn here before any is asked for again)
        assert stats["kv_host_hits"] > 0 or kv_host_blocks < 24


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_books_agree_with_the_runner_after_every_step(checkpoint_dir, seed):
    _random_workload(checkpoint_dir, seed, prefix_caching=True)


@pytest.mark.parametrize("seed", [4, 5])
def test_random_workload_with_async_scheduling(checkpoint_dir, seed):
    """Steps launched before the previous step's tokens are read, with aborts of requests in flight."""
    _random_workload(checkpoint_dir, seed, prefix_caching=True, async_scheduling="on")


def test_random_workload_without_prefix_caching(checkpoint_dir):
    _random_workload(checkpoint_dir, 3, prefix_caching=False)


@pytest.mark.parametrize("seed,async_scheduling,kv_host_blocks", [(6, "off", 12), (7, "on", 12), (6, "off", 24), (6, "on", 24)])
def test_random_workload_with_both_host_tiers(checkpoint_dir, seed, async_scheduling, kv_host_blocks):
    """The same audit with evicted encoder outputs and KV blocks kept in host tiers and copied back. With
    24 host blocks (what the bytes of the 12-block case gave a bf16 engine on the H200) the tier fills up
    while its hits are restored: an admission's own evictions once dropped those hits mid-allocation."""
    _random_workload(checkpoint_dir, seed, prefix_caching=True, async_scheduling=async_scheduling, tiers=True,
                     kv_host_blocks=kv_host_blocks)
