"""Whether a step runs cascade attention, and with which groups: host-side, from the block tables
and the scheduled token counts, with no device work.

Groups. Requests whose block tables start with the same physical blocks (full blocks inside
every member's context) can share a prefix pass. The candidates form a trie over block ids;
sorting the tables makes every trie node a contiguous range, so one pass over the sorted ranges
picks single-level groups: at each node, either the node is one group (its common prefix, all
requests below it) or its children are grouped on their own, whichever is worth more.

Worth, in key reads (the cost a memory-bound attention step pays). Without cascade a request
reads its whole context once per tile of query rows: once for a decode, ceil(q / tile) times
for a chunk of q tokens. With cascade a group reads its prefix once per tile of the group's
packed rows. So a group saves
    (sum over members of ceil(q_r / tile) - ceil(sum of q_r / tile)) x prefix length
key reads; decodes save the most (16 decodes in one tile: 15 prefix reads saved), long prefill
chunks almost nothing (their tiles are already full).

Decision ("auto"). Cascade costs a few extra launches per layer (the prefix pass and the merge)
and, for a decode-only step, the CUDA graph it would have replayed. It runs when the K/V bytes
it saves per layer exceed MIN_SAVED_BYTES_PER_LAYER (about 20 us of HBM traffic on an H100,
versus a few us of launches), four times that when it would give up a graph replay. This
follows vLLM's `use_cascade_attention` (no cascade for short prefixes or few requests, compare
a cost model of both ways), generalised from one batch-wide prefix to many groups.
"on" runs cascade whenever two requests share a block (groups chosen to cover the most shared
keys); "off" never. "auto" needs the Triton kernels: the PyTorch backend is the reference and
the CPU path, where the decomposition only adds work, so it runs cascade on "on" alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mmengine.layers.cascade import CascadeGroup

MIN_SAVED_BYTES_PER_LAYER = 64 << 20
GRAPH_REPLAY_FACTOR = 4  # a decode-only step that runs eager for cascade must save this much more

MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class CascadePolicy:
    mode: str  # "auto" | "on" | "off", as resolved for the backend ("auto" without kernels is "off")
    block_size: int
    tokens_per_tile: int  # query tokens one tile of rows holds (see layers/cascade.py)
    kv_bytes_per_token: int  # K and V of one token in one layer

    def plan(
        self,
        block_tables: Sequence[Sequence[int]],
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        replaces_graph: bool = False,
    ) -> list[CascadeGroup]:
        """The groups of one step (rows in packed order), or [] when the step runs without cascade."""
        if self.mode == "off" or len(query_lens) < 2:
            return []
        prefixes = shared_candidates(block_tables, seq_lens, self.block_size)
        if not prefixes:
            return []
        tile = self.tokens_per_tile

        def saved_keys(rows: list[int], num_blocks: int) -> int:
            tiles_alone = sum(-(-query_lens[r] // tile) for r in rows)
            tiles_packed = -(-sum(query_lens[r] for r in rows) // tile)
            return (tiles_alone - tiles_packed) * num_blocks * self.block_size

        if self.mode == "on":
            return choose_groups(prefixes, lambda rows, num_blocks: len(rows) * num_blocks)
        groups = choose_groups(prefixes, saved_keys)
        saved = sum(saved_keys(g.rows, g.num_prefix_blocks) for g in groups)
        needed = MIN_SAVED_BYTES_PER_LAYER * (GRAPH_REPLAY_FACTOR if replaces_graph else 1)
        return groups if saved * self.kv_bytes_per_token >= needed else []


def shared_candidates(
    block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], block_size: int
) -> dict[int, tuple[int, ...]]:
    """Row -> its full blocks, for the rows whose first block another row starts with too."""
    firsts: dict[int, int] = {}
    for row, blocks in enumerate(block_tables):
        if seq_lens[row] >= block_size and blocks:
            firsts[blocks[0]] = firsts.get(blocks[0], 0) + 1
    return {
        row: tuple(blocks[: seq_lens[row] // block_size])
        for row, blocks in enumerate(block_tables)
        if seq_lens[row] >= block_size and blocks and firsts[blocks[0]] > 1
    }


def choose_groups(
    prefixes: dict[int, tuple[int, ...]], worth: Callable[[list[int], int], int]
) -> list[CascadeGroup]:
    """Single-level groups over the trie of `prefixes` (row -> block ids) that maximise the summed
    worth(rows, num_prefix_blocks); groups worth nothing are dropped. Iterative post-order over
    the sorted rows, so a deep trie cannot exhaust the recursion limit."""
    order = sorted(prefixes, key=prefixes.__getitem__)
    keys = [prefixes[row] for row in order]
    best: dict[tuple[int, int], tuple[int, list[CascadeGroup]]] = {}
    stack: list[tuple[int, int, int, list[tuple[int, int]] | None]] = [(0, len(order), 0, None)]
    while stack:
        lo, hi, depth, children = stack.pop()
        if hi - lo < 2:
            best[lo, hi] = (0, [])
            continue
        common = _common_length(keys[lo], keys[hi - 1], depth)
        if children is None:
            children = _children(keys, lo, hi, common)
            stack.append((lo, hi, depth, children))
            stack.extend((c_lo, c_hi, common + 1, None) for c_lo, c_hi in children)
            continue
        split_worth = sum(best[c][0] for c in children)
        here = worth([order[i] for i in range(lo, hi)], common) if common else 0
        if here > 0 and here >= split_worth:
            best[lo, hi] = (here, [CascadeGroup(sorted(order[lo:hi]), common)])
        else:
            best[lo, hi] = (split_worth, [g for c in children for g in best[c][1]])
    return sorted(best[0, len(order)][1], key=lambda g: g.rows[0])


def _common_length(a: tuple[int, ...], b: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of a and b, which agree on their first `start` entries."""
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _children(keys: list[tuple[int, ...]], lo: int, hi: int, depth: int) -> list[tuple[int, int]]:
    """Ranges of sorted keys[lo:hi] (sharing their first `depth` entries) by their entry at `depth`;
    keys that end at `depth` belong to no child."""
    i = lo
    while i < hi and len(keys[i]) == depth:  # a shorter key sorts before its extensions
        i += 1
    ranges = []
    while i < hi:
        j = i + 1
        while j < hi and keys[j][depth] == keys[i][depth]:
            j += 1
        ranges.append((i, j))
        i = j
    return ranges
