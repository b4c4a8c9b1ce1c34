"""benchmarks/serve.py runs end to end at tiny settings (server in a thread) and reports every field."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import load_benchmark


def test_serve_benchmark_reports_both_sides(checkpoint_dir, tmp_path):
    module = load_benchmark("serve")
    output = tmp_path / "serve.json"
    result = module.main([
        "--model", str(checkpoint_dir()), "--server", "thread", "--num-users", "3", "--turns", "2",
        "--num-pictures", "2", "--output-len", "3", "--image-size", "64x48", "--max-model-len", "256",
        "--request-rate", "50", "--output", str(output),
    ])
    assert json.loads(output.read_text()) == json.loads(json.dumps(result))
    ours, baseline = result["mmengine"], result["transformers_sequential"]
    assert ours["requests"] == baseline["requests"] == 6
    assert ours["images_sent"] == 6 and ours["unique_pictures"] == 2
    assert ours["encoder_runs"] == 2 and baseline["encoder_runs"] == 6  # each shared picture encoded once
    assert ours["encoder_cache_hits"] >= 0 and 0 < ours["prefix_cache_hit_rate"] <= 1
    assert ours["cached_prompt_token_share"] > 0  # second turns reuse their first turn's blocks
    for row in (ours, baseline):
        assert row["requests_per_s"] > 0 and row["output_tokens_per_s"] > 0
        assert 0 < row["ttft_ms"]["p50"] <= row["ttft_ms"]["p99"]
        assert row["itl_ms"]["p50"] > 0
    assert result["speedup_requests_per_s"] == ours["requests_per_s"] / baseline["requests_per_s"]


def test_serve_benchmark_structured_mode(checkpoint_dir, tmp_path):
    module = load_benchmark("serve")
    result = module.main([
        "--model", str(checkpoint_dir()), "--server", "thread", "--num-users", "2", "--turns", "1", "--num-pictures", "1",
        "--output-len", "40", "--image-size", "64x48", "--max-model-len", "256", "--skip-baseline", "--structured",
        "--output", str(tmp_path / "serve.json"),
    ])
    structured = result["structured"]
    assert structured["requests"] == 2 and structured["itl_ms"]["mean"] > 0
    assert structured["itl_overhead"] == structured["itl_ms"]["mean"] / result["mmengine"]["itl_ms"]["mean"] - 1


def test_serve_benchmark_online_offline_is_the_gpu_suite_part(checkpoint_dir, tmp_path):
    """The GPU suite's "online_offline" part's dry command (its dry run leaves it to this test), run in-process and
    read as the part reads it."""
    module, suite = load_benchmark("serve"), load_benchmark("gpu_suite")
    (part,) = [p for p in suite.PARTS if p.name == "online_offline"]
    ctx = suite.Context(tmp_path, tmp_path / "checkpoints", dry_run=True)
    script, *args = part.dry_args(ctx)
    assert script.endswith("serve.py") and "--model" not in args  # the built-in tiny model: checkpoint_dir()'s
    result = module.main([*args, "--model", str(checkpoint_dir())])
    assert json.loads(ctx.output("online_offline").read_text()) == json.loads(json.dumps(result))
    row = result["online_offline"]
    (online,) = row["online"]
    offline, at_concurrency = row["offline_all_at_once"], row["offline_at_concurrency"]
    assert online["requests"] == offline["requests"] == at_concurrency["requests"] == 4
    assert online["identical_texts"] == 4  # greedy: the same answers
    for side in (online, offline, at_concurrency):
        assert side["requests_per_s"] > 0 and side["output_tokens_per_s"] == pytest.approx(3 * side["requests_per_s"])
        assert side["engine_steps"] >= 3  # a prefill and two decode steps at least
    # at most 2 in flight: two waves of (a prefill, 2 decodes) one after the other; all at once, fewer steps
    assert at_concurrency["max_num_seqs"] == 2 and at_concurrency["engine_steps"] == 6 > offline["engine_steps"]
    assert online["ratio_vs_all_at_once"] == online["requests_per_s"] / offline["requests_per_s"]
    assert online["ratio_vs_at_concurrency"] == online["requests_per_s"] / at_concurrency["requests_per_s"]
    assert offline["cpu_s"] > 0 and offline["cpu_ms_per_request"] == pytest.approx(offline["cpu_s"] / 4 * 1e3)
    assert online["cpu_s"] is None  # a server in this process: its CPU is not told apart from the clients'
    assert online["api_server_count"] == 1 and row["concurrency"] == 2 and row["stream"] is False
    readings = {name: (value, judge) for name, value, _, judge in part.read(result)}
    assert readings["offline, generate() at concurrency 2"][0] == at_concurrency["requests_per_s"]
    assert readings["online / offline all at once, api-server-count 1"] == (online["ratio_vs_all_at_once"], None)
    assert readings["engine steps per request, api-server-count 1"] == (online["engine_steps_per_request"], None)
    # judged at the clients' concurrency: the same step width, so the ratio is the server's own cost
    judged, judge = readings["online / offline at concurrency 2, best (api-server-count 1)"]
    assert judged == online["ratio_vs_at_concurrency"] and judge is not None
    assert [name for name, (_, judge) in readings.items() if judge is not None] == [
        "online / offline at concurrency 2, best (api-server-count 1)"]


def test_a_list_of_server_counts_is_for_online_offline_only():
    module = load_benchmark("serve")
    assert module.parse_args(["--online-offline", "--api-server-count", "1,4"]).api_server_count == [1, 4]
    assert module.parse_args([]).api_server_count == [1]
    for bad in ("0", "1,x", "2,0"):
        with pytest.raises(SystemExit):  # argparse: not counts of at least 1
            module.parse_args(["--api-server-count", bad])
    with pytest.raises(SystemExit, match="needs --online-offline"):
        module.main(["--api-server-count", "1,2"])
    with pytest.raises(SystemExit, match="needs --server subprocess"):
        module.main(["--online-offline", "--api-server-count", "1,2", "--server", "thread"])


def test_the_gpu_suite_part_pins_the_server_and_the_clients_apart_where_it_can(monkeypatch, tmp_path):
    suite = load_benchmark("gpu_suite")
    ctx = suite.Context(tmp_path, tmp_path / "checkpoints", dry_run=False)
    monkeypatch.setattr(suite.os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
    args = suite._online_offline_args(ctx)
    assert args[args.index("--api-server-count") + 1] == "1,4" and args[args.index("--device") + 1] == "cuda"
    assert args[args.index("--server-cpus") + 1] == "0,1,2,3,4,5,6,7"
    assert args[args.index("--client-cpus") + 1] == "8,9,10,11,12,13,14,15"
    monkeypatch.setattr(suite.os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    assert "--server-cpus" not in suite._online_offline_args(ctx)  # too few CPUs to split


def test_serve_benchmark_compares_answers_and_passes_the_server_count():
    module = load_benchmark("serve")
    same = module.ThroughputRun(1.0, [module.Answer("a b", 7, 2), module.Answer("c d", 7, 2)], 1)
    other_text = module.ThroughputRun(1.0, [module.Answer("a b", 7, 2), module.Answer("c e", 7, 2)], 1)
    other_count = module.ThroughputRun(1.0, [module.Answer("a b", 7, 2), module.Answer("c d", 8, 2)], 1)
    assert module.compare_answers(same, same, allow_text_mismatch=False) == 2
    with pytest.raises(RuntimeError, match="differ online and offline in 1 of 2 requests, first at request 1"):
        module.compare_answers(other_text, same, allow_text_mismatch=False)
    assert module.compare_answers(other_text, same, allow_text_mismatch=True) == 1
    with pytest.raises(RuntimeError, match="token counts differ, first at request 1"):
        module.compare_answers(other_count, same, allow_text_mismatch=True)
    command = module.serve_command("/m", 8123, ["--device", "cpu"], api_server_count=2)
    assert command[command.index("--api-server-count") + 1] == "2" and command[-2:] == ["--device", "cpu"]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="pinning the server and the clients apart needs Linux and two CPUs")
def test_pinning_puts_the_server_and_the_clients_on_their_own_cpus():
    module = load_benchmark("serve")
    first, second, *_ = sorted(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    args = module.parse_args(["--online-offline", "--server-cpus", str(first), "--client-cpus", str(second)])
    pinning = module.cpu_pinning(args)
    child = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with pinning.server_side():
        assert os.sched_getaffinity(0) == {first}
        assert subprocess.run(child, capture_output=True, text=True, check=True).stdout.strip() == f"[{first}]"  # inherited
    with pinning.client_side():
        assert os.sched_getaffinity(0) == {second}
    assert os.sched_getaffinity(0) == before
    thread = module.parse_args(["--server-cpus", str(first), "--client-cpus", str(second), "--server", "thread"])
    with pytest.raises(SystemExit, match="--server subprocess"):  # a server in this process cannot be pinned apart
        module.cpu_pinning(thread)


def test_pinning_options_are_checked_by_name():
    module = load_benchmark("serve")
    assert module.parse_args(["--server-cpus", "0-2,5", "--client-cpus", "3"]).server_cpus == {0, 1, 2, 5}
    with pytest.raises(SystemExit):
        module.parse_args(["--server-cpus", "zero"])  # argparse: not a CPU list
    for argv, message in [(["--server-cpus", "0"], "go together"),
                          (["--server-cpus", "0", "--client-cpus", "0"], "overlap"),
                          (["--server-cpus", "0", "--client-cpus", "100000"], "not available")]:
        with pytest.raises(SystemExit, match=message):
            module.cpu_pinning(module.parse_args(argv))


_LAUNCHER = """
import subprocess, sys, time
directory, with_core = sys.argv[1], sys.argv[2] == "1"
core = '''
import socket, sys, time
sock = socket.socket(socket.AF_UNIX)
sock.bind(sys.argv[1] + "/core.sock")
sock.listen()
while time.process_time() < 0.3:  # CPU seconds of its own, whatever the machine's speed
    pass
open(sys.argv[1] + "/core.ready", "w").close()
time.sleep(600)
'''
front_end = "import sys, time; open(sys.argv[1] + '/front.ready', 'w').close(); time.sleep(600)"
children = [subprocess.Popen([sys.executable, "-c", front_end, directory])]
if with_core:
    children.append(subprocess.Popen([sys.executable, "-c", core, directory]))
    # stands for multiprocessing's resource tracker (its command line names it): the launcher's, burning 0.3 s too
    tracker = core.replace("sock.bind", "import multiprocessing.resource_tracker; sock.bind").replace("core.", "tracker.")
    children.append(subprocess.Popen([sys.executable, "-c", tracker, directory]))
