"""Merges the Prometheus text of several replicas into one exposition: every sample summed over the
replicas (no label added), then each replica's own samples with a `replica` label.

Counters, gauges and histogram buckets all add up meaningfully across replicas (free KV blocks of
the fleet, requests in flight, encoder runs, latency bucket counts). `_created` timestamps do not,
so they are left out.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

REPLICA_LABEL = "replica"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _sample_line(name: str, labels: dict[str, str], value: float) -> str:
    if labels:
        inner = ",".join(f'{key}="{_escape(str(val))}"' for key, val in labels.items())
        return f"{name}{{{inner}}} {floatToGoString(value)}"
    return f"{name} {floatToGoString(value)}"


def merge_replica_metrics(texts: Sequence[str]) -> str:
    """`texts[i]`: replica i's /metrics text."""
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help), in first-seen order
    totals: dict[str, dict[tuple, float]] = {}  # family -> (sample name, labels) -> sum
    per_replica: dict[str, list[str]] = {}
    for replica, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            if family.name.endswith("_created"):  # creation timestamps, as their own gauge families
                continue
            families.setdefault(family.name, (family.type, family.documentation))
            sums = totals.setdefault(family.name, {})
            lines = per_replica.setdefault(family.name, [])
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                key = (sample.name, tuple(sample.labels.items()))
                sums[key] = sums.get(key, 0.0) + sample.value
                lines.append(_sample_line(sample.name, {**sample.labels, REPLICA_LABEL: str(replica)}, sample.value))
    out = []
    for name, (kind, documentation) in families.items():
        out.append(f"# HELP {name} {documentation}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(_sample_line(sample, dict(labels), value) for (sample, labels), value in totals[name].items())
        out.extend(per_replica[name])
    return "\n".join(out) + "\n"
