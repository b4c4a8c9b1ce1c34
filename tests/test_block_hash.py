"""Chained block hashes: what changes them, what does not, and that each block is hashed once."""

from __future__ import annotations

import pytest

from helpers import make_request
from mmengine.kv_cache.block_hash import BlockHasher, block_key, hash_chain, make_hash_function

BS = 4


def hashes(request, algo="xxh3_128", seed=0):
    BlockHasher(BS, make_hash_function(algo, seed)).update(request)
    return request.block_hashes


def test_only_full_blocks_are_hashed_and_the_chain_depends_on_the_prefix():
    a = hashes(make_request("a", 10))
    assert len(a) == 2 and all(len(h) == 16 for h in a)
    b = hashes(make_request("b", 10, tokens=[1, 2, 3, 99, 5, 6, 7, 8, 9, 10]))
    assert a[0] != b[0] and a[1] != b[1]  # block 1's tokens are equal but its parent differs
    c = hashes(make_request("c", 8, tokens=[1, 2, 3, 4, 5, 6, 7, 8]))
    assert c == a


@pytest.mark.parametrize("algo,size", [("xxh3_128", 16), ("sha256", 32)])
def test_seeded_hashes_are_reproducible_and_seed_dependent(algo, size):
    one, two = hashes(make_request("a", 8), algo, 1), hashes(make_request("a", 8), algo, 1)
    assert one == two and len(one[0]) == size
    assert hashes(make_request("a", 8), algo, 2) != one


def test_extra_keys_separate_lora_salt_and_images():
    base = hashes(make_request("a", 12, images=[(2, 6)]))
    assert hashes(make_request("a", 12, images=[(2, 6)], lora_name="x"))[0] != base[0]
    salted = hashes(make_request("a", 12, images=[(2, 6)], cache_salt="s"))
    assert all(s != b for s, b in zip(salted, base))  # block 0 only, but the chain carries it on
    other_image = hashes(make_request("a", 12, images=[(2, 6)], image_hashes=["other"]))
    assert other_image[0] != base[0] and other_image[1] != base[1]
    shifted = hashes(make_request("a", 12, images=[(3, 5)]))
    assert shifted[0] != base[0]


def test_block_key_lists_every_overlapping_item_with_its_relative_offset():
    request = make_request("a", 16, images=[(2, 3), (5, 6)], lora_name="l", cache_salt="s")
    key0, key1, key2 = (block_key(request, i, BS) for i in range(3))
    assert key0.token_ids == (1, 2, 3, 4)
    assert key0.extra_keys == (("lora", "l"), ("image", "img0", -2), ("salt", "s"))
    assert key1.extra_keys == (("lora", "l"), ("image", "img0", 2), ("image", "img1", -1))
    assert key2.extra_keys == (("lora", "l"), ("image", "img1", 3))


def test_each_block_is_hashed_once_as_tokens_arrive():
    hasher = BlockHasher(BS, make_hash_function("xxh3_128", 0))
    request = make_request("a", 6)
    hasher.update(request)
    assert hasher.num_hashed == 1
    for token in range(10):
        request.append_output_token(token)
        hasher.update(request)
    assert hasher.num_hashed == len(request.block_hashes) == 16 // BS
    full = make_request("b", 16, tokens=request.all_token_ids)
    assert hashes(full) == request.block_hashes


@pytest.mark.parametrize("salt,lora", [(None, None), ("s", None), (None, "l"), ("s", "l")])
def test_block_identity_needs_no_request(salt, lora):
    """The chain computed from (token ids, items, salt, adapter) alone is the one a Request gets, so
    an offline pass (prefix grouping) can hash prompts before any Request exists."""
    request = make_request("a", 23, images=[(2, 3), (5, 9)], cache_salt=salt, lora_name=lora)
    chain = hash_chain(request.prompt_token_ids, request.mm_items, salt, lora, BS, make_hash_function("xxh3_128", 0))
    assert chain == hashes(request) and len(chain) == 23 // BS
    assert hash_chain(request.prompt_token_ids, [], salt, lora, BS, make_hash_function("xxh3_128", 0))[0] != chain[0]


@pytest.mark.parametrize("salt,lora", [(None, None), ("s", "l")])
def test_the_chain_hashes_exactly_each_blocks_key(salt, lora):
    """extend_chain assembles each block's bytes without building its key; they must be the bytes of
    _encode(parent, block_key): the key is what the pool verifies, the hash only finds it."""
    from mmengine.kv_cache.block_hash import _encode

    seen: list[bytes] = []
    request = make_request("a", 23, images=[(2, 3), (5, 9)], cache_salt=salt, lora_name=lora)
    request.prompt_token_ids[7] = request.all_token_ids[7] = 2**40  # a wide id packs as int64 too
    chain = hashes(request)

    def recording(data: bytes) -> bytes:
        seen.append(data)
        return make_hash_function("xxh3_128", 0)(data)

    assert hash_chain(request.all_token_ids, request.mm_items, salt, lora, BS, recording) == chain
    parent = None
    for index, data in enumerate(seen):
        assert data == _encode(parent, block_key(request, index, BS))
        parent = chain[index]


def test_every_algorithm_the_config_offers_is_implemented():
    from mmengine.config import HASH_ALGORITHMS
    from mmengine.kv_cache.block_hash import make_hash_function

    digests = {algo: make_hash_function(algo, seed=7)(b"block") for algo in HASH_ALGORITHMS}
    assert len(set(digests.values())) == len(HASH_ALGORITHMS) and all(len(d) >= 16 for d in digests.values())
