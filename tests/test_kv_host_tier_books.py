"""The KV host tier's books against the block allocations that feed it: an allocation that restores host
hits evicts device blocks into the same tier, and its LRU must not drop the hits being restored (on the
H200 the tier held twice the blocks of the CPU run, bf16 against fp32, and a full tier did exactly that:
a KeyError in the middle of an admission); an offload whose entry is evicted before the runner takes it
is not handed out."""

from __future__ import annotations

import torch

from helpers import make_request
from mmengine.kv_cache.block_hash import make_hash_function
from mmengine.kv_cache.host_tier import KVHostTier
from mmengine.kv_cache.manager import KVCacheManager

BS = 4
HASH = make_hash_function("xxh3_128", 0)


def manager(num_blocks: int, host_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, HASH, host_tier=KVHostTier(host_blocks * 64, 64))


def run_copies(kv: KVCacheManager) -> tuple[list, list]:
    """What the runner does with the step's copies: the offloaded entries get their KV, every copy is queued."""
    offloads, restores = kv.take_copies()
    for copy in offloads:
        copy.entry.kv = [torch.full((1,), float(copy.block_id))]
    for copy in offloads + restores:
        copy.done = True
    return offloads, restores


def compute_and_free(kv: KVCacheManager, request) -> None:
    """Admits the request without hits, computes its prompt, caches its full blocks and frees them."""
    kv.hash_new_blocks(request)
    kv.allocate(request, request.num_tokens, [], 0)
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    kv.free(request)


def check_tier(kv: KVCacheManager) -> None:
    tier = kv.host_tier
    assert len(tier) <= tier.capacity_blocks and not tier._held
    for block_hash, entry in tier._entries.items():
        assert entry.block_hash == block_hash and entry.kv is not None


def test_restoring_host_hits_into_a_full_tier_keeps_them():
    kv = manager(num_blocks=4, host_blocks=2)
    first = make_request("a", 8)  # two full blocks
    compute_and_free(kv, first)
    compute_and_free(kv, make_request("b", 16, tokens=list(range(101, 117))))  # evicts a's blocks to the tier
    offloads, _ = run_copies(kv)
    assert len(offloads) == 2 and len(kv.host_tier) == 2 and kv.num_cached_blocks == 4  # b's four blocks, all free

    again = make_request("a2", 12)  # a's two blocks, then one more
    kv.hash_new_blocks(again)
    hits = kv.get_computed_blocks(again)
    host_hits = kv.get_host_hits(again, hits)
    assert hits == [] and [e.block_hash for e in host_hits] == again.block_hashes[:2]
    # Fresh blocks for the two hits and the new one evict three of b's cached blocks into the full tier,
    # whose LRU entries are the very hits being restored: they stay, b's blocks find no room.
    kv.allocate(again, 4, hits, 8, host_hits)
    assert all(kv.host_tier.holds(entry) for entry in host_hits)
    assert kv.host_tier.num_hits == 2 and kv.host_tier.num_evictions == 0
    offloads, restores = run_copies(kv)
    assert offloads == [] and [c.entry for c in restores] == host_hits
    assert [c.block_id for c in restores] == kv.block_ids("a2")[:2]
    check_tier(kv)

    # Once the allocation is over, the restored entries are ordinary LRU entries again
    again.num_computed_tokens = 12
    kv.cache_blocks(again)
    kv.free(again)
    compute_and_free(kv, make_request("c", 16, tokens=list(range(201, 217))))
    run_copies(kv)
    assert kv.host_tier.num_evictions > 0 and not any(kv.host_tier.holds(entry) for entry in host_hits)
    check_tier(kv)


def test_an_offload_whose_entry_is_evicted_in_the_same_step_is_not_handed_out():
    kv = manager(num_blocks=2, host_blocks=1)
    compute_and_free(kv, make_request("a", 8))
    compute_and_free(kv, make_request("b", 8, tokens=list(range(101, 109))))  # a's two blocks: the second evicts the first
    offloads, _ = run_copies(kv)
    assert len(offloads) == 1 and kv.host_tier.holds(offloads[0].entry) and kv.host_tier.num_evictions == 1
    check_tier(kv)


def test_a_tier_full_of_hits_being_restored_takes_no_new_block():
    kv = manager(num_blocks=3, host_blocks=2)
    compute_and_free(kv, make_request("a", 8))
    compute_and_free(kv, make_request("b", 12, tokens=list(range(101, 113))))
    run_copies(kv)
    again = make_request("a2", 9)
    kv.hash_new_blocks(again)
    host_hits = kv.get_host_hits(again, [])
    assert len(host_hits) == 2
    kv.allocate(again, 1, [], 8, host_hits)  # evicts all three of b's blocks: none fits
    offloads, restores = run_copies(kv)
    assert offloads == [] and len(restores) == 2 and len(kv.host_tier) == 2
    assert kv.host_tier.num_stored == 2  # a's two blocks only
    check_tier(kv)
