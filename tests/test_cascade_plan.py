"""The host-side cascade plan: which requests of a step form shared-prefix groups, how deep each
group's prefix goes, and when "auto" decides cascade pays for itself. No model, no tensors."""

from __future__ import annotations

import pytest

from mmengine.config import EngineConfig
from mmengine.errors import ConfigError
from mmengine.layers.cascade import CascadeGroup, tokens_per_tile
from mmengine.runner.cascade_plan import (
    MIN_SAVED_BYTES_PER_LAYER,
    CascadePolicy,
    choose_groups,
    shared_candidates,
)

BS = 16


def policy(mode: str, kv_bytes_per_token: int = 1, tile: int = 32) -> CascadePolicy:
    return CascadePolicy(mode=mode, block_size=BS, tokens_per_tile=tile, kv_bytes_per_token=kv_bytes_per_token)


def as_tuples(groups: list[CascadeGroup]) -> list[tuple[list[int], int]]:
    return [(g.rows, g.num_prefix_blocks) for g in groups]


def test_several_groups_with_different_prefixes_under_one_common_block():
    """Every request shares block 100 (a system preamble); two groups share more. Grouping by the
    deeper prefixes covers more shared keys than one group over the common block."""
    tables = [[100, 1, 2, 50], [100, 1, 2, 51], [100, 3, 4, 5, 52], [100, 1, 2, 53], [100, 3, 4, 5, 54], [100, 60]]
    seq_lens = [16 * len(t) for t in tables]
    groups = policy("on").plan(tables, [1] * 6, seq_lens)
    assert as_tuples(groups) == [([0, 1, 3], 3), ([2, 4], 4)]


def test_a_group_never_reaches_past_any_members_full_blocks():
    """Request 1 is 40 tokens into the shared third block: only its two full blocks can be shared."""
    tables = [[7, 8, 9, 1], [7, 8, 9]]
    groups = policy("on").plan(tables, [1, 1], [64, 40])
    assert as_tuples(groups) == [([0, 1], 2)]


def test_unshared_and_short_requests_are_left_alone():
    tables = [[1, 2], [3, 4], [1, 9], [5]]
    assert set(shared_candidates(tables, [32, 32, 20, 10], BS)) == {0, 2}
    assert shared_candidates(tables, [32, 32, 15, 10], BS) == {}  # request 2 has no full block yet
    assert policy("on").plan([[1, 2], [3, 4]], [1, 1], [32, 32]) == []
    assert policy("on").plan([[1, 2]], [1], [32]) == []  # one request: nothing to share with


def test_off_plans_nothing():
    assert policy("off").plan([[1, 2], [1, 2]], [1, 1], [32, 32]) == []


