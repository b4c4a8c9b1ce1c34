"""Offline prefix-sharing groups: block-hash chains in, groups and a queue order out.

A batch known up front can plan its sharing instead of hoping LRU keeps it (BatchLLM,
arXiv 2412.03594). The prompts' block-hash chains (see kv_cache/block_hash.py: they carry
tokens, image identities and offsets, salts and adapters, so equal hashes mean equal KV) go
into a compressed prefix tree. The tree is then flattened to one level with BatchLLM's
"enlarge the first-level prefix" rule, applied bottom-up: a grandchild `gc` of a node `c` is
lifted to `c`'s parent, with `c`'s blocks prepended to its own, when

    gain = (leaves(gc) - 1) * len(gc) - len(c) > 0

i.e. when sharing `gc`'s blocks across its prompts saves more than computing `c`'s blocks once
more costs. After the root is processed, each child of the root is a group: its blocks are the
group's shared prefix, every prompt under it is a member. Lengths here are in blocks; sharing
happens at block granularity.

Nothing here trusts a hash for correctness: a grouping only orders requests and decides which
blocks to hold; every reuse is still verified by the block pool.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

BlockId = Hashable  # a block hash (bytes) in the engine; anything hashable in tests


@dataclass(frozen=True)
class PrefixGroup:
    """Prompts (indices into the planned chains) that share their first `num_shared_blocks` blocks."""

    prefix: tuple[BlockId, ...]
    members: tuple[int, ...]

    @property
    def num_shared_blocks(self) -> int:
        return len(self.prefix)

    @property
    def num_saved_blocks(self) -> int:
        """Blocks computed once instead of once per member."""
        return (len(self.members) - 1) * len(self.prefix)


@dataclass(eq=False)
class _Node:
    label: list[BlockId]  # the blocks on the edge from the parent
    children: list[_Node] = field(default_factory=list)
    prompts: list[int] = field(default_factory=list)  # prompts whose chain ends exactly here
    num_leaves: int = 0  # prompts in this subtree
    by_first: dict[BlockId, _Node] = field(default_factory=dict)  # children by first block (while building)

    def members(self) -> list[int]:
        out = list(self.prompts)
        for child in self.children:
            out.extend(child.members())
        return out


def _build_tree(chains: Sequence[Sequence[BlockId]]) -> _Node:
    """A compressed prefix tree (radix tree) over the chains; each chain ends at a node holding its index."""
    root = _Node([])
    for index, chain in enumerate(chains):
        node, pos = root, 0
        node.num_leaves += 1
        while pos < len(chain):
            child = node.by_first.get(chain[pos])
            if child is None:
                child = _Node(list(chain[pos:]))
                node.children.append(child)
                node.by_first[chain[pos]] = child
                pos = len(chain)
            else:
                common = 1
                while common < len(child.label) and pos + common < len(chain) and child.label[common] == chain[pos + common]:
                    common += 1
                if common < len(child.label):  # split the edge where the chain leaves it
                    lower = _Node(child.label[common:], child.children, child.prompts, child.num_leaves, child.by_first)
                    child.label, child.children, child.prompts = child.label[:common], [lower], []
                    child.by_first = {lower.label[0]: lower}
                pos += common
            node = child
            node.num_leaves += 1
        node.prompts.append(index)
    return root


def _enlarge_first_level(node: _Node) -> None:
    """BatchLLM's rule, post-order: lift grandchildren whose sharing gain is positive, then
    compress a child left with a single child and no prompts of its own into one edge."""
    for child in node.children:
        _enlarge_first_level(child)
    kept: list[_Node] = []
    lifted: list[_Node] = []
    for child in node.children:
        changed = True
        while changed:
            changed = False
            for grandchild in list(child.children):
                gain = (grandchild.num_leaves - 1) * len(grandchild.label) - len(child.label)
                if gain > 0:
                    child.children.remove(grandchild)
                    child.num_leaves -= grandchild.num_leaves
                    grandchild.label = child.label + grandchild.label
                    lifted.append(grandchild)
                    changed = True
            if len(child.children) == 1 and not child.prompts:
                (only,) = child.children
                child.label, child.children, child.prompts = child.label + only.label, only.children, only.prompts
                changed = True
        if child.num_leaves:
            kept.append(child)
    node.children = kept + lifted


def plan_prefix_groups(chains: Sequence[Sequence[BlockId]]) -> list[PrefixGroup]:
    """Groups of at least two prompts sharing at least one block, in order of their first member.
    Prompts in no group share nothing worth holding (they still hit the prefix cache as usual)."""
    root = _build_tree(chains)
    _enlarge_first_level(root)
    groups = []
    for child in root.children:
        members = sorted(child.members())
        if len(members) >= 2 and child.label:
            groups.append(PrefixGroup(tuple(child.label), tuple(members)))
    return sorted(groups, key=lambda g: g.members[0])


def group_order(num_prompts: int, groups: Sequence[PrefixGroup], decode_weight: Callable[[int], float]) -> list[int]:
    """The queue order: group by group, every prompt in no group as a group of its own.

    Decode-heavy first (BatchLLM): members by `decode_weight` (e.g. max_tokens / prompt length)
    descending, groups by their members' mean weight descending, so long decodes start early and
    later prefills fill the token budget around them. Ties keep the input order.
    """
    grouped = {m for g in groups for m in g.members}
    units = [list(g.members) for g in groups] + [[i] for i in range(num_prompts) if i not in grouped]
    units = [sorted(u, key=lambda i: (-decode_weight(i), i)) for u in units]
    units.sort(key=lambda u: (-sum(map(decode_weight, u)) / len(u), min(u)))
    return [i for unit in units for i in unit]
