"""The tensor-parallel executor (mmengine/distributed/executor.py) with two gloo ranks in spawned processes:
a step round-trips (one plan to every rank, one reply from rank 0), a worker's exception comes back typed with
its traceback, a worker killed mid-call becomes EngineDeadError within seconds for that call and every later
one, shutdown leaves no process behind, and workers do not outlive a driver that is killed."""

from __future__ import annotations

import json
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from executor_ranks import TP, RankWorker, refuse_to_start, start
from helpers import alive
from mmengine.distributed.executor import MultiprocExecutor, WorkerError
from mmengine.distributed.process_group import DistributedInit, file_address, free_tcp_address
from mmengine.errors import ConfigError, EngineDeadError

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def worker_children() -> list[psutil.Process]:
    """This process's children but multiprocessing's resource tracker (one per process, for its lifetime)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_step_round_trips_and_a_worker_error_comes_back_typed_then_shutdown_leaves_nothing():
    before = {p.pid for p in worker_children()}
    deaths: list[EngineDeadError] = []
    executor = start(on_death=deaths.append)
    pids = executor.call("pid")
    assert pids == executor.pids and len(set(pids)) == TP
    # a rank imports the worker loop and its worker's module: neither transformers nor a model nor the test's pytest
    assert executor.call("imported", ["transformers", "mmengine.models", "mmengine.runner", "pytest"]) == [[]] * TP
    for step in range(3):
        reply = executor.execute({"id": step, "payload": b"x" * 4096})
        assert reply == {"echo": step, "plan_bytes": 4096, "rank_sum": 3.0, "steps": step + 1}  # 1 + 2: both ranks
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        executor.execute({"id": threading.Lock(), "payload": b""})  # refused before anything is sent
    assert executor.execute({"id": 3, "payload": b""})["steps"] == 4

    with pytest.raises(WorkerError) as caught:
        executor.call("fail_on", 1)
    err = caught.value
    assert isinstance(err, EngineDeadError) and err.rank == 1 and err.error_type == "KeyError"
    assert "in fail_on" in err.traceback_text and "no such block on rank 1" in str(err)
    assert deaths == [err]  # reported once, to the engine's callback
    with pytest.raises(EngineDeadError, match="rank 1 raised KeyError"):
        executor.execute({"id": 9, "payload": b""})
    assert wait_gone(pids, 10) == []
    executor.shutdown()
    executor.shutdown()  # idempotent
    assert {p.pid for p in worker_children()} - before == set()


def test_shutdown_and_the_with_block_stop_every_worker():
    deaths: list[EngineDeadError] = []
    with start(on_death=deaths.append) as executor:
        pids = list(executor.pids)
        assert executor.execute({"id": 1, "payload": b""})["rank_sum"] == 3.0
    assert wait_gone(pids, 10) == []
    assert deaths == []  # a shutdown is no failure
    with pytest.raises(EngineDeadError, match="shut down"):
        executor.execute({"id": 2, "payload": b""})


def test_a_shutdown_from_another_thread_ends_the_call_in_flight():
    deaths: list[EngineDeadError] = []
    executor = start(on_death=deaths.append)
    pids = list(executor.pids)
    outcome: list[BaseException] = []

    def busy() -> None:
        try:
            executor.call("sleep_then_reduce", 0, 60.0)
        except BaseException as err:  # noqa: BLE001 - the outcome is asserted below
            outcome.append(err)

    caller = threading.Thread(target=busy)
    caller.start()
    time.sleep(0.5)
    started = time.monotonic()
    executor.shutdown()
    caller.join(20)
    assert not caller.is_alive() and time.monotonic() - started < 20
    assert len(outcome) == 1 and isinstance(outcome[0], EngineDeadError) and "shut down" in str(outcome[0])
    assert wait_gone(pids, 10) == [] and deaths == []


def test_a_worker_killed_mid_call_is_engine_dead_within_seconds_for_that_call_and_every_later_one():
    deaths: list[EngineDeadError] = []
    executor = start(on_death=deaths.append)
    pids = list(executor.pids)
    # rank 1 sleeps while rank 0 waits for it in a collective: killing rank 1 makes gloo fail rank 0 too,
    # and the error must name the death (rank 1), not rank 0's "Connection closed by peer"
    killer = threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL))
    started = time.monotonic()
    killer.start()
    try:
        with pytest.raises(EngineDeadError, match=r"rank 1 \(pid \d+\) died \(killed by SIGKILL\)") as caught:
            executor.call("sleep_then_reduce", 1, 60.0)
    finally:
        killer.join()
    assert time.monotonic() - started < 20  # noticed at once; a hang would take the 60 s sleep
    assert not isinstance(caught.value, WorkerError)
    assert len(deaths) == 1 and "rank 1" in str(deaths[0])
    for _ in range(2):
        with pytest.raises(EngineDeadError, match="rank 1 .* died"):
            executor.execute({"id": 1, "payload": b""})
    assert wait_gone(pids, 10) == []
    executor.shutdown()


def test_a_failed_collective_is_reported_as_the_peer_death_that_caused_it():
    executor = start(death_grace_s=10.0)  # the grace that a loaded machine's 0.5 s sleep fits in with room
    with pytest.raises(EngineDeadError) as caught:
        executor.call("peer_gone", 1, 0.5)  # rank 0's error arrives half a second before rank 1 exits
    assert not isinstance(caught.value, WorkerError)
    assert re.search(r"rank 1 \(pid \d+\) died \(exit code 3\)", str(caught.value))
    assert wait_gone(executor.pids, 10) == []
    executor.shutdown()


def test_a_worker_that_dies_between_steps_is_noticed_without_a_call():
    deaths: list[EngineDeadError] = []
    noticed = threading.Event()
    executor = start(on_death=lambda err: (deaths.append(err), noticed.set()))
    pids = list(executor.pids)
    assert executor.execute({"id": 1, "payload": b""})["echo"] == 1
    os.kill(pids[0], signal.SIGKILL)
    assert noticed.wait(20), "the watcher did not notice the death"
    assert len(deaths) == 1 and re.search(r"rank 0 \(pid \d+\) died \(killed by SIGKILL\)", str(deaths[0]))
    assert wait_gone(pids, 10) == []  # the survivor was released
    with pytest.raises(EngineDeadError, match="rank 0 .* died"):
        executor.execute({"id": 2, "payload": b""})
    executor.shutdown()


def test_a_worker_that_cannot_start_raises_its_own_error_and_leaves_nothing():
    before = {p.pid for p in worker_children()}
    with pytest.raises(ConfigError, match="num_key_value_heads=3") as caught:
        MultiprocExecutor(refuse_to_start, TP, torch_threads=1)
    assert isinstance(caught.value.__cause__, WorkerError) and "refuse_to_start" in caught.value.__cause__.traceback_text
    assert wait_gone([p.pid for p in worker_children() if p.pid not in before], 10) == []


def test_the_rendezvous_is_plain_data_checked_by_name(tmp_path):
    init = DistributedInit(2, 1, free_tcp_address())
    assert init.resolved_backend == "gloo" and init.torch_device() == torch.device("cpu")
    cuda = DistributedInit(4, 3, file_address(tmp_path / "store"), device="cuda", local_rank=1)
    assert cuda.resolved_backend == "nccl" and cuda.torch_device() == torch.device("cuda", 1)
    assert cuda.init_method == f"file://{tmp_path.resolve()}/store"
    for bad, words in [({"rank": 2}, "rank must be in"), ({"init_method": "env://"}, "init_method"),
                       ({"backend": "mpi"}, "backend"), ({"device": "tpu"}, "device")]:
        with pytest.raises(ConfigError, match=words):
            DistributedInit(**{"world_size": 2, "rank": 0, "init_method": "tcp://127.0.0.1:1", **bad})
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive int"):
        MultiprocExecutor(RankWorker, 0)


DRIVER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from executor_ranks import start
    if __name__ == "__main__":
        executor = start()
        print(json.dumps(executor.pids), flush=True)
        executor.call("sleep_then_reduce", 0, 600.0)  # the driver is killed while both ranks are busy
""")


def test_workers_exit_when_the_driver_is_killed(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(tests=str(HERE)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([driver.stdout], [], [], 180)  # never a hang, even if the driver cannot start
        assert ready, "the driver did not start its workers"
        pids = json.loads(driver.stdout.readline())
        assert len(pids) == TP and all(alive(pid) for pid in pids)
        time.sleep(0.5)  # both ranks inside the call: rank 0 sleeping, rank 1 waiting in a collective
        driver.kill()
        driver.wait(timeout=10)
        assert wait_gone(pids, 15) == []
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