def test_worth_counts_saved_tile_reads_of_the_prefix():
    """Decodes gain (each would read the prefix alone); full prefill tiles gain nothing."""
    prefixes = {0: (1, 2), 1: (1, 2), 2: (1, 2)}
    query_lens = {0: 1, 1: 1, 2: 64}

    def saved(rows, blocks, tile=32):
        return (sum(-(-query_lens[r] // tile) for r in rows) - -(-sum(query_lens[r] for r in rows) // tile)) * blocks * BS

    # tiles alone 1 + 1 + 2 = 4, packed ceil(66 / 32) = 3: one prefix read of 32 keys saved
    assert as_tuples(choose_groups(prefixes, saved)) == [([0, 1, 2], 2)]
    assert saved([0, 1, 2], 2) == 32
    assert choose_groups({0: (1, 2), 1: (1, 2)}, lambda rows, blocks: 0) == []  # worth nothing: no group


def test_auto_engages_only_when_the_saved_bytes_pay():
    """16 decodes over a 2000-token prefix with 7B-like K/V (16 KiB per token and layer): 15 prefix
    reads saved per group, far above the threshold. Two decodes over one block: far below."""
    kv = 2 * 32 * 128 * 2
    prefix = list(range(125))
    tables = [prefix + [1000 + i] for i in range(16)]
    big = policy("auto", kv).plan(tables, [1] * 16, [2000 + 10] * 16)
    assert as_tuples(big) == [(list(range(16)), 125)]
    assert policy("auto", kv).plan([[1, 2], [1, 3]], [1, 1], [20, 20]) == []
    # just enough for an eager step; a step that would replay a plain CUDA graph keeps it,
    # however much cascade saves ("on" still returns groups, for an eager step)
    blocks = -(-MIN_SAVED_BYTES_PER_LAYER // (kv * BS))  # one saved prefix read of this many blocks pays
    pair = [list(range(blocks)) + [5000], list(range(blocks)) + [5001]]
    lens = [blocks * BS + 5] * 2
    assert policy("auto", kv).plan(pair, [1, 1], lens) != []
    assert policy("auto", kv).plan(pair, [1, 1], lens, graph_tiles=0) == []
    assert policy("auto", kv).plan(tables, [1] * 16, [2000 + 10] * 16, graph_tiles=0) == []
    assert policy("on", kv).plan(pair, [1, 1], lens, graph_tiles=0) != []
    # with a cascade graph, the same step runs cascade inside it
    assert as_tuples(policy("auto", kv).plan(tables, [1] * 16, [2000 + 10] * 16, graph_tiles=4)) == [(list(range(16)), 125)]


def test_a_cascade_graph_keeps_the_groups_worth_most_that_fit():
    """Three groups of decodes, one tile each: a graph holding two tiles keeps the two that save
    the most prefix reads (members - 1, times the prefix), in row order; "on" returns all three."""
    kv = 2 * 32 * 128 * 2
    tables, lens = [], []
    for first, members, blocks in ((100, 3, 40), (200, 8, 30), (300, 2, 60)):  # worth 80, 210, 60 block reads
        for i in range(members):
            tables.append([first + b for b in range(blocks)] + [9000 + len(tables)])
            lens.append(blocks * BS + 3)
    rows = len(tables)
    kept = policy("auto", kv).plan(tables, [1] * rows, lens, graph_tiles=2)
    assert as_tuples(kept) == [([0, 1, 2], 40), (list(range(3, 11)), 30)]
    assert len(policy("auto", kv).plan(tables, [1] * rows, lens)) == 3  # an eager step keeps all
    assert len(policy("on", kv).plan(tables, [1] * rows, lens, graph_tiles=2)) == 3


@pytest.mark.parametrize("num_tiles,longest,splits", [(1, 4096, 8), (1, 300, 1), (64, 4096, 1), (2, 4096, 4)])
def test_prefix_splits_fill_the_gpu_within_a_graphs_bounds(num_tiles, longest, splits):
    """The split-KV rule over prefix tiles (two waves of 132 SMs x 32 KV heads), never past what a
    cascade graph's partial states and work grid hold."""
    policy_ = CascadePolicy("auto", BS, 64, 1, num_kv_heads=32, num_sms=132)
    bounds = policy_.graph_bounds(batch_size=16, max_model_len=4096)
    assert (bounds.max_tiles, bounds.max_splits, bounds.max_work) == (4, 8, 8)
    assert policy_.prefix_splits(num_tiles, longest, bounds) == splits
    assert num_tiles * splits <= max(bounds.max_work, num_tiles)
    assert policy_.prefix_splits(1, 32768) == 8 and policy_.prefix_splits(1, 32768, policy_.graph_bounds(16, 32768)) == 8


def test_deep_tries_need_no_recursion():
    """A chain of 1100 requests each one block longer than the last (a trie deeper than Python's
    recursion limit): one group, at the node worth the most."""
    n = 1100
    prefixes = {i: tuple(range(i + 1)) for i in range(n)}
    (group,) = choose_groups(prefixes, lambda rows, blocks: len(rows) * blocks)
    k = group.rows[0]
    assert group.rows == list(range(k, n)) and group.num_prefix_blocks == k + 1
    assert (n - k) * (k + 1) == max((n - j) * (j + 1) for j in range(n))


def test_tokens_per_tile_follows_the_gqa_group():
    assert tokens_per_tile(32, 32) == 64 and tokens_per_tile(32, 8) == 16 and tokens_per_tile(28, 4) == 8


@pytest.mark.parametrize("value", ["always", True, None])
def test_cascade_option_is_validated(value):
    with pytest.raises(ConfigError, match="cascade_attention"):
        EngineConfig(model="m", cascade_attention=value)
    assert EngineConfig(model="m").execution_config.cascade_attention == "auto"


def test_a_group_is_cut_to_what_its_members_really_share():
    """Block ids that break the prefix cache's chain rule (same id in a column, different ids
    before it) never make a group claim blocks a member lacks."""
    tables = [[1, 9, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]  # the binary search over columns sees 6 shared
    assert as_tuples(policy("on").plan(tables, [1, 1], [96, 96])) == [([0, 1], 1)]
