"""The offline grouping rule: a prefix tree over block-hash chains, BatchLLM's "enlarge the
first-level prefix" rule, and the group-by-group queue order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mmengine.core.prefix_groups import PrefixGroup, group_order, plan_prefix_groups


def blocks(name: str, n: int) -> list[str]:
    return [f"{name}{i}" for i in range(n)]


def test_batchllm_worked_example():
    """Root -> A (10 blocks) -> {B (5 blocks) -> 8 prompts, C (1 block) -> 2 prompts}. Lifting B
    gains 7 * 5 - 10 = 25 > 0, so A+B becomes its own group and A is computed once more for C's
    prompts, merged with C into one edge."""
    a, b, c = blocks("a", 10), blocks("b", 5), blocks("c", 1)
    chains = [a + b + [f"u{i}"] for i in range(8)] + [a + c + [f"v{i}"] for i in range(2)]
    groups = plan_prefix_groups(chains)
    assert groups == [
        PrefixGroup(tuple(a + b), tuple(range(8))),
        PrefixGroup(tuple(a + c), (8, 9)),
    ]
    assert [g.num_saved_blocks for g in groups] == [7 * 15, 1 * 11]


def test_a_subgroup_not_worth_its_recompute_stays_in_the_larger_group():
    """B shared by 3 prompts gains 2 * 1 - 10 < 0: all five prompts share A only."""
    a, b = blocks("a", 10), blocks("b", 1)
    chains = [a + b + [f"u{i}"] for i in range(3)] + [a + [f"v{i}"] for i in range(2)]
    assert plan_prefix_groups(chains) == [PrefixGroup(tuple(a), (0, 1, 2, 3, 4))]


def test_lifting_works_bottom_up_through_several_levels():
    """A common first block T (like a chat template) over two deep groups: each group is lifted to
    the first level with T prepended, instead of one group sharing only T."""
    t = ["t0"]
    g1, g2 = blocks("x", 4), blocks("y", 4)
    chains = [t + g1 + [f"u{i}"] for i in range(4)] + [t + g2 + [f"v{i}"] for i in range(4)]
    assert plan_prefix_groups(chains) == [
        PrefixGroup(tuple(t + g1), (0, 1, 2, 3)),
        PrefixGroup(tuple(t + g2), (4, 5, 6, 7)),
    ]


def test_prompts_that_share_nothing_or_are_alone_form_no_group():
    assert plan_prefix_groups([["a"], ["b"], ["c", "d"], []]) == []
    assert plan_prefix_groups([blocks("a", 3)]) == []
    # A prompt shorter than a block (empty chain) joins no group even beside a real group.
    assert plan_prefix_groups([[], ["a", "b"], ["a", "c"]]) == [PrefixGroup(("a",), (1, 2))]


def test_identical_prompts_and_a_prompt_that_is_a_prefix_of_others():
    assert plan_prefix_groups([["a", "b"], ["a", "b"], ["a", "b"]]) == [PrefixGroup(("a", "b"), (0, 1, 2))]
    assert plan_prefix_groups([["a"], ["a", "b"], ["a", "c"]]) == [PrefixGroup(("a",), (0, 1, 2))]


def test_queue_order_is_group_by_group_decode_heavy_first():
    groups = [PrefixGroup(("a",), (0, 2, 4)), PrefixGroup(("b",), (1, 3))]
    weight = {0: 1.0, 1: 4.0, 2: 3.0, 3: 4.0, 4: 2.0, 5: 0.5, 6: 9.0}.__getitem__
    # 6 alone (weight 9) first, then group b (mean 4), then group a (mean 2) with its members by
    # weight, then 5 alone.
    assert group_order(7, groups, weight) == [6, 1, 3, 2, 4, 0, 5]
    # Equal weights keep the input order of the groups' first members and of the members.
    assert group_order(7, groups, lambda i: 1.0) == [0, 2, 4, 1, 3, 5, 6]


chain_sets = st.lists(
    st.lists(st.sampled_from("abcd"), min_size=0, max_size=6).map(lambda path: [path[: i + 1] for i in range(len(path))]),
    min_size=1,
    max_size=24,
).map(lambda chains: [["".join(prefix) for prefix in chain] for chain in chains])


@settings(max_examples=200, deadline=None)
@given(chain_sets)
def test_groups_are_exact_disjoint_and_never_cost_more(chains):
    """Chains as real hash chains (each block id names its whole prefix). Every group's prefix is
    a prefix of each member's chain, members are disjoint, each group saves blocks, and the plan
    saves at least as much as grouping by first block (every lift has a positive gain)."""
    groups = plan_prefix_groups(chains)
    seen: set[int] = set()
    for group in groups:
        assert len(group.members) >= 2 and group.num_shared_blocks >= 1 and group.num_saved_blocks > 0
        assert not seen & set(group.members)
        seen |= set(group.members)
        for member in group.members:
            assert tuple(chains[member][: group.num_shared_blocks]) == group.prefix
    by_first: dict[str, list[list[str]]] = {}
    for chain in chains:
        if chain:
            by_first.setdefault(chain[0], []).append(chain)
    first_level = sum((len(cs) - 1) * _common_prefix_len(cs) for cs in by_first.values())
    assert sum(g.num_saved_blocks for g in groups) >= first_level
    order = group_order(len(chains), groups, lambda i: 1.0)
    assert sorted(order) == list(range(len(chains)))
    for group in groups:  # each group is contiguous in the queue
        positions = sorted(order.index(m) for m in group.members)
        assert positions == list(range(positions[0], positions[0] + len(positions)))


def _common_prefix_len(chains: list[list[str]]) -> int:
    n = 0
    while all(len(c) > n and c[n] == chains[0][n] for c in chains):
        n += 1
    return n