time.sleep(600)
"""


@pytest.mark.parametrize("with_core", [True, False])
def test_the_servers_cpu_is_split_between_its_engine_core_and_its_front_ends(tmp_path, with_core):
    """Served.cpu_seconds_by_role tells the engine core (the child listening on core.sock) from the front ends,
    and counts multiprocessing's resource tracker with the launcher; a server without a core is one "server" (the
    one-process server and its workers)."""
    import time

    import psutil

    module = load_benchmark("serve")
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path), "1" if with_core else "0"])
    try:
        ready = [tmp_path / "front.ready"] + ([tmp_path / "core.ready", tmp_path / "tracker.ready"] if with_core else [])
        deadline = time.monotonic() + 120
        while not all(path.exists() for path in ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        served = module.Served("http://127.0.0.1:1", launcher.pid)
        by_role = served.cpu_seconds_by_role()
        if with_core:
            assert set(by_role) == {"launcher", "engine core", "front ends"}
            # the core and the tracker burned 0.3 s of CPU each (psutil reads clock ticks: 0.25), the front end slept
            assert by_role["engine core"] >= 0.25 > by_role["front ends"]
            assert by_role["launcher"] >= 0.25
        else:
            assert set(by_role) == {"server"}
        assert served.cpu_seconds() == pytest.approx(sum(by_role.values()), abs=0.05)
    finally:
        for process in [*psutil.Process(launcher.pid).children(recursive=True), psutil.Process(launcher.pid)]:
            process.kill()
        launcher.wait(timeout=30)
