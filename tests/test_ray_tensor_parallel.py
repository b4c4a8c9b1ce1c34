"""Tensor parallelism on Ray (`distributed_executor_backend="ray"`, distributed/ray_executor.py) on the tests' local
Ray cluster (conftest's `ray_cluster`): at TP 2 on CPU (gloo, fp32) two Ray actors placed by a placement group give
TP 1's greedy tokens and logprobs (within 1e-4) with pictures, chunked prefill and async scheduling, and a repeat
is a prefix hit; a rank whose process is killed mid-generate is EngineDeadError naming it, for that call and every
later one; shutdown leaves no actor, placement group or process. With a trivial worker (no model): steps sent
ahead come back in order, a worker's exception comes back typed, and a rank removed by `ray.kill` between steps is
noticed without a call. Without Ray the option is a ConfigError naming it.

One TP 2 engine serves the module (starting one costs two actors importing torch and transformers); the last test
kills one of its ranks."""

from __future__ import annotations

import os
import signal
import sys
import threading

import psutil
import pytest

import executor_ranks
from executor_ranks import RankWorker
from helpers import wait_until
from mmengine import MMEngine, SamplingParams
from mmengine.distributed.ray_placement import RankDevices, RankPlace, rank_devices
from mmengine.errors import ConfigError, EngineDeadError
from mmengine.testing import TinyLlavaSpec, make_test_image

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install mmengine-vlm[ray])")

from mmengine.distributed.executor_base import WorkerError  # noqa: E402
from mmengine.distributed.ray_executor import RayExecutor  # noqa: E402

# A step takes at most 16 tokens: a picture's 16 placeholders fit, the prompts' prefills take two or three chunks
ENGINE_OPTIONS = {"max_model_len": 128, "max_num_batched_tokens": 16, "num_kv_blocks": 16, "max_num_seqs": 4}
PROMPTS = [
    "USER: <image>\nWhat is shown here? ASSISTANT:",
    "USER: <image>\nDescribe the colours of this picture in detail. ASSISTANT:",
    "USER: Tell me a story about a cat. ASSISTANT:",
]
IMAGES = [[make_test_image(1)], [make_test_image(2)], []]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=2)
RANK_ACTOR = "RankActor"  # Ray titles an actor's process after its class: ray::RankActor


