"""benchmarks/gpu_suite.py: every part runs in a dry run on the CPU (so the script never rots), a failed
part is recorded and the rest still run, finished parts are kept across runs, the budget skips what
does not fit, and the report states the two commands of docs/gpu.md."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def suite():
    return load_benchmark("gpu_suite")


# The "ray" part runs benchmarks/ray_batch.py, which test_ray_batch.py runs (and reads as the part does) inside its own
# cluster: the dry run leaves it out rather than start another Ray cluster. The "decode_and_ttft", "image_workload", "lora",
# "gemma4_window_pool", "tiers", "video", "qwen3_5_9b" and "preprocess" parts' dry commands are test_benchmarks.py's runs of
# their scripts, and its IN_PROCESS_PARTS run their own dry commands (in-process: no interpreter, torch and engine start-up of
# their own), read there as the parts read them; this file's IN_PROCESS_PARTS likewise, and test_cascade_benchmark.py's tiny
# run is the "cascade_kernel" part's dry command, test_serve_benchmark.py's online-offline run the "online_offline" part's.
IN_PROCESS_PARTS = ["attention_gqa7", "serve", "speculative", "spec_decode", "quantized_llava_7b", "quantized_qwen2_5_vl_7b"]
COVERED_ELSEWHERE = ("ray", "decode_and_ttft", "image_workload", "lora", "gemma4_window_pool", "tiers", "video", "qwen3_5_9b",
                     "preprocess", "qwen2_5_vl_7b", "qwen3_vl_30b_a3b", "gemma4_dense", "shared_prefix", "tp", "cascade_kernel",
                     "online_offline", *IN_PROCESS_PARTS)


@pytest.fixture(scope="module")
def dry_run(suite, tmp_path_factory):
    """The suite's own dry run (each part a process of its own, two at a time) over the parts no test runs in-process: a
    script's and the test suite's (JUnit XML)."""
    out = tmp_path_factory.mktemp("dry-report")
    parts = [part.name for part in suite.PARTS if part.name not in COVERED_ELSEWHERE]
    status = suite.main(["--dry-run", "--out", str(out), "--jobs", "2", "--only", ",".join(parts)])
    return status, out, json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("part", IN_PROCESS_PARTS)
def test_parts_run_their_dry_commands_in_process(suite, part, tmp_path):
    """Each part's own dry command (on the stand-ins the dry run builds), run in-process and read as the part reads it:
    every figure a value."""
    (chosen,) = [p for p in suite.PARTS if p.name == part]
    ctx = suite.Context(tmp_path, tmp_path / "checkpoints", dry_run=True)
    suite.ensure_checkpoints(chosen, ctx, tmp_path / f"{part}.log")
    script, *args = chosen.dry_args(ctx)
    result = load_benchmark(Path(script).stem).main(args)
    data = json.loads(ctx.output(part).read_text())
    if isinstance(result, dict):
        assert data == json.loads(json.dumps(result, default=str))
    else:
        assert result == 0  # (attention.py returns its exit status)
    figures = [suite.judge(name, value, unit, target, True) for name, value, unit, target in chosen.read(data)]
    assert figures and all(fig.value is not None and fig.verdict == "dry run" for fig in figures), figures


def test_the_dry_run_runs_every_part_on_the_cpu(suite, dry_run):
    status, out, report = dry_run
    failed = {p["name"]: p["note"] for p in report["parts"] if p["status"] != "dry run"}
    assert status == 0 and failed == {}
    assert [p["name"] for p in report["parts"]] == [part.name for part in suite.PARTS if part.name not in COVERED_ELSEWHERE]
    for part in report["parts"]:
        assert part["figures"], part["name"]
        assert {fig["verdict"] for fig in part["figures"]} == {"dry run"}, part["name"]
        assert all(fig["value"] is not None for fig in part["figures"]), part["name"]
        assert (out / "logs" / f"{part['name']}.log").exists()
    assert report["header"]["mode"] == "dry run" and "dry run on the CPU" in report["header"]["gpu"]


def test_the_report_prints_the_guides_two_commands(suite, dry_run):
    _, out, _ = dry_run
    markdown = (out / "report.md").read_text()
    guide = (ROOT / "docs" / "gpu.md").read_text()
    for command in (suite.SETUP_COMMAND, suite.RUN_COMMAND):
        assert f"`{command}`" in markdown and command in guide
    assert markdown.count("| dry run |") >= len(suite.PARTS) - len(COVERED_ELSEWHERE)


def test_finished_parts_are_kept_and_rerun_measures_again(suite, dry_run, monkeypatch, tmp_path):
    _, finished, report = dry_run
    out = tmp_path / "report"
    shutil.copytree(finished, out)
    calls = []

    def fake_run(part, ctx, timeout_s):
        calls.append(part.name)
        return suite.PartResult(part.name, part.issues, "dry run", 0.5, ["python"], [suite.judge("x", 1.0, "x", None, True)])

    monkeypatch.setattr(suite, "run_part", fake_run)
    assert suite.main(["--dry-run", "--out", str(out), "--only", "attention_gqa4,tests"]) == 0 and calls == []
    kept = json.loads((out / "report.json").read_text())["parts"]
    assert kept == [p for p in report["parts"] if p["name"] in ("attention_gqa4", "tests")]
    assert suite.main(["--dry-run", "--out", str(out), "--only", "attention_gqa4", "--rerun"]) == 0 and calls == ["attention_gqa4"]


def test_a_failed_part_is_recorded_and_the_rest_still_run(suite, monkeypatch, tmp_path):
    def writes(value):
        return lambda ctx: ["-c", f"import json; open({str(ctx.output('good'))!r}, 'w').write(json.dumps({{'v': {value}}}))"]

    parts = [
        suite.Part("bad", "1", 1, (), lambda ctx: ["-c", "import sys; sys.exit(3)"], lambda ctx: ["-c", "import sys; sys.exit(3)"],
                   lambda data: []),
        suite.Part("good", "2", 1, (), writes(2.0), writes(2.0), lambda data: [("v", data["v"], "x", suite.at_most(1.0))]),
    ]
    monkeypatch.setattr(suite, "PARTS", parts)
    assert suite.main(["--out", str(tmp_path)]) == 1  # a full run: the targets are judged
    bad, good = json.loads((tmp_path / "report.json").read_text())["parts"]
    assert bad["status"] == "failed" and "exit status 3" in bad["note"]
    assert good["status"] == "done" and good["figures"] == [
        {"name": "v", "value": 2.0, "unit": "x", "target": "<= 1", "verdict": "falls short"}]
    assert "| bad | 1 | | | | failed: RuntimeError: exit status 3" in (tmp_path / "report.md").read_text()


def test_the_budget_skips_the_parts_that_no_longer_fit(suite, monkeypatch, tmp_path):
    monkeypatch.setattr(suite, "run_part", lambda *args: pytest.fail("nothing fits a budget of zero minutes"))
    assert suite.main(["--out", str(tmp_path), "--budget-minutes", "0"]) == 0
    parts = json.loads((tmp_path / "report.json").read_text())["parts"]
    assert {p["status"] for p in parts} == {"skipped"} and len(parts) == len(suite.PARTS)
    assert "left the budget" in parts[0]["note"]


def test_an_unknown_part_is_refused_by_name(suite, tmp_path, capsys):
    assert suite.main(["--out", str(tmp_path), "--only", "decode_and_ttft,nope"]) == 2
    assert "unknown part(s) ['nope']" in capsys.readouterr().err


def test_targets_judge_and_pytest_counts(suite, tmp_path):
    assert suite.judge("f", 0.95, "x", suite.at_least(0.9), False).verdict == "pass"
    assert suite.judge("f", 0.85, "x", suite.at_least(0.9), False).verdict == "falls short"
    assert suite.judge("f", 3, "ms", None, False).verdict == "reported"
    assert suite.judge("f", None, "ms", suite.at_most(1), False).verdict == "no value"
    assert suite.judge("f", 0.85, "x", suite.at_least(0.9), True).verdict == "dry run"
    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite tests="10" failures="1" errors="2" skipped="3"/></testsuites>')
    assert suite.junit_counts(xml) == {"passed": 4, "failed": 1, "errors": 2, "skipped": 3}


def test_every_part_reads_what_its_script_writes(suite):
    """The GPU commands name flags the scripts take (a typo would only show on the GPU)."""
    ctx = suite.Context(Path("/nowhere"), Path("/nowhere/checkpoints"), dry_run=False,
                        models={name: f"/nowhere/{name}" for name in [*suite.CHECKPOINTS, *suite.QUANTIZED]})
    for part in suite.PARTS:
        if part.writes_junit:
            continue
        command = part.args(ctx)
        script = load_benchmark(Path(command[0]).stem)
        parser_flags = _flags_of(script)
        unknown = [arg for arg in command[1:] if arg.startswith("--") and arg not in parser_flags]
        assert unknown == [], (part.name, unknown)


def _flags_of(module) -> set[str]:
    """Every option string of the script's argparse parser (its parser built without running main)."""
    import argparse

    seen: set[str] = set()
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        seen.update(s for action in self._actions for s in action.option_strings)
        raise SystemExit(0)

    argparse.ArgumentParser.parse_args = capture
    try:
        try:
            module.main(["--help"]) if module.main.__code__.co_argcount else _main_without_argv(module)
        except SystemExit:
            pass
    finally:
        argparse.ArgumentParser.parse_args = original
    return seen


def _main_without_argv(module) -> None:
    argv, sys.argv = sys.argv, ["script", "--help"]
    try:
        module.main()
    finally:
        sys.argv = argv
