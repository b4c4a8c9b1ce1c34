"""Whether a step runs cascade attention, and with which groups: host-side, from the block tables
and the scheduled token counts, with no device work.

Groups. Requests whose block tables start with the same physical blocks (full blocks inside
every member's context) can share a prefix pass. The candidates form a trie over block ids, and
one bottom-up pass picks single-level groups: at each node, either the node is one group (its
common prefix, all requests below it) or its children are grouped on their own, whichever is
worth more (the first level of BatchLLM's grouping, over physical blocks).

Worth, in key reads (the cost a memory-bound attention step pays). Without cascade a request
reads its whole context once per tile of query rows: once for a decode, ceil(q / tile) times
for a chunk of q tokens. With cascade a group reads its prefix once per tile of the group's
packed rows. So a group saves
    (sum over members of ceil(q_r / tile) - ceil(sum of q_r / tile)) x prefix length
key reads; decodes save the most (16 decodes in one tile: 15 prefix reads saved), long prefill
chunks almost nothing (their tiles are already full).

Decision ("auto"). Cascade costs two more launches per layer (the prefix pass and the merge).
On a step that runs eagerly anyway (prefill or mixed) it runs when the K/V bytes it saves per
layer exceed MIN_SAVED_BYTES_PER_LAYER (about 20 us of HBM traffic on an H100, versus a few us of
launches). A decode-only step runs cascade only inside a cascade CUDA graph, never eagerly in
place of a graph: measured on an H100 (LLaVA-1.5-7B shape, 256 decodes in groups of about 4
sharing a 600-token image prefix), eager cascade steps made a 512-request run 15% slower than
plain graph replays, from the launches alone (their kernels took 21.6 ms a step against 25.7).
A cascade graph holds at most `GraphBounds.max_tiles` tiles: the groups worth most are kept. This
follows vLLM's `use_cascade_attention` (no cascade for short prefixes or few requests, compare a
cost model of both ways), generalised from one batch-wide prefix to many groups.
"on" runs cascade whenever two requests share a block (groups chosen to cover the most shared
keys; in a cascade graph when they fit it, else eagerly); "off" never. "auto" needs the Triton
kernels: the PyTorch backend is the reference and the CPU path, where the decomposition only adds
work, so it runs cascade on "on" alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mmengine.layers.cascade import CascadeGroup, count_tiles, tokens_per_tile
from mmengine.layers.split_kv import choose_num_splits

MIN_SAVED_BYTES_PER_LAYER = 64 << 20
MAX_GRAPH_PREFIX_SPLITS = 16  # a cascade graph's partial states are sized for this many splits

MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class GraphBounds:
    """What a cascade decode graph of one batch size holds: its grids and partial states are sized
    for these, and a step's layout must fit them (tiles x splits <= max_work)."""

    max_tiles: int
    max_splits: int

    @property
    def max_work(self) -> int:
        return max(self.max_tiles, self.max_splits)