def rank_processes() -> set[int]:
    """Live processes of rank actors under this one (Ray's workers are its raylet's children)."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and RANK_ACTOR in " ".join(child.cmdline()):
                found.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def live_actors() -> set[str]:
    return {actor_id for actor_id, actor in ray._private.state.actors().items()
            if actor["State"] != "DEAD" and actor["ActorClassName"].endswith(RANK_ACTOR)}


def live_placement_groups() -> set[str]:
    return {group_id for group_id, group in ray.util.placement_group_table().items() if group["state"] != "REMOVED"}


def left_behind(executor: RayExecutor) -> tuple[set[str], set[str], set[int]]:
    """The executor's actors still alive, its placement group if not removed, its ranks' processes still running."""
    actors = {place.actor_id for place in executor.ranks.places}
    return (live_actors() & actors, live_placement_groups() & {executor.ranks.placement_group.id.hex()},
            rank_processes() & set(executor.pids))


@pytest.fixture(scope="module")
def ray_cluster(ray_cluster):
    ray.cloudpickle.register_pickle_by_value(executor_ranks)  # RankWorker reaches the actors by value
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(executor_ranks)


@pytest.fixture(scope="module")
def llava(checkpoint_dir):
    return checkpoint_dir(TinyLlavaSpec(num_key_value_heads=1))  # test_tensor_parallel's: built once


@pytest.fixture(scope="module")
def tp1(llava):
    return MMEngine(str(llava), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def ray_tp2(ray_cluster, llava):
    # async scheduling: the driver sends step N+1 before it reads step N's reply
    engine = MMEngine(str(llava), tensor_parallel_size=2, distributed_executor_backend="ray", async_scheduling="on",
                      **ENGINE_OPTIONS)
    yield engine
    engine.shutdown()


def test_tp2_on_ray_gives_tp1_tokens_and_logprobs_with_pictures_chunks_and_async_scheduling(tp1, ray_tp2):
    executor = ray_tp2.parallel.executor
    assert isinstance(executor, RayExecutor)
    group = ray.util.placement_group_table(executor.ranks.placement_group)
    assert group["strategy"] == "PACK" and list(group["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert set(executor.pids) <= rank_processes() and len(set(executor.pids)) == 2
    sent = ray_tp2.parallel.num_submitted
    ones = tp1.generate(PROMPTS, images=IMAGES, sampling_params=GREEDY, use_tqdm=False)
    twos = ray_tp2.generate(PROMPTS, images=IMAGES, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in twos] == [o.token_ids for o in ones]
    for one, two in zip(ones, twos):
        for a, b in zip(one.logprobs, two.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-4
    assert ray_tp2.parallel.num_submitted - sent > len(PROMPTS)  # chunks: several steps a prompt
    assert ray_tp2.steps.async_scheduling and ray_tp2.parallel.max_in_flight == 2  # a step sent while the one before ran
    stats = ray_tp2.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["encoder_cache_referenced"] == 0


def test_a_repeat_on_ray_computes_at_most_one_block_and_encodes_nothing_with_plans_in_the_object_store(ray_tp2, monkeypatch):
    from mmengine.distributed import ray_executor
    from mmengine.runner import parallel_runner, shared_pixels

    monkeypatch.setattr(ray_executor, "INLINE_BYTES", 0)  # every plan put once into the object store, as a large one is
    monkeypatch.setattr(shared_pixels, "MIN_SHARED_BYTES", 0)  # the process backend would share even these pictures
    put, puts = ray.put, []
    monkeypatch.setattr(ray, "put", lambda value, **kw: (puts.append(len(value)), put(value, **kw))[1])
    segments: list[object] = []
    monkeypatch.setattr(parallel_runner, "PlanSegment", lambda items: segments.append(items) or shared_pixels.PlanSegment(items))
    prompt, images = PROMPTS[1], [make_test_image(7)]
    sent = ray_tp2.parallel.num_submitted
    first = ray_tp2.generate(prompt, images=images, sampling_params=GREEDY, use_tqdm=False)[0]
    assert len(puts) == ray_tp2.parallel.num_submitted - sent  # one put a step, read by both ranks
    assert not segments  # the picture rode in the plan: shared memory would not reach ranks on other machines
    before = ray_tp2.stats()
    again = ray_tp2.generate(prompt, images=images, sampling_params=GREEDY, use_tqdm=False)[0]
    after = ray_tp2.stats()
    assert again.token_ids == first.token_ids
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] <= 16
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 16
    assert after["encoder_runs"] == before["encoder_runs"]


def test_without_ray_the_backend_is_a_config_error_naming_the_option(llava, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as it does without the extra
    with pytest.raises(ConfigError, match=r"distributed_executor_backend='ray' needs Ray, which is not installed"):
        MMEngine(str(llava), tensor_parallel_size=2, distributed_executor_backend="ray", max_model_len=128)


def test_cuda_ranks_ask_the_cluster_for_gpu_bundles_and_a_cluster_without_them_is_a_config_error(ray_cluster, llava):
    """The driver needs no GPU of its own (a data-parallel replica holds none): the GPUs are the cluster's to give."""
    groups = live_placement_groups()
    with pytest.raises(ConfigError, match=r"2 ranks need 2 GPU in all \(one bundle of \{'GPU': 1.0, 'CPU': 1.0\} each\), "
                                          r"and the Ray cluster has 0"):
        MMEngine(str(llava), tensor_parallel_size=2, distributed_executor_backend="ray", device="cuda", enforce_eager=True,
                 max_model_len=128)
    assert live_placement_groups() == groups and ray.is_initialized()  # nothing placed; the module's Ray still there


