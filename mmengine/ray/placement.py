"""Cache-affine placement of rows on replicas: pure functions, no Ray.

With affinity, rows with the same sharing key go to the same replica, so each replica sees everything
that shares its cached state (an image encoded once, a prefix prefilled once). Skew is bounded: a key
with more rows than a fair share (ceil(rows / replicas)) is split into chunks of at most a fair share,
chunks are placed largest first on the least-loaded replica, and no replica takes more than
`max_skew` times a fair share (a chunk that would overflow one is split at the cap). Rows without a
key are chunks of one. Within a replica, each key's rows stay together, in input order.

`preferred` (key -> replica) makes placement sticky across windows of a stream: a key's chunks go to
the replica that already holds its cached state while that replica is under the cap.

Without affinity, rows are dealt round-robin: row i goes to replica i % replicas.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from mmengine.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    """Row indices per replica, in the order each replica should run them."""

    rows: tuple[tuple[int, ...], ...]

    @property
    def loads(self) -> list[int]:
        return [len(r) for r in self.rows]

    def replica_of(self) -> dict[int, int]:
        return {row: replica for replica, rows in enumerate(self.rows) for row in rows}


def place_rows(
    keys: Sequence[Hashable | None],
    num_replicas: int,
    affinity: bool = True,
    max_skew: float = 1.25,
    preferred: Mapping[Hashable, int] | None = None,
) -> Placement:
    """Places rows (given by their sharing keys) on `num_replicas` replicas."""
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ConfigError(f"num_replicas must be a positive int, got {num_replicas!r}")
    if not max_skew >= 1.0:
        raise ConfigError(f"max_skew must be at least 1.0, got {max_skew!r}")
    if not affinity:
        return Placement(tuple(tuple(range(r, len(keys), num_replicas)) for r in range(num_replicas)))
    fair = max(1, math.ceil(len(keys) / num_replicas))
    cap = max(fair, math.floor(fair * max_skew))
    chunks = [c for unit in _key_units(keys) for c in _split(unit, fair)]
    chunks.sort(key=lambda c: (-len(c), c[0]))  # largest first; ties in input order
    placed: list[list[list[int]]] = [[] for _ in range(num_replicas)]
    loads = [0] * num_replicas
    pending = list(reversed(chunks))
    while pending:
        chunk = pending.pop()
        replica = min(range(num_replicas), key=lambda r: (loads[r], r))
        favourite = preferred.get(keys[chunk[0]]) if preferred and keys[chunk[0]] is not None else None
        if favourite is not None and 0 <= favourite < num_replicas and loads[favourite] < cap:
            replica = favourite
        room = cap - loads[replica]
        if len(chunk) > room:  # room > 0: a favourite is below the cap, and so is the least loaded while rows remain
            chunk, rest = chunk[:room], chunk[room:]
            pending.append(rest)
        placed[replica].append(chunk)
        loads[replica] += len(chunk)
    return Placement(tuple(tuple(row for chunk in sorted(p, key=lambda c: c[0]) for row in chunk) for p in placed))


def _key_units(keys: Sequence[Hashable | None]) -> list[list[int]]:
    """Rows grouped by key in order of first appearance; each keyless row alone."""
    by_key: dict[Hashable, list[int]] = {}
    units: list[list[int]] = []
    for row, key in enumerate(keys):
        if key is None:
            units.append([row])
        elif key in by_key:
            by_key[key].append(row)
        else:
            by_key[key] = [row]
            units.append(by_key[key])
    return units


def _split(unit: list[int], fair: int) -> list[list[int]]:
    """A unit of more than `fair` rows split into near-equal chunks of at most `fair` rows."""
    parts = math.ceil(len(unit) / fair)
    size, extra = divmod(len(unit), parts)
    out, start = [], 0
    for part in range(parts):
        end = start + size + (part < extra)
        out.append(unit[start:end])
        start = end
    return out
