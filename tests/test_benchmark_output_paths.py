"""Every benchmark writes its JSON under benchmarks/results/ by default (docs/benchmarks.md says so, and
.gitignore covers that folder), never to a results/ folder beside wherever it was started."""

from __future__ import annotations

import pathlib
import re

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
OUTPUT_DEFAULT = re.compile(r"""add_argument\(\s*["']--output["']\s*,\s*default=["']([^"']+)["']""")


def test_every_benchmark_output_defaults_under_benchmarks_results():
    defaults = {}
    for script in sorted(BENCHMARKS.glob("*.py")):
        found = OUTPUT_DEFAULT.findall(script.read_text())
        if found:
            defaults[script.name] = found
    assert len(defaults) >= 20  # the scripts that write a JSON; a change to the pattern would find none
    stray = {name: paths for name, paths in defaults.items()
             if any(not path.startswith("benchmarks/results/") for path in paths)}
    assert stray == {}
