"""The server's latency histograms: a whole answer's last delta carries every token after its first, and its
inter-token gaps are observed in one call (metrics.observe_many) that must count as that many observe() calls."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from mmengine.entrypoints.metrics import ITL_BUCKETS, observe_many


def _samples(histogram: Histogram) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in histogram.collect()[0].samples
            if not s.name.endswith("_created")}


@pytest.mark.parametrize("count", [1, 2, 15])
@pytest.mark.parametrize("amount", [0.0, 0.001, 0.004, 0.1, 2.5, 3.0, 1e9])  # on a bound, between, past the last
def test_observe_many_counts_as_that_many_observe_calls(amount, count):
    one_by_one, at_once = (Histogram("gap", "gap", buckets=ITL_BUCKETS, registry=CollectorRegistry()) for _ in range(2))
    for _ in range(count):
        one_by_one.observe(amount)
    observe_many(at_once, amount, count)
    expected, got = _samples(one_by_one), _samples(at_once)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if key[0] == "gap_sum":
            assert got[key] == pytest.approx(value)  # amount * count against a running sum
        else:
            assert got[key] == value, key  # every bucket and the count exactly


def test_observe_many_falls_back_to_observe_calls():
    class Plain:  # a histogram without prometheus-client's bucket fields
        def __init__(self) -> None:
            self.observed: list[float] = []

        def observe(self, amount: float) -> None:
            self.observed.append(amount)

    plain = Plain()
    observe_many(plain, 0.02, 3)
    assert plain.observed == [0.02, 0.02, 0.02]
