"""utils/collector_pace.py: a serving process's young garbage-collector passes run less often."""

from __future__ import annotations

import gc

import pytest

from mmengine.utils.collector_pace import SERVING_THRESHOLDS, pace_collector_for_serving


@pytest.fixture
def thresholds():
    before, enabled = gc.get_threshold(), gc.isenabled()
    yield
    gc.set_threshold(*before)
    (gc.enable if enabled else gc.disable)()


def test_the_default_thresholds_are_raised_to_the_serving_ones(thresholds):
    gc.set_threshold(700, 10, 10)  # CPython's defaults
    assert pace_collector_for_serving() == (700, 10, 10)
    assert gc.get_threshold() == SERVING_THRESHOLDS
    assert SERVING_THRESHOLDS[0] > 700


def test_a_threshold_raised_further_is_kept_and_none_is_lowered(thresholds):
    gc.set_threshold(50_000, 5, 100)
    pace_collector_for_serving()
    assert gc.get_threshold() == (50_000, SERVING_THRESHOLDS[1], 100)


def test_a_disabled_collector_stays_disabled(thresholds):
    gc.set_threshold(0)
    pace_collector_for_serving()
    assert gc.get_threshold()[0] == 0
    gc.set_threshold(700, 10, 10)
    gc.disable()
    pace_collector_for_serving()
    assert not gc.isenabled() and gc.get_threshold() == (700, 10, 10)


def test_young_passes_run_less_often_at_the_serving_pace(thresholds):
    """The count the change is for: the same allocations meet fewer generation-0 passes."""

    def young_passes() -> int:
        before = gc.get_stats()[0]["collections"]
        for _ in range(50):
            junk = [[] for _ in range(1_000)]  # containers the collector tracks, freed by reference counting
            del junk
        return gc.get_stats()[0]["collections"] - before

    gc.set_threshold(700, 10, 10)
    default = young_passes()
    pace_collector_for_serving()
    assert young_passes() * 5 < default
