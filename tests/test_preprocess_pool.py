"""Pictures prepared in worker processes (mm_processor_workers, multimodal/preprocess_pool.py): the same
items and tokens as the engine's own threads, bad pictures' typed errors naming the prompt, a killed
worker's picture failed by name while the engine serves on, shared memory back to its idle size after a
soak, and no worker left behind."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import os
import pickle
import signal
import threading
import time
import types
from multiprocessing import Pipe

import psutil
import pytest
import torch
from transformers import PretrainedConfig

from books import assert_books_consistent
from helpers import shared_memory_held, shm_files_made_by, wait_until
from mmengine import MMEngine, SamplingParams
from mmengine.config import EngineConfig
from mmengine.errors import (ConfigError, CorruptImageError, ImageTooLargeError, PreprocessingWorkerError,
                             UnsupportedModelError)
from mmengine.multimodal.output_arena import copy_out
from mmengine.multimodal.picture_preparer import PreparerSpec
from mmengine.multimodal import preprocess_pool
from mmengine.multimodal.preprocess_pool import PreprocessPool
from mmengine.testing import make_test_image
from mmengine.testing.qwen_vl import qwen_vl_prompt

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
# a bound on waits for the workers (start-up: an interpreter importing torch and transformers), generous for a
# loaded 2-core machine: reaching it means the outcome never came
WORKER_WAIT_S = 180.0


def jpeg(seed: int, size: tuple[int, int] = (160, 120)) -> bytes:
    buffer = io.BytesIO()
    make_test_image(seed, size=size).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def workers_alive() -> list[psutil.Process]:
    """This process's children but multiprocessing's own resource tracker (one per process, for life)."""
    return [child for child in psutil.Process().children()
            if child.is_running() and "resource_tracker" not in " ".join(child.cmdline())]


@pytest.fixture(scope="module")
def path(family_checkpoint):
    return family_checkpoint("qwen2_5_vl")


@pytest.fixture(scope="module")
def in_process(path):
    return MMEngine(str(path), device="cpu", dtype="float32", max_model_len=512)


@pytest.fixture(scope="module")
def pooled(path):
    engine = MMEngine(str(path), device="cpu", dtype="float32", max_model_len=512, mm_processor_workers=2,
                      mm_processor_cache_bytes=0)
    yield engine
    engine.close()
    assert workers_alive() == []


def test_workers_give_the_items_and_tokens_of_the_engines_own_threads(pooled, in_process, tmp_path):
    pictures = [jpeg(seed) for seed in range(4)]
    path = tmp_path / "photo.jpg"
    path.write_bytes(jpeg(9))
    prompts = [qwen_vl_prompt(f"Question {i}: what is here?", 1) for i in range(5)]
    images = [[picture] for picture in pictures] + [[str(path)]]
    before = pooled.input_processor.pool.num_prepared
    got = pooled.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    want = in_process.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert [out.token_ids for out in got] == [out.token_ids for out in want]
    assert pooled.input_processor.pool.num_prepared - before == 5  # every picture prepared by a worker
    mine = pooled.input_processor.process(prompts[0], images[0], PARAMS).mm_items[0]
    theirs = in_process.input_processor.process(prompts[0], images[0], PARAMS).mm_items[0]
    assert mine.mm_hash == theirs.mm_hash
    for name, tensor in theirs.encoder_inputs.items():
        assert torch.equal(mine.encoder_inputs[name], tensor), name


def test_bad_pictures_are_their_typed_errors_naming_the_prompt(pooled):
    prompt = qwen_vl_prompt("What is here?", 1)
    with pytest.raises(CorruptImageError, match=r"^prompt 1: image 0: "):
        pooled.generate([prompt, prompt], images=[[jpeg(20)], [jpeg(21)[:200]]], sampling_params=PARAMS, use_tqdm=False)
    buffer = io.BytesIO()
    make_test_image(22, size=(8000, 8)).save(buffer, "PNG")  # 1000:1, beyond any processor's aspect limit
    with pytest.raises(ImageTooLargeError, match=r"^prompt 0: image 0: aspect ratio"):
        pooled.generate(prompt, images=[buffer.getvalue()], sampling_params=PARAMS, use_tqdm=False)
    assert len(pooled.generate(prompt, images=[jpeg(23)], sampling_params=PARAMS, use_tqdm=False)[0].token_ids) == 4


def test_a_killed_worker_fails_its_picture_by_name_and_the_engine_serves_on(pooled):
    pool = pooled.input_processor.pool
    prompt = qwen_vl_prompt("What is here?", 1)
    assert pool.wait_until_started(WORKER_WAIT_S)  # both workers up: SIGSTOP reaches them idle, not while they start
    old = pool.worker_pids()
    respawns = pool.num_respawns
    for pid in old:
        os.kill(pid, signal.SIGSTOP)  # neither can answer: the picture stays in flight
    failure: list[BaseException] = []

    def ask() -> None:
        try:
            pooled.generate(prompt, images=[jpeg(31)], sampling_params=PARAMS, use_tqdm=False)
        except BaseException as err:  # noqa: BLE001 - the outcome is asserted below
            failure.append(err)

    caller = threading.Thread(target=ask)
    caller.start()
    assert wait_until(lambda: pool.num_in_flight == 1, WORKER_WAIT_S)
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    caller.join(WORKER_WAIT_S)
    assert not caller.is_alive()
    (err,) = failure
    assert isinstance(err, PreprocessingWorkerError)
    assert str(err).startswith("prompt 0: image 0: the preprocessing worker died (exit code -9)")
    assert not pooled.has_unfinished_requests()
    assert wait_until(lambda: pool.num_respawns - respawns == 2, WORKER_WAIT_S)  # the idle one too, without waiting for a picture
    assert pool.wait_until_started(WORKER_WAIT_S) and set(pool.worker_pids()).isdisjoint(old)
    out = pooled.generate(prompt, images=[jpeg(32)], sampling_params=PARAMS, use_tqdm=False)[0]
    assert len(out.token_ids) == 4


def test_a_terminals_ctrl_c_leaves_the_workers_to_their_engine(pooled):
    """Ctrl-C in a terminal reaches the whole process group: the workers leave it to the engine's process, which
    stops the pool (before, each printed a KeyboardInterrupt traceback and died, failing the picture it held)."""
    pool = pooled.input_processor.pool
    assert pool.wait_until_started(WORKER_WAIT_S)
    pids, respawns = pool.worker_pids(), pool.num_respawns
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    out = pooled.generate(qwen_vl_prompt("What is here?", 1), images=[jpeg(33)], sampling_params=PARAMS, use_tqdm=False)
    assert len(out[0].token_ids) == 4
    assert pool.worker_pids() == pids and pool.num_respawns == respawns
    assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads what processes hold from /proc (Linux)")
def test_shared_memory_is_back_to_its_idle_size_after_a_soak(pooled):
    """300 new pictures through the workers (no processor cache: items die with their requests): the shared
    memory their tensors took is all given back, by the engine and its workers, and no file of theirs is left in
    /dev/shm. (Measured on these processes: /dev/shm's used space and listing are the whole machine's, which the
    other test worker's tensor-parallel ranks and Ray's object store change meanwhile.)"""
    pool = pooled.input_processor.pool
    prompt = qwen_vl_prompt("What?", 1)
    small = SamplingParams(max_tokens=1, temperature=0)
    pooled.generate(prompt, images=[jpeg(40)], sampling_params=small, use_tqdm=False)
    gc.collect()
    pids = {os.getpid(), *pool.worker_pids()}
    files, held = shm_files_made_by(pids), sum(shared_memory_held(pids).values())
    for start in range(0, 300, 50):
        pooled.generate([prompt] * 50, images=[[jpeg(1000 + start + i, (64, 48))] for i in range(50)],
                        sampling_params=small, use_tqdm=False)
    gc.collect()
    pids |= set(pool.worker_pids())  # (a respawned worker's too)
    assert shm_files_made_by(pids) <= files
    assert sum(shared_memory_held(pids).values()) - held < 1 << 20  # nothing kept (each picture took ~60 KB)


def test_prepared_pictures_hold_no_descriptor_once_they_arrive(pooled):
    """What the processor cache keeps (thousands of pictures) lives in this process's own memory: a picture
    the workers prepared holds no shared segment, so no file descriptor and no mapping, however many are kept."""
    pool = pooled.input_processor.pool
    me = psutil.Process()
    pool.prepare(jpeg(60), 0)
    gc.collect()
    before = me.num_fds()
    kept = [pool.prepare(jpeg(61 + i, (64, 48)), 0) for i in range(40)]
    assert all(not tensor.is_shared() for _, inputs in kept for tensor in inputs.values())
    assert me.num_fds() - before < 5  # one descriptor per kept picture before the copy on arrival


def test_a_worker_builds_its_preparer_from_the_engines_own_processor(in_process, tmp_path, monkeypatch):
    """A worker reads no checkpoint file and loads no tokenizer or config: it gets the engine's image processor and
    config (worker_main's loop, in a thread here, its checkpoint directory gone), and prepares as the engine does."""
    import transformers

    def refused(*args, **kwargs):
        raise AssertionError("a preprocessing worker loaded from the checkpoint")

    for name in ("AutoTokenizer", "AutoConfig", "AutoProcessor", "Qwen2VLImageProcessorPil"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", refused)
    monkeypatch.setattr(torch, "set_num_threads", lambda _: None)  # the worker's, for its own process
    spec = dataclasses.replace(in_process.input_processor.pictures.spec(), model_dir=str(tmp_path / "gone"))
    ours, theirs = Pipe()
    worker = threading.Thread(target=preprocess_pool.worker_main, args=(pickle.dumps(spec), theirs))
    worker.start()
    try:
        assert ours.recv()[0] == "ready"
        ours.send((jpeg(70), 0, None))
        status, (mm_hash, layout, segment) = ours.recv()
        inputs = copy_out(layout, segment)
    finally:
        ours.send(None)
        worker.join(30)
    assert not worker.is_alive() and status == "done"
    want_hash, want = in_process.input_processor.pictures.prepare_encoded(jpeg(70), 0)
    assert mm_hash == want_hash and inputs.keys() == want.keys()
    assert all(torch.equal(inputs[name], tensor) for name, tensor in want.items())


def test_a_pool_whose_workers_cannot_start_names_why():
    """A worker that fails while it builds its preparer (here: a config of no supported architecture) says why,
    and every picture fails with that error: the slot is not restarted in a loop, and no worker is left."""
    others = {child.pid for child in workers_alive()}  # the module's engine's workers
    spec = PreparerSpec(None, PretrainedConfig(architectures=["NoSuchForCausalLM"]), None, 1 << 20, "f", "s", "xxh3_128")
    pool = PreprocessPool(spec, 1)
    try:
        for index in range(2):
            with pytest.raises(UnsupportedModelError, match="NoSuchForCausalLM"):
                pool.prepare(jpeg(50 + index), index)
        assert pool.num_started == 0 and pool.num_respawns == 0
    finally:
        pool.close()
    assert {child.pid for child in workers_alive()} == others


class _SleepsWhenUnpickled:
    """A spec field a worker unpickles for an hour: a worker that never finishes starting."""

    def __reduce__(self):
        return time.sleep, (3600,)


def test_closing_a_pool_kills_a_worker_still_starting_and_starts_no_other():
    """A worker still starting has no picture to finish: close() kills it rather than wait for its start-up (here it
    would never end), the slot starts no other, and no worker is left."""
    others = {child.pid for child in workers_alive()}  # the module's engine's workers
    spec = PreparerSpec(_SleepsWhenUnpickled(), None, None, 1 << 20, "f", "s", "xxh3_128")
    pool = PreprocessPool(spec, 1)
    assert wait_until(lambda: pool.worker_pids() and psutil.pid_exists(pool.worker_pids()[0]), WORKER_WAIT_S)
    (starting,) = pool.worker_pids()
    try:
        closing = threading.Thread(target=pool.close, daemon=True)
        closing.start()
        closing.join(WORKER_WAIT_S)
        assert not closing.is_alive()
        assert pool.num_started == 0 and pool.num_respawns == 0
        assert {child.pid for child in workers_alive()} == others
    finally:  # where close() failed to, so a failing run leaves no hour-long sleeper behind
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(starting).kill()


def test_a_worker_whose_pool_is_gone_leaves_quietly(monkeypatch):
    """A worker that finishes starting after its pool's process has gone (its pipe closed) leaves without a
    traceback: nobody is left to tell it is ready."""
    monkeypatch.setattr(torch, "set_num_threads", lambda _: None)  # the worker's, for its own process
    monkeypatch.setattr(preprocess_pool.PicturePreparer, "from_spec", lambda spec: types.SimpleNamespace(warm_up=lambda: None))
    ours, theirs = Pipe()
    ours.close()
    preprocess_pool.worker_main(pickle.dumps(None), theirs)  # returns: no BrokenPipeError


def test_a_worker_process_leaves_without_the_interpreters_teardown(monkeypatch):
    """Once its loop has ended (here: it could not start, and said so), a worker process ends at once (os._exit):
    the interpreter's teardown with torch loaded took about 1.5 s of CPU, and the pool's close waited for it."""
    exits: list[int] = []
    monkeypatch.setattr(preprocess_pool.os, "_exit", exits.append)
    monkeypatch.setattr(torch, "set_num_threads", lambda _: None)  # the worker's, for its own process
    monkeypatch.setattr(preprocess_pool.signal, "signal", lambda *_: None)  # (only a main thread may set one)
    spec = PreparerSpec(None, PretrainedConfig(architectures=["NoSuchForCausalLM"]), None, 1 << 20, "f", "s", "xxh3_128")
    ours, theirs = Pipe()
    worker = threading.Thread(target=preprocess_pool.worker_process_main, args=(pickle.dumps(spec), theirs))
    worker.start()
    worker.join(30)
    assert not worker.is_alive() and ours.recv()[0] == "failed" and exits == [0]


def test_mm_processor_workers_is_checked_and_has_a_flag():
    with pytest.raises(ConfigError, match="mm_processor_workers"):
        EngineConfig(model="x", mm_processor_workers=-1)
    import argparse

    from mmengine.entrypoints.engine_flags import add_engine_options

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert parser.parse_args(["--mm-processor-workers", "3"]).mm_processor_workers == 3


def _gate_last_prompt_on_a_step(engine: MMEngine, monkeypatch, last: int) -> dict[str, bool]:
    """Holds prompt `last`'s preparation until the engine has stepped (at most 30 s) and says whether it had."""
    stepped, seen = threading.Event(), {}
    advance, prepare = engine.steps.advance, engine.intake.prepare

    def advance_and_tell(*args, **kwargs):
        stepped.set()
        return advance(*args, **kwargs)

    def gated_prepare(checked, index=0, *args, **kwargs):
        if index == last:
            seen["stepped_before_prepared"] = stepped.wait(timeout=30)
        return prepare(checked, index, *args, **kwargs)

    monkeypatch.setattr(engine.steps, "advance", advance_and_tell)
    monkeypatch.setattr(engine.intake, "prepare", gated_prepare)
    return seen


def test_generate_steps_the_first_prompts_while_later_pictures_are_prepared(pooled, in_process, monkeypatch):
    prompts = [qwen_vl_prompt(f"Question {i}: what is here?", 1) for i in range(4)]
    images = [[jpeg(40 + i)] for i in range(4)]
    seen = _gate_last_prompt_on_a_step(pooled, monkeypatch, last=3)
    got = pooled.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert seen == {"stepped_before_prepared": True}
    want = in_process.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert [out.token_ids for out in got] == [out.token_ids for out in want]


def test_a_bad_picture_found_after_the_first_prompts_run_aborts_them(pooled, monkeypatch):
    prompts = [qwen_vl_prompt(f"Question {i}: what is here?", 1) for i in range(4)]
    images = [[jpeg(50 + i)] for i in range(3)] + [[jpeg(53)[:200]]]
    seen = _gate_last_prompt_on_a_step(pooled, monkeypatch, last=3)
    with pytest.raises(CorruptImageError, match=r"^prompt 3: image 0: "):
        pooled.generate(prompts, images=images, sampling_params=PARAMS, use_tqdm=False)
    assert seen == {"stepped_before_prepared": True}  # the first prompts were queued and stepped
    assert not pooled.has_unfinished_requests()
    stats = pooled.stats()
    assert stats["requests_running"] == stats["requests_waiting"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert_books_consistent(pooled)
    monkeypatch.undo()
    assert len(pooled.generate(prompts[0], images=images[0], sampling_params=PARAMS, use_tqdm=False)[0].token_ids) == 4


def test_close_stops_the_workers_and_the_engine_serves_on_its_threads(pooled):
    """The module's last test: it closes the module's engine's pool (twice: idempotent). The engine then prepares
    pictures on its own threads (no processor cache: the picture is prepared again), with the same tokens."""
    pool = pooled.input_processor.pool
    prompt = qwen_vl_prompt("What is here?", 1)
    first = pooled.generate(prompt, images=[jpeg(60)], sampling_params=PARAMS, use_tqdm=False)[0].token_ids
    assert pool.wait_until_started(WORKER_WAIT_S)
    assert {child.pid for child in workers_alive()} == set(pool.worker_pids()) and len(pool.worker_pids()) == 2
    prepared = pool.num_prepared
    pooled.close()
    pooled.close()
    assert workers_alive() == []
    assert pooled.generate(prompt, images=[jpeg(60)], sampling_params=PARAMS, use_tqdm=False)[0].token_ids == first
    assert pool.num_prepared == prepared  # prepared here, not by a worker