@dataclass(frozen=True)
class CascadePolicy:
    mode: str  # "auto" | "on" | "off", as resolved for the backend ("auto" without kernels is "off")
    block_size: int
    tokens_per_tile: int  # query tokens one tile of rows holds (see layers/cascade.py)
    kv_bytes_per_token: int  # K and V of one token in one layer
    num_kv_heads: int = 1
    num_sms: int = 8  # the GPU's multiprocessors (the split heuristic fills them)

    def plan(
        self,
        block_tables: Sequence[Sequence[int]],
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        graph_tiles: int | None = None,
    ) -> list[CascadeGroup]:
        """The groups of one step (rows in packed order), or [] when the step runs without cascade.
        `graph_tiles`: None for an eager step; for a step that would replay a decode graph, the
        tiles its cascade graph holds (0: it has none). "auto" keeps such a step in a graph:
        plain, or cascade with the groups that fit; "on" may return more, run eagerly."""
        if self.mode == "off" or len(query_lens) < 2 or (self.mode == "auto" and graph_tiles == 0):
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
            return checked(choose_groups(prefixes, lambda rows, num_blocks: len(rows) * num_blocks), prefixes)
        groups = checked(choose_groups(prefixes, saved_keys), prefixes)
        if graph_tiles is not None:
            groups = self._most_worth(groups, saved_keys, query_lens, graph_tiles)
        saved = sum(saved_keys(g.rows, g.num_prefix_blocks) for g in groups)
        return groups if saved * self.kv_bytes_per_token >= MIN_SAVED_BYTES_PER_LAYER else []

    def _most_worth(self, groups: list[CascadeGroup], worth: Callable[[list[int], int], int],
                    query_lens: Sequence[int], max_tiles: int) -> list[CascadeGroup]:
        """The groups worth most whose tiles fit in max_tiles, in row order."""
        kept, tiles = [], 0
        for group in sorted(groups, key=lambda g: -worth(g.rows, g.num_prefix_blocks)):
            need = count_tiles([group], query_lens, self.tokens_per_tile)
            if tiles + need <= max_tiles:
                kept.append(group)
                tiles += need
        return sorted(kept, key=lambda g: g.rows[0])

    def prefix_splits(self, num_tiles: int, longest_prefix: int, bounds: GraphBounds | None = None) -> int:
        """Splits of the prefix pass: the split-KV rule over its tiles, within a cascade graph's bounds."""
        most = 64 if bounds is None else bounds.max_splits
        splits = choose_num_splits(num_tiles, self.num_kv_heads, longest_prefix, self.num_sms, most=most)
        while bounds is not None and splits > 1 and num_tiles * splits > bounds.max_work:
            splits //= 2
        return splits

    def graph_bounds(self, batch_size: int, max_model_len: int) -> GraphBounds:
        """A decode graph of batch_size rows holds groups of four members on average (pairs gain
        little: concurrent reads of a shared block mostly hit L2), and as many splits as one tile
        over the longest context would take."""
        most = choose_num_splits(1, self.num_kv_heads, max_model_len, self.num_sms, most=MAX_GRAPH_PREFIX_SPLITS)
        return GraphBounds(max_tiles=max(1, batch_size // 4), max_splits=most)


@dataclass(frozen=True)
class CascadeLayerShape:
    """The attention shape a step's cascade layout is planned for."""

    tokens_per_tile: int
    kv_bytes_per_token: int  # K and V of one token in one such layer
    num_kv_heads: int


def cascade_layer_shape(num_heads: int, layout: Sequence[tuple[int, int]], windows: Sequence[int | None],
                        element_bytes: int) -> CascadeLayerShape:
    """The shape of the layers that take cascade: the full-attention ones (`layout`: each cached layer's
    (KV heads, head size); a windowed layer runs every step without cascade). The prefix pass's tile
    holds tokens of one GQA group, so layers whose groups differ (Gemma 4's global layers against its
    sliding ones) need layouts of different tiles: the step's layout is planned for the tile of the
    layers holding the most K/V bytes, and a layer of another tile runs the step without cascade
    (layers/attention.py)."""
    full = [(heads, dim) for (heads, dim), window in zip(layout, windows) if window is None] or list(layout)
    by_tile: dict[int, list[tuple[int, int]]] = {}
    for heads, dim in full:
        by_tile.setdefault(tokens_per_tile(num_heads, heads), []).append((heads, dim))
    tile, layers = max(by_tile.items(), key=lambda item: sum(heads * dim for heads, dim in item[1]))
    kv_bytes = sum(2 * heads * dim * element_bytes for heads, dim in layers) // len(layers)
    return CascadeLayerShape(tile, kv_bytes, max(heads for heads, _ in layers))


def shared_candidates(
    block_tables: Sequence[Sequence[int]], seq_lens: Sequence[int], block_size: int
) -> dict[int, Sequence[int]]:
    """Row -> its full blocks, for the rows whose first block another row starts with too."""
    firsts: dict[int, int] = {}
    for row, blocks in enumerate(block_tables):
        if seq_lens[row] >= block_size and blocks:
            firsts[blocks[0]] = firsts.get(blocks[0], 0) + 1
    return {
        row: blocks[: seq_lens[row] // block_size]
        for row, blocks in enumerate(block_tables)
        if seq_lens[row] >= block_size and blocks and firsts[blocks[0]] > 1
    }


def choose_groups(
    prefixes: dict[int, Sequence[int]], worth: Callable[[list[int], int], int]
) -> list[CascadeGroup]:
    """Single-level groups over the trie of `prefixes` (row -> block ids) that maximise the summed
    worth(rows, num_prefix_blocks); groups worth nothing are dropped.

    A prefix cache shares a physical block only between requests whose hash chains agree up to it,
    so the same id in one column means the same ids in every column before it. That makes a set
    of rows' common prefix a binary search over columns, and a node's children a split by the id
    in the first column where they differ (`checked` makes sure of the chosen groups, so
    correctness never rests on it). Nodes are built top-down into a list and valued bottom-up by
    walking it backwards: no recursion, however deep the trie."""
    rows_of: list[list[int]] = [sorted(prefixes)]
    depth_of = [0]
    common_of: list[int] = []
    children_of: list[list[int]] = []
    node = 0
    while node < len(rows_of):  # top-down; children are appended behind their parent
        rows, kids, common = rows_of[node], [], 0
        if len(rows) >= 2:
            common = _common_length(prefixes, rows, depth_of[node])
            branches: dict[int, list[int]] = {}
            for row in rows:
                if len(prefixes[row]) > common:
                    branches.setdefault(prefixes[row][common], []).append(row)
            for branch in branches.values():
                if len(branch) >= 2:
                    kids.append(len(rows_of))
                    rows_of.append(branch)
                    depth_of.append(common + 1)
        common_of.append(common)
        children_of.append(kids)
        node += 1
    best: list[tuple[int, list[CascadeGroup]]] = [(0, [])] * len(rows_of)
    for node in reversed(range(len(rows_of))):  # bottom-up
        split_worth = sum(best[c][0] for c in children_of[node])
        here = worth(rows_of[node], common_of[node]) if common_of[node] and len(rows_of[node]) >= 2 else 0
        if here > 0 and here >= split_worth:
            best[node] = (here, [CascadeGroup(rows_of[node], common_of[node])])
        else:
            best[node] = (split_worth, [g for c in children_of[node] for g in best[c][1]])
    return sorted(best[0][1], key=lambda g: g.rows[0])


def checked(groups: list[CascadeGroup], prefixes: dict[int, Sequence[int]]) -> list[CascadeGroup]:
    """The groups with each prefix cut to the blocks all its members really have in common, block
    by block (empty ones dropped)."""
    result = []
    for group in groups:
        leader = prefixes[group.rows[0]]
        common = group.num_prefix_blocks
        for row in group.rows[1:]:
            blocks = prefixes[row]
            if blocks[:common] != leader[:common]:
                common = next(i for i in range(common) if blocks[i] != leader[i])
        if common:
            result.append(CascadeGroup(group.rows, common))
    return result


def _common_length(prefixes: dict[int, Sequence[int]], rows: list[int], depth: int) -> int:
    """Columns all rows share, given that they share the first `depth` (a binary search: sharing
    is prefix-closed, see choose_groups)."""
    leader = prefixes[rows[0]]
    lo, hi = depth, min(len(prefixes[row]) for row in rows)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if all(prefixes[row][mid - 1] == leader[mid - 1] for row in rows):
            lo = mid
        else:
            hi = mid - 1
    return lo
