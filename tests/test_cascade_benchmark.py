"""benchmarks/cascade_attention.py runs at tiny shapes (in Triton's interpreter without a GPU), its
two paths agree, and it reports every field; without a GPU the full-size run says why it cannot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("cascade_attention")


def test_tiny_run_reports_both_paths_and_they_agree(bench, tmp_path):
    """The GPU suite's "cascade_kernel" part's dry command (test_gpu_suite.py leaves it to this test), read as the part
    reads it: every figure a value."""
    suite = load_benchmark("gpu_suite")
    (part,) = [p for p in suite.PARTS if p.name == "cascade_kernel"]
    ctx = suite.Context(tmp_path, tmp_path / "checkpoints", dry_run=True)
    script, *args = part.dry_args(ctx)
    assert Path(script).name == "cascade_attention.py" and args[:3] == ["--tiny", "--members", "1,3"]
    result = bench.main(args)
    assert json.loads(ctx.output(part.name).read_text()) == json.loads(json.dumps(result))
    figures = [suite.judge(name, value, unit, target, True) for name, value, unit, target in part.read(result)]
    assert figures and all(fig.value is not None and fig.verdict == "dry run" for fig in figures), figures
    alone, grouped = result["rows"]
    assert alone["members"] == 1 and alone["num_cascade_groups"] == 0  # nothing to share
    assert alone["cascade_kv_bytes"] == alone["plain_kv_bytes"]
    assert grouped["members"] == 3 and grouped["batch"] == 3 * grouped["groups"]
    assert grouped["num_cascade_groups"] == grouped["groups"]
    # each group reads its 32 shared tokens once instead of 3 times; each request its 9 own tokens
    per_token = grouped["plain_kv_bytes"] // (grouped["batch"] * 41)
    assert grouped["cascade_kv_bytes"] == per_token * grouped["groups"] * (32 + 3 * 9)
    for row in result["rows"]:
        assert row["max_abs_diff"] < 1e-4 and row["plain_ms"] > 0 and row["cascade_ms"] > 0
        assert row["speedup"] == pytest.approx(row["plain_ms"] / row["cascade_ms"])
        assert not row["auto_engages"]  # tiny K/V never pays for cascade under "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the full-size run is the benchmark itself")
def test_without_a_gpu_the_full_run_explains_itself(bench, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--output", "unused.json"])
    assert exit_info.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--members", "x"], ["--members", "0"], ["--shared", "4"], ["--num-heads", "6", "--num-kv-heads", "4"]])
def test_bad_options_are_usage_errors(bench, args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.parse_args(args)
    assert exit_info.value.code == 2 and "expected" in capsys.readouterr().err
