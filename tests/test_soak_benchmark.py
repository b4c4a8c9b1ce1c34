"""benchmarks/soak.py on the tiny model, briefly: good, bad and disconnecting clients against a real
`mmengine serve` on loopback; every bad kind is answered 4xx with a message, nothing unexpected
happens, and the engine's books are back at their idle values afterwards."""

from __future__ import annotations

import json

from helpers import load_benchmark


def test_a_short_soak_serves_every_kind_and_returns_to_idle(checkpoint_dir, tmp_path):
    soak = load_benchmark("soak")
    out = tmp_path / "soak.json"
    result = soak.main(["--model", str(checkpoint_dir()), "--minutes", "0.1", "--clients", "4", "--max-requests", "400",
                        "--seed", "3", "--output", str(out)])
    assert result["unexpected"] == 0, result["unexpected_examples"]
    assert result["server_alive"] and all(result["back_to_idle"].values()), result["books_after"]
    served = result["served_by_kind"]
    assert served.get("stream", 0) > 0 and served.get("plain", 0) > 0 and served.get("disconnect", 0) > 0
    assert served.get("structured", 0) > 0  # n=2 schema-bound answers with logprobs and a penalty
    bad = {kind: status for kind_status in result["answers_by_kind_and_status"]
           for kind, status in [kind_status.split()] if kind in soak.BAD}
    assert bad and all(status.startswith("4") for status in bad.values())
    assert result["requests_sent"] <= 400 and result["rss"]["samples"] >= 1
    assert json.loads(out.read_text())["requests_sent"] == result["requests_sent"]
