"""run_batch on a local Ray cluster (CPU, tiny checkpoint): the same greedy outputs as one local
engine, every row exactly once (also when a replica is killed mid-batch), and what cache-affine
placement buys: encoder runs and prefill tokens summed over replicas, with and without affinity."""

from __future__ import annotations

import contextlib
import io
import random
from pathlib import Path

import pytest

from mmengine import LoRARequest, MMEngine, SamplingParams
from mmengine.testing import make_test_image

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install mmengine-vlm[ray])")

from mmengine.ray import BatchRunner, run_batch  # noqa: E402
from mmengine.ray import batch as batch_module  # noqa: E402
from mmengine.ray.batch import BatchResult  # noqa: E402

ENGINE_OPTIONS = {"max_model_len": 256}
LORA_OPTIONS = {**ENGINE_OPTIONS, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
ONE_TOKEN_WORDS = "the and are at be car dog image in is of on read small there this to was with you".split()


@pytest.fixture(scope="module")
def ray_cluster(ray_cluster):
    ray.data.DataContext.get_current().enable_progress_bars = False


@pytest.fixture(scope="module")
def module_replicas(ray_cluster, checkpoint_dir):
    # Started once: an actor's start (torch, mmengine, the engine) costs far more than the rows it answers here. The
    # tests that need adapters and a store reconfigure these two (BatchRunner.reconfigure) instead of starting two more.
    with BatchRunner(checkpoint_dir(), num_replicas=2, engine_options=ENGINE_OPTIONS, num_cpus=0.5, batch_size=64) as runner:
        yield runner


def adapter_dirs(lora_adapters) -> dict[str, str]:
    return {name: str(path) for name, path in lora_adapters("llava").items() if name in ("qv4", "mlp2")}


STORE_OPTIONS = {**LORA_OPTIONS, "encoder_cache_host_bytes": 1 << 24}


@pytest.fixture
def store_and_adapter_replicas(module_replicas, lora_adapters):
    """The module's two replicas with fresh engines sharing an encoder store and holding two LoRA adapters: the
    store's test and the adapters' test (through run_batch) run on them, neither feature touching what the other's
    test reads (the store, of the same size and options, is kept from one to the other)."""
    assert all(module_replicas.alive), "a test killed a module replica before this one (the killing test runs last)"
    module_replicas.reconfigure(STORE_OPTIONS, adapter_dirs(lora_adapters), encoder_store_bytes=1 << 24)
    return module_replicas


@pytest.fixture
def two_replicas(module_replicas):
    """The module's two replicas with fresh engines (empty caches, zeroed counters) on ENGINE_OPTIONS, without
    adapters or store, rebuilt in their processes."""
    assert all(module_replicas.alive), "a test killed a module replica before this one (the killing test runs last)"
    module_replicas.reconfigure(ENGINE_OPTIONS)
    return module_replicas


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    make_test_image(seed).save(buffer, "PNG")
    return buffer.getvalue()


def words(rng: random.Random, n: int) -> str:
    return "".join(" " + rng.choice(ONE_TOKEN_WORDS) for _ in range(n))


def mixed_rows(tmp_path) -> list[dict]:
    """Images as bytes and as paths, text rows sharing a prefix, per-row sampling params, an extra column."""
    rng = random.Random(0)
    path = tmp_path / "picture.png"
    path.write_bytes(png(7))
    shared = words(rng, 40)
    rows = []
    for i in range(12):
        if i % 3 == 0:
            prompt, images = f"USER: <image>\nWhat is in picture {i}? ASSISTANT:", [png(i % 2)]
        elif i % 3 == 1:
            prompt, images = "USER: <image>\nDescribe it. ASSISTANT:", [str(path)]
        else:
            prompt, images = shared + words(rng, 6), []
        params = {"max_tokens": 3 + i % 3, "temperature": 0.0, "ignore_eos": True}
        rows.append({"prompt": prompt, "images": images, "sampling_params": params, "item_id": 1000 + i})
    return rows


def local_outputs(model, rows):
    engine = MMEngine(str(model), **ENGINE_OPTIONS)
    return engine.generate(
        [r["prompt"] for r in rows],
        images=[r["images"] or None for r in rows],
        sampling_params=[SamplingParams(**r["sampling_params"]) for r in rows],
        use_tqdm=False,
    )


def by_item(dataset) -> dict[int, dict]:
    out = dataset.take_all()
    ids = [r["item_id"] for r in out]
    assert len(ids) == len(set(ids)), "a row came back twice"
    return {r["item_id"]: r for r in out}


def test_two_replicas_match_one_local_engine_row_for_row(two_replicas, checkpoint_dir, tmp_path):
    rows = mixed_rows(tmp_path)
    result = two_replicas.run(ray.data.from_items(rows))  # (run_batch: the LoRA test)
    got = by_item(result.dataset)
    assert sorted(got) == [r["item_id"] for r in rows]  # every row exactly once, extra column kept
    assert result.dataset.num_blocks() == 1  # the 12 rows in blocks of a sub-batch (64 rows), not a block a row
    for row, expected in zip(rows, local_outputs(checkpoint_dir(), rows)):
        out = got[row["item_id"]]
        assert out["prompt"] == row["prompt"]
        assert list(out["token_ids"]) == expected.token_ids
        assert out["text"] == expected.text
        assert out["finish_reason"] == expected.finish_reason == "length"
    assert {r["replica"] for r in got.values()} == {0, 1}
    assert len(result.replica_stats) == 2
    assert sum(s["requests_finished"] for s in result.replica_stats) == len(rows)


def test_image_affinity_encodes_each_picture_once_across_replicas(two_replicas):
    """8 images x 16 requests each over 2 replicas; also streamed in windows of 32 rows, each window
    showing every picture (a key keeps its replica from window to window)."""
    images = [png(seed) for seed in range(8)]
    rows = [
        {"prompt": f"USER: <image>\nQuestion {q}? ASSISTANT:", "images": [image],
         "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
        for image in images for q in range(16)
    ]
    interleaved = [rows[image * 16 + q] for q in range(16) for image in range(8)]
    runs = {}
    for name, batch, affinity, window in (
        ("affinity", rows, "prefix+image", None),
        ("round-robin", rows, None, None),
        ("affinity, windows of 32", interleaved, "prefix+image", 32),
    ):
        two_replicas.reset()
        result = two_replicas.run(ray.data.from_items(batch), affinity=affinity, window_rows=window)
        assert [r["prompt"] for r in result.dataset.take_all()] == [r["prompt"] for r in batch]  # input order
        runs[name] = sum(s["encoder_runs"] for s in result.replica_stats)
    print(f"encoder runs, 8 images x 16 requests on 2 replicas: {runs}")
    assert runs["affinity"] == 8
    assert runs["round-robin"] == 16  # round-robin shows every picture to every replica
    assert runs["affinity, windows of 32"] == 8


def test_prefix_affinity_prefills_each_shared_prefix_once(two_replicas):
    """8 groups x 8 prompts: 64 shared tokens (BOS included) + 16 unique, shuffled."""
    rng = random.Random(0)
    prompts = []
    for _ in range(8):
        shared = words(rng, 63)
        prompts += [shared + words(rng, 16) for _ in range(8)]
    rng.shuffle(prompts)
    rows = [{"prompt": p, "sampling_params": {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}} for p in prompts]
    minimum = 8 * 64 + 64 * 16
    computed = {}
    for affinity in ("prefix+image", None):
        two_replicas.reset()
        result = two_replicas.run(ray.data.from_items(rows), affinity=affinity)
        computed[affinity] = sum(s["prefill_tokens_computed"] for s in result.replica_stats)
        assert sum(s["prompt_tokens"] for s in result.replica_stats) == 64 * 80
    print(f"prefill tokens over 2 replicas (minimum {minimum}): affinity {computed['prefix+image']}, round-robin {computed[None]}")
    assert computed["prefix+image"] == minimum
    assert computed[None] == 2 * 8 * 64 + 64 * 16  # round-robin: each replica prefills every group's prefix


def test_map_batches_processor_answers_ray_data_batches_like_one_engine(ray_cluster, checkpoint_dir, tmp_path):
    """The processor on real Ray Data numpy batches (Arrow-converted lists, structs with None-filled
    fields), called in-process: the same outputs as one engine, input columns kept."""
    from mmengine.ray import MMEngineProcessor

    rows = mixed_rows(tmp_path)
    for row in rows:  # one Arrow type per column across batches: the pictures as bytes, not paths
        row["images"] = [Path(i).read_bytes() if isinstance(i, str) else i for i in row["images"]]
    rows[2]["sampling_params"] = {**rows[2]["sampling_params"], "stop": ["zzz"]}  # other rows' stop: None
    processor = MMEngineProcessor(str(checkpoint_dir()), ENGINE_OPTIONS)
    answered = []
    for batch in ray.data.from_items(rows).iter_batches(batch_size=5, batch_format="numpy"):
        out = processor(batch)
        answered += [{name: out[name][i] for name in out} for i in range(len(out["prompt"]))]
    expected = local_outputs(checkpoint_dir(), rows)
    assert [int(a["item_id"]) for a in answered] == [r["item_id"] for r in rows]
    assert [list(a["token_ids"]) for a in answered] == [e.token_ids for e in expected]
    assert [a["text"] for a in answered] == [e.text for e in expected]


def test_benchmark_reports_both_placements(two_replicas, checkpoint_dir, tmp_path, monkeypatch):
    import json

    from helpers import load_benchmark

    module = load_benchmark("ray_batch")

    def the_module_replicas(model, count, engine_options, num_gpus, num_cpus, batch_size):
        # what the script would start is what the module started: its warm-up, modes, resets and report run on them
        assert (str(model), count, engine_options, num_gpus, num_cpus, batch_size) == (
            two_replicas.model, 2, two_replicas.engine_options, 0, 0.5, two_replicas.batch_size)
        return contextlib.nullcontext(two_replicas)

    monkeypatch.setattr(module, "BatchRunner", the_module_replicas)
    output = tmp_path / "ray_batch.json"
    report = module.main([
        "--model", str(checkpoint_dir()), "--replicas", "2", "--images", "4", "--per-image", "4", "--groups", "1",
        "--degree", "4", "--shared-len", "32", "--unique-len", "8", "--output-len", "2", "--repeats", "1",
        "--num-cpus", "0.5", "--max-model-len", "256", "--output", str(output),
    ])
    assert json.loads(output.read_text()) == json.loads(json.dumps(report, default=str))
    by_placement = {r["affinity"]: r for r in report["results"]}
    assert by_placement["prefix+image"]["encoder_runs_per_image"] == 1.0
    assert by_placement["round-robin"]["encoder_runs_per_image"] > 1.0
    assert all(r["requests_per_s"] > 0 and sum(r["rows_per_replica"]) == 20 for r in report["results"])
    # what the GPU suite's "ray" part reads from this script (its dry run leaves the part to this test)
    reads = load_benchmark("gpu_suite")._ray_reads(report)
    assert reads and all(value is not None for _, value, _, _ in reads)


def test_rows_under_lora_adapters_match_one_engine_and_stay_with_their_adapter(store_and_adapter_replicas, checkpoint_dir,
                                                                              lora_adapters, monkeypatch):
    """A `lora` column: each row runs under its adapter (or the base model) as one local engine runs it,
    and the adapter is part of the placement key, so one adapter's rows about one picture share a replica."""
    replicas, adapters = store_and_adapter_replicas, adapter_dirs(lora_adapters)
    lora_of = [None, "qv4", "mlp2"]
    rows = [{"prompt": f"USER: <image>\nQuestion {i}? ASSISTANT:", "images": [png(5)], "lora": lora_of[i % 3],
             "sampling_params": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}, "item_id": i} for i in range(9)]
    options = STORE_OPTIONS

    def the_module_replicas(model, count, engine_options, num_gpus, num_cpus, batch_size, lora_modules, encoder_store_bytes):
        # what run_batch would start is what the module started: it runs the rows on them
        assert (str(model), count, engine_options, num_gpus, num_cpus, batch_size, lora_modules, encoder_store_bytes) == (
            replicas.model, 2, replicas.engine_options, 0, 0.5, replicas.batch_size, adapters, 1 << 24)
        return contextlib.nullcontext(replicas)

    monkeypatch.setattr(batch_module, "BatchRunner", the_module_replicas)
    result = run_batch(ray.data.from_items(rows), model=checkpoint_dir(), num_replicas=2, engine_options=options,
                       num_cpus=0.5, lora_modules=adapters, encoder_store_bytes=1 << 24)
    got = by_item(result.dataset)
    local = MMEngine(str(checkpoint_dir()), **LORA_OPTIONS)
    for name, path in adapters.items():
        local.add_lora(LoRARequest(name, path))
    expected = local.generate([r["prompt"] for r in rows], images=[r["images"] for r in rows],
                              sampling_params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                              lora=[r["lora"] for r in rows], use_tqdm=False)
    assert [list(got[i]["token_ids"]) for i in range(9)] == [e.token_ids for e in expected]
    assert len({tuple(e.token_ids) for e in expected[:3]}) == 3  # the adapters change the answers
    for name in lora_of:
        assert len({got[i]["replica"] for i in range(9) if rows[i]["lora"] == name}) == 1


def store_rows() -> tuple[list[dict], list[dict]]:
    """Six pictures, then the same pictures with other questions shifted by one row, so that round robin
    (affinity off) sends each picture to the replica that did not see it."""
    pictures = [png(40 + i) for i in range(6)]
    first = [{"prompt": f"USER: <image>\nWhat is picture {i}? ASSISTANT:", "images": [pictures[i]],
              "sampling_params": {"max_tokens": 2, "temperature": 0.0}} for i in range(6)]
    second = [{"prompt": f"USER: Again: <image>\nDescribe picture {i}. ASSISTANT:", "images": [pictures[i]],
               "sampling_params": {"max_tokens": 2, "temperature": 0.0}} for i in [5, 0, 1, 2, 3, 4]]
    return first, second


def assert_answers_are_local(result: BatchResult, second: list[dict], model: Path) -> None:
    answers = sorted((row["prompt"], row["text"]) for row in result.dataset.take_all())
    expected = local_outputs(model, second)
    assert answers == sorted((row["prompt"], out.text) for row, out in zip(second, expected))


def test_the_encoder_store_encodes_each_picture_once_cluster_wide(store_and_adapter_replicas, checkpoint_dir):
    """With the store the second replica fetches what the first encoded."""
    first, second = store_rows()
    runner = store_and_adapter_replicas
    runner.reset()  # fresh engines and counts (the store keeps what the adapters' test published: other pictures)
    published = runner.store_stats()["published"]
    runner.run(ray.data.from_items(first), affinity=None)
    assert runner.store_stats()["published"] == published + 6  # run() returns once its outputs are in the store
    result = runner.run(ray.data.from_items(second), affinity=None)
    stats = [s for s in result.replica_stats if s is not None]
    assert_answers_are_local(result, second, checkpoint_dir())
    assert sum(s["encoder_runs"] for s in stats) == 6 and sum(s["encoder_store_fetches"] for s in stats) == 6
    assert sum(s["encoder_host_hits"] for s in stats) == 6


def test_reconfigured_replicas_keep_their_processes_and_hold_one_engine_each(module_replicas, lora_adapters):
    """reconfigure builds each replica's next engine in the process it runs in, and the engine it replaces (held by its
    store client's publishing thread until that thread stops) is freed: one engine, and a store thread only with a store.
    A replica Ray restarts (with its constructor's arguments) takes the runner's options with its next rows."""

    def replica_processes(runner: BatchRunner) -> list[tuple[int, int, int]]:
        """Each replica's (pid, engines alive, store publishing threads), read in its process."""

        def probe(_) -> tuple[int, int, int]:
            import gc
            import os
            import threading

            from mmengine.engine.mm_engine import MMEngine

            gc.collect()
            engines = sum(isinstance(o, MMEngine) for o in gc.get_objects())
            return os.getpid(), engines, sum(t.name == "mmengine-encoder-store" for t in threading.enumerate())

        return ray.get([replica.__ray_call__.remote(probe) for replica in runner.replicas])

    runner = module_replicas
    pids = ray.get([replica.__ray_call__.remote(lambda _: __import__("os").getpid()) for replica in runner.replicas])
    runner.reconfigure(STORE_OPTIONS, adapter_dirs(lora_adapters), encoder_store_bytes=1 << 24)
    store = runner.encoder_store
    runner.reconfigure(STORE_OPTIONS, adapter_dirs(lora_adapters), encoder_store_bytes=1 << 24)
    assert runner.encoder_store is store  # the same size and options: the store and what it holds are kept
    assert replica_processes(runner) == [(pid, 1, 1) for pid in pids]

    def restart_with_the_constructors_arguments(replica) -> None:  # what Ray runs when it restarts a crashed replica
        replica.store_client.close()
        replica.engine.shutdown()
        type(replica).__init__(replica, runner.model, ENGINE_OPTIONS, 0, 1)

    ray.get(runner.replicas[0].__ray_call__.remote(restart_with_the_constructors_arguments))
    row = {"prompt": "USER: <image>\nWhat is it? ASSISTANT:", "images": [png(3)], "lora": "qv4",
           "sampling_params": {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True}}
    answers = runner.run(ray.data.from_items([row, row]), affinity=None).dataset.take_all()
    assert sorted(a["replica"] for a in answers) == [0, 1]  # the restarted one took the adapters before answering
    assert list(answers[0]["token_ids"]) == list(answers[1]["token_ids"])
    runner.reconfigure(ENGINE_OPTIONS)
    assert replica_processes(runner) == [(pid, 1, 0) for pid in pids]
    assert runner.encoder_store is None and runner.store_stats() is None


def test_without_the_store_each_replica_encodes_each_picture(two_replicas, checkpoint_dir):
    """The store test's rows on replicas without a store: each picture is encoded once on each."""
    first, second = store_rows()
    two_replicas.run(ray.data.from_items(first), affinity=None)
    result = two_replicas.run(ray.data.from_items(second), affinity=None)
    assert_answers_are_local(result, second, checkpoint_dir())
    assert sum(s["encoder_runs"] for s in result.replica_stats) == 12


# Last in the file: it kills one of the module's replicas (no test after it can use them), instead of starting two more.
def test_killing_a_replica_mid_batch_still_answers_every_row_once(two_replicas, checkpoint_dir, tmp_path):
    rows = mixed_rows(tmp_path) * 2
    rows = [{**r, "item_id": i} for i, r in enumerate(rows)]
    killed = []

    def kill_replica_0_after_its_first_sub_batch(runner, replica, done):
        if replica == 0 and not killed:
            ray.kill(runner.replicas[0], no_restart=True)
            killed.append(done)

    runner = two_replicas
    runner.batch_size = 2  # sub-batches of two rows: replica 0 dies with some of its rows still queued
    result = runner.run(ray.data.from_items(rows), progress=kill_replica_0_after_its_first_sub_batch)
    assert killed, "replica 0 never finished a sub-batch"
    got = by_item(result.dataset)
    assert sorted(got) == list(range(len(rows)))
    assert result.num_retried_rows > 0
    assert result.replica_stats[0] is None  # dead
    on_zero = [i for i in range(len(rows)) if got[i]["replica"] == 0]
    # the rows it finished before it died: at least those the hook saw, maybe a sub-batch more whose
    # answer was already stored when the kill landed (all sub-batches are queued on the actor at once)
    assert killed[0] <= len(on_zero) < len(rows)
    expected = local_outputs(checkpoint_dir(), rows)
    assert [list(got[i]["token_ids"]) for i in range(len(rows))] == [e.token_ids for e in expected]
