"""The workload fuzzer's seeded cases in the suite (small ones; `python tests/fuzz/fuzzer.py --minutes N`
runs long), and proof that it catches what it checks for: a failure names its seed and replay line."""

from __future__ import annotations

import json

import pytest

from fuzz_case import FAMILIES, TRITON_FAMILIES, TRITON_SEEDS, make_case
from fuzzer import CaseReport, FuzzEnv, FuzzFailure, main, run_case

SEEDS = range(28)  # two or three per family: make_case(seed, quick=True) picks the family by seed
FULL_SEEDS = (0, 1, 2)  # full-size cases (the timed mode's)


@pytest.fixture(scope="module")
def env(family_checkpoint) -> FuzzEnv:
    return FuzzEnv(family_checkpoint)


_REPORTS: dict[int, CaseReport] = {}  # a quick seed's report, kept: a case is a function of its seed


def _quick_report(seed: int, env: FuzzEnv) -> CaseReport:
    if seed not in _REPORTS:
        _REPORTS[seed] = run_case(make_case(seed, quick=True), env)
    return _REPORTS[seed]


def test_cases_are_a_function_of_their_seed():
    assert make_case(5, quick=True) == make_case(5, quick=True)
    assert make_case(5) != make_case(6)
    assert {make_case(seed, quick=True).family for seed in SEEDS} == set(FAMILIES)
    assert {make_case(seed, quick=True).family for seed in TRITON_SEEDS} == set(TRITON_FAMILIES)
    # the Qwen cases show videos too (text or dict prompts, never in a bad request)
    clips = [spec for seed in SEEDS for spec in make_case(seed, quick=True).requests() if spec.clip is not None]
    assert clips and all(spec.prompt_form in ("text", "dict") and spec.defect in (None, "hostile_video") for spec in clips)


@pytest.mark.parametrize("seed", SEEDS)
def test_seeded_case(env, seed):
    report = _quick_report(seed, env)
    assert report.requests > 0 and report.steps > 0


@pytest.mark.parametrize("seed", FULL_SEEDS)
def test_full_size_case(env, seed):
    case = make_case(seed)
    assert case.options.get("attn_backend") != "triton"  # keep the suite fast: these seeds use the torch backend
    run_case(case, env)


def test_the_seeded_cases_reach_what_they_are_for(env):
    """Across the suite's seeds the fuzzer really exercises aborts, bad requests, prefix hits, LoRA
    adapters, preemption, cascade and speculative decoding, so the seeded test is not green for want of trying."""
    cases = [make_case(seed, quick=True) for seed in SEEDS]
    assert any(case.callers for case in cases) and any(s.defect for case in cases for s in case.requests())
    assert any(s.lora is not None for case in cases for s in case.requests())
    assert {s.prompt_form for case in cases for s in case.requests()} == {"text", "dict", "markers", "expanded"}
    assert any(s.abort_after_steps is not None for case in cases for s in case.driver)
    assert any(s.defect == "hostile_video" for case in cases for s in case.requests())
    reports = [_quick_report(case.seed, env) for case in cases[:9]]  # (test_seeded_case's runs, where it ran first)
    assert sum(r.prefix_cache_hits for r in reports) > 0 and sum(r.bad_requests for r in reports) > 0
    assert sum(r.weight_updates for r in reports) > 0
    # speculating cases verified drafts and kept some (over every seed: test_seeded_case has run them all), and
    # the draft heads drafted too
    quick = [_quick_report(case.seed, env) for case in cases]
    assert sum(r.spec_accepted_tokens for r in quick) > 0
    assert {r.spec_method for r in quick if r.spec_draft_tokens} == {"ngram", "mtp", "eagle3"}


def test_a_leak_fails_the_case_with_its_seed_and_replay_command(env, monkeypatch):
    from mmengine.kv_cache.manager import KVCacheManager

    monkeypatch.setattr(KVCacheManager, "free", lambda self, request: None)  # blocks are never given back
    with pytest.raises(FuzzFailure) as failure:
        run_case(make_case(1, quick=True), env)
    assert "seed 1" in str(failure.value) and "replay: python tests/fuzz/fuzzer.py --seed 1 --quick" in str(failure.value)


def test_wrong_tokens_fail_the_case(env, monkeypatch):
    import fuzzer

    original = fuzzer._expect

    def expect_other_tokens(case, built, reference):
        original(case, built, reference)
        for b in built:
            b.reference = [token + 1 for token in b.reference]

    monkeypatch.setattr(fuzzer, "_expect", expect_other_tokens)
    with pytest.raises(FuzzFailure, match="tokens differ from the reference"):
        run_case(make_case(1, quick=True), env)


def test_the_timed_mode_writes_its_counts(family_checkpoint, tmp_path, monkeypatch):
    import fuzzer

    monkeypatch.setattr(fuzzer, "default_checkpoint", family_checkpoint)
    out = tmp_path / "fuzz.json"
    assert main(["--minutes", "0.02", "--quick", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["failed"] == 0 and summary["passed"] >= 1 and summary["totals"]["requests"] > 0
