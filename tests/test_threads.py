"""Several threads adding, stepping, aborting and generating on one engine get exactly the outputs
of a single-threaded run: the engine's lock makes every public method safe to call concurrently."""

from __future__ import annotations

import threading

import pytest

from books import assert_books_consistent
from mmengine import MMEngine, SamplingParams
from mmengine.testing import make_test_image

IMAGES = [make_test_image(400 + i) for i in range(5)]
KWARGS = dict(max_model_len=256, block_size=8, max_num_batched_tokens=48, num_kv_blocks=48, encoder_cache_size=32)
NUM_THREADS = 4
PER_THREAD = 4
ROUNDS = 3


def _workload(thread: int) -> list[tuple[str, list, SamplingParams]]:
    work = []
    for i in range(PER_THREAD):
        n = thread * PER_THREAD + i
        images = [IMAGES[n % len(IMAGES)], IMAGES[(n * 3) % len(IMAGES)]][: 1 + n % 2]
        prompt = "USER: " + "<image>" * len(images) + f"\nTell me about picture {n}. ASSISTANT:"
        params = SamplingParams(max_tokens=3 + n % 4, temperature=0.0 if n % 3 else 0.9, seed=n, ignore_eos=True)
        work.append((prompt, images, params))
    return work


def _reference(path) -> dict[str, list[int]]:
    engine = MMEngine(str(path), **KWARGS)
    work = {f"t{t}-{i}": w for t in range(NUM_THREADS) for i, w in enumerate(_workload(t))}
    outputs = engine.generate([w[0] for w in work.values()], images=[w[1] for w in work.values()],
                              sampling_params=[w[2] for w in work.values()], use_tqdm=False)
    return {request_id: o.token_ids for request_id, o in zip(work, outputs)}


def _run_threads(target, count: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(index: int) -> None:
        try:
            target(index)
        except BaseException as err:  # re-raised in the main thread below
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not any(thread.is_alive() for thread in threads), "a thread hung"
    return errors


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_threads_adding_and_stepping_match_a_single_threaded_run(checkpoint_dir, async_scheduling):
    path = checkpoint_dir()
    reference = _reference(path)  # synchronous steps, one thread
    engine = MMEngine(str(path), **KWARGS, async_scheduling=async_scheduling)
    for round_index in range(ROUNDS):
        finished: dict[str, list[int]] = {}
        aborted: dict[str, str | None] = {}
        seen_lock = threading.Lock()
        start = threading.Barrier(NUM_THREADS + 1)

        def collect(outputs) -> None:
            with seen_lock:
                for output in outputs:
                    if output.finish_reason == "abort":
                        aborted[output.request_id] = output.finish_reason
                    elif output.finished:
                        assert output.request_id not in finished, "an output was delivered twice"
                        finished[output.request_id] = output.token_ids

        def worker(thread: int) -> None:
            start.wait()
            mine = []
            for i, (prompt, images, params) in enumerate(_workload(thread)):
                mine.append(engine.add_request(prompt, images, params, request_id=f"r{round_index}-t{thread}-{i}"))
                collect(engine.step())
            # ignore_eos: a random model may emit EOS at once, and the abort would find the request finished
            extra = engine.add_request("USER: to be aborted ASSISTANT:", None, SamplingParams(max_tokens=200, ignore_eos=True))
            collect(engine.step())
            assert engine.abort_request(extra)
            for _ in range(1000):
                with seen_lock:
                    if all(r in finished for r in mine) and extra in aborted:
                        return
                collect(engine.step())
            raise AssertionError(f"thread {thread}: requests never finished")

        def generator(_: int) -> None:  # a concurrent generate() call gets exactly its own outputs
            start.wait()
            work = _workload(0)
            outs = engine.generate([w[0] for w in work], images=[w[1] for w in work], sampling_params=[w[2] for w in work], use_tqdm=False)
            assert [o.token_ids for o in outs] == [reference[f"t0-{i}"] for i in range(PER_THREAD)]

        errors = _run_threads(lambda i: generator(i) if i == NUM_THREADS else worker(i), NUM_THREADS + 1)
        assert not errors, errors
        expected = {f"r{round_index}-{k}": v for k, v in reference.items()}
        assert finished == expected
        assert len(aborted) == NUM_THREADS
        assert not engine.has_unfinished_requests()
        assert_books_consistent(engine)
        stats = engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and engine.encoder_cache.num_referenced == 0