def test_ranks_on_a_machine_see_its_ranks_gpus_and_take_their_own():
    places = [RankPlace("a0", "n1", "10.0.0.1", ("3",), 11), RankPlace("a1", "n1", "10.0.0.1", ("1",), 12),
              RankPlace("a2", "n2", "10.0.0.2", ("0",), 13), RankPlace("a3", "n2", "10.0.0.2", ("5",), 14)]
    assert rank_devices(places) == [RankDevices("3,1", 0), RankDevices("3,1", 1), RankDevices("0,5", 0), RankDevices("0,5", 1)]
    cpus = [RankPlace("a0", "n1", "10.0.0.1", (), 11), RankPlace("a1", "n2", "10.0.0.2", (), 12),
            RankPlace("a2", "n1", "10.0.0.1", (), 13)]
    assert rank_devices(cpus) == [RankDevices(None, 0), RankDevices(None, 0), RankDevices(None, 1)]


def test_executor_reads_steps_sent_ahead_in_order_and_notices_a_rank_removed_by_ray_kill_between_steps(ray_cluster):
    deaths: list[EngineDeadError] = []
    noticed = threading.Event()
    executor = RayExecutor(RankWorker, 2, torch_threads=1, on_death=lambda err: (deaths.append(err), noticed.set()))
    assert executor.call("pid") == executor.pids
    for step in range(4):  # sent ahead, read in order
        executor.submit({"id": step, "payload": b""})
    assert [executor.collect() for _ in range(4)] == [{"echo": s, "plan_bytes": 0, "rank_sum": 3.0, "steps": s + 1}
                                                      for s in range(4)]
    with pytest.raises(RuntimeError, match="collect"):
        executor.collect()

    ray.kill(executor.ranks.actors[1])
    assert noticed.wait(30), "the watcher did not notice the death"
    assert len(deaths) == 1 and "rank 1" in str(deaths[0]) and "ray.kill" in str(deaths[0])
    with pytest.raises(EngineDeadError, match="rank 1 .* died"):
        executor.execute({"id": 9, "payload": b""})
    executor.shutdown()
    assert wait_until(lambda: left_behind(executor) == (set(), set(), set())), left_behind(executor)


def test_a_worker_error_on_ray_comes_back_typed_with_its_traceback(ray_cluster):
    with RayExecutor(RankWorker, 2, torch_threads=1) as executor:
        with pytest.raises(WorkerError) as caught:
            executor.call("fail_on", 1)
        err = caught.value
        assert err.rank == 1 and err.error_type == "KeyError" and "in fail_on" in err.traceback_text
        with pytest.raises(EngineDeadError, match="rank 1 raised KeyError"):
            executor.execute({"id": 1, "payload": b""})
    assert wait_until(lambda: left_behind(executor) == (set(), set(), set())), left_behind(executor)


def test_a_killed_rank_is_engine_dead_for_the_call_in_flight_and_later_ones_and_shutdown_leaves_nothing(ray_tp2):
    """(Last: it kills the module's engine.)"""
    pids = ray_tp2.parallel.executor.pids
    failure: list[BaseException] = []

    def generate() -> None:
        try:
            ray_tp2.generate(PROMPTS[2], sampling_params=SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.0),
                             use_tqdm=False)
        except BaseException as err:  # noqa: BLE001 - the test reads it
            failure.append(err)

    thread = threading.Thread(target=generate)
    started = ray_tp2.stats()["generation_tokens"]
    thread.start()
    assert wait_until(lambda: ray_tp2.stats()["generation_tokens"] > started or not thread.is_alive(), 60)  # decoding
    os.kill(pids[1], signal.SIGKILL)
    thread.join(timeout=30)  # a hang would never end: the survivor waits in a collective
    assert not thread.is_alive()
    assert failure and isinstance(failure[0], EngineDeadError) and "rank 1" in str(failure[0]), failure
    assert f"pid {pids[1]}" in str(failure[0]) and "died" in str(failure[0])
    with pytest.raises(EngineDeadError, match="rank 1"):
        ray_tp2.generate(PROMPTS[2], sampling_params=GREEDY, use_tqdm=False)
    ray_tp2.shutdown()
    executor = ray_tp2.parallel.executor
    assert wait_until(lambda: left_behind(executor) == (set(), set(), set())), left_behind(executor)
    assert not live_actors() and not live_placement_groups() and not rank_processes()  # none of any engine
