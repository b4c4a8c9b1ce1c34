"""benchmarks/gpu_suite.py's usage lines (its --help) name parts the suite has: the example `--only decode,lora`
was refused ("unknown part(s) ['decode']") when copied."""

from __future__ import annotations

import re

from helpers import load_benchmark


def test_the_usage_examples_name_known_parts():
    suite = load_benchmark("gpu_suite")
    known = {part.name for part in suite.PARTS}
    examples = re.findall(r"--only ([\w,]+)", suite.__doc__)
    assert examples  # the docstring shows at least one --only example
    named = [name for example in examples for name in example.split(",")]
    assert [name for name in named if name not in known] == []
