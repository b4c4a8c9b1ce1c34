"""The fuzzer's quick cases on the Triton kernels with cascade on, one per family of fuzz_case.TRITON_FAMILIES (a
file of its own: in Triton's interpreter on a CPU they take minutes, which pytest-xdist runs beside test_fuzz.py)."""

from __future__ import annotations

import pytest

from fuzz_case import TRITON_SEEDS, make_case
from fuzzer import FuzzEnv, run_case


@pytest.fixture(scope="module")
def env(family_checkpoint) -> FuzzEnv:
    return FuzzEnv(family_checkpoint)


def test_seeded_cases_on_the_triton_kernels_with_cascade_on(env, no_tf32):
    """One quick case per Triton family on the Triton kernels (the interpreter on a CPU) with cascade on; across
    them, cascade really groups requests (three requests on one long system text)."""
    reports = []
    for seed in TRITON_SEEDS:
        case = make_case(seed, quick=True)
        assert case.options["attn_backend"] == "triton" and case.options["cascade_attention"] == "on"
        reports.append(run_case(case, env))
    assert all(r.requests > 0 and r.steps > 0 for r in reports)
    assert sum(r.cascade_steps > 0 for r in reports) >= 3, [(r.family, r.cascade_steps) for r in reports]
