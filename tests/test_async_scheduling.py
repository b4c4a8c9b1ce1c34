"""Async scheduling: the next step is launched before the tokens of the one in flight are read.

It must change nothing a caller sees except when tokens arrive: the same tokens, texts, finish and
stop reasons and cached-token counts as synchronous steps, with stop tokens, stop strings, length
limits, seeded sampling, images, prefix hits and preemption; the books stay consistent; a request
that stops on a token costs exactly one discarded token. On CPU nothing overlaps (kernels run as
they are called), so "on" here checks the logic; a CUDA engine uses it by default.
"""

from __future__ import annotations

import pytest
import torch

from books import assert_books_consistent
from conftest import REPRESENTATIVE_FAMILIES
from helpers import FailOnce
from mmengine import MMEngine, SamplingParams
from mmengine.errors import ConfigError
from mmengine.testing import make_test_image

IMAGES = [make_test_image(500 + i) for i in range(3)]
# (the fuzzer runs async scheduling on every family)
representative = pytest.mark.parametrize("family", REPRESENTATIVE_FAMILIES, indirect=True)


def _outputs(engine: MMEngine, prompts, images, params) -> list[tuple]:
    outputs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.num_cached_tokens) for o in outputs]


def _workload(family, reference: MMEngine):
    """Prompts with and without images, repeated (prefix hits), and sampling parameters that end
    requests every way: length, a stop token, a stop string, EOS; greedy and seeded random."""
    texts = ["What is in the picture?", "Describe the colours.", "Count the things you see."]
    prompts = [family.prompt(texts[i % 3], 1 if i % 3 else 0) for i in range(9)]
    images = [[IMAGES[i % 3]] if i % 3 else None for i in range(9)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    probe = reference.generate(prompts, images=images, sampling_params=greedy, use_tqdm=False)
    params = []
    for i, out in enumerate(probe):
        kind = i % 5
        if kind == 0:
            params.append(SamplingParams(max_tokens=3 + i, temperature=0.0, ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[out.token_ids[3]]))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=10, temperature=0.0, stop=[out.text[2:5]] if len(out.text) > 5 else []))
        elif kind == 3:
            params.append(SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True))
        else:
            params.append(SamplingParams(max_tokens=6, temperature=0.0))  # stops at EOS if the model says it
    return prompts, images, params


@pytest.mark.parametrize("kv_blocks", [None, 10], ids=["roomy", "preempting"])
@representative
def test_async_scheduling_gives_what_synchronous_steps_give(family, kv_blocks):
    engines = {  # without prefix grouping's KV gate, tight blocks preempt
        mode: MMEngine(str(family.path), device="cpu", dtype="float32", max_model_len=256, block_size=8,
                       num_kv_blocks=kv_blocks, max_num_batched_tokens=64, enable_prefix_grouping=kv_blocks is None,
                       async_scheduling=mode)
        for mode in ("off", "on")
    }
    assert engines["on"].steps.async_scheduling and not engines["off"].steps.async_scheduling
    prompts, images, params = _workload(family, engines["off"])
    engines["off"].reset_prefix_cache()  # the probe warmed it
    engines["off"].reset_encoder_cache()
    results = {mode: [_outputs(engine, prompts, images, params) for _ in range(2)] for mode, engine in engines.items()}
    if kv_blocks is None:
        assert results["on"] == results["off"]
    else:  # which request is preempted when, and so what the prefix cache holds, depends on step timing
        assert [[o[:4] for o in run] for run in results["on"]] == [[o[:4] for o in run] for run in results["off"]]
    assert {reason for run in results["on"] for _, _, reason, _, _ in run} >= {"length", "stop"}
    assert sum(o[4] for o in results["on"][1]) > 0  # the second round hits the prefix cache
    if kv_blocks is not None:
        assert engines["on"].stats()["num_preemptions"] > 0
    for engine in engines.values():
        assert_books_consistent(engine)
        stats = engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["encoder_cache_referenced"] == 0
        # (a step left in flight only for finished requests, e.g. after a stop token, is dropped, not waited for)
        assert not engine.has_unfinished_requests() and engine.steps.in_flight is None


def test_a_request_that_stops_on_a_token_costs_one_discarded_token(checkpoint_dir):
    """Length limits are known when the next step is scheduled; a stop token or stop string is not."""
    stats, outputs = {}, {}
    prompts = [f"USER: say {word} ASSISTANT:" for word in ("one", "two", "three", "four")]
    for mode in ("off", "on"):
        engine = MMEngine(str(checkpoint_dir()), max_model_len=128, async_scheduling=mode)
        if mode == "off":
            probe = engine.generate(prompts, sampling_params=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
            params = [
                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop_token_ids=[probe[1].token_ids[2]]),
                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[probe[2].text[1:4]]),
                SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, stop_token_ids=[probe[3].token_ids[2]]),
            ]
        before = engine.stats()
        outputs[mode] = [(o.token_ids, o.finish_reason) for o in engine.generate(prompts, sampling_params=params, use_tqdm=False)]
        stats[mode] = {k: engine.stats()[k] - before[k] for k in ("tokens_computed", "prefill_tokens_computed", "generation_tokens")}
    assert outputs["on"] == outputs["off"]
    assert [reason for _, reason in outputs["on"]] == ["length", "stop", "stop", "stop"]
    # The stop token of the last request is also its last allowed token: nothing more was scheduled.
    assert stats["on"]["tokens_computed"] == stats["off"]["tokens_computed"] + 2
    assert stats["on"]["prefill_tokens_computed"] == stats["off"]["prefill_tokens_computed"]
    assert stats["on"]["generation_tokens"] == stats["off"]["generation_tokens"]


def test_step_delivers_each_token_one_call_later_and_aborts_in_flight(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=128, async_scheduling="on")
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    keep = engine.add_request("USER: hello ASSISTANT:", sampling_params=params)
    drop = engine.add_request("USER: bye ASSISTANT:", sampling_params=params)
    assert engine.step() == []  # the prefill is launched; its tokens are read by the next call
    assert engine.steps.in_flight is not None and engine.has_unfinished_requests()
    first = engine.step()
    assert sorted(o.request_id for o in first) == sorted([drop, keep]) and all(len(o.token_ids) == 1 for o in first)
    assert engine.abort_request(drop)  # its next token is computing: it is discarded, not delivered
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen.setdefault(output.request_id, []).append(output)
        assert_books_consistent(engine)
    assert [o.finish_reason for o in seen[drop]] == ["abort"] and seen[drop][0].token_ids == first[0 if first[0].request_id == drop else 1].token_ids
    assert seen[keep][-1].finish_reason == "length" and len(seen[keep][-1].token_ids) == 4
    sync = MMEngine(str(checkpoint_dir()), max_model_len=128, async_scheduling="off")
    assert seen[keep][-1].token_ids == sync.generate("USER: hello ASSISTANT:", sampling_params=params, use_tqdm=False)[0].token_ids


def test_a_failing_launch_delivers_the_step_in_flight_and_can_be_retried(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=128, async_scheduling="on")
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    request_id = engine.add_request("USER: <image>\nWhat is it? ASSISTANT:", [IMAGES[0]], params)
    engine.step()  # the prefill is in flight
    engine.runner.inputs.prepare = FailOnce(engine.runner.inputs.prepare)  # a decode replays a graph on CUDA
    with pytest.raises(MemoryError, match="injected"):
        engine.step()
    assert_books_consistent(engine)
    delivered = engine.step()  # the prefill's token came out of the failed call: it is handed over now
    assert [len(o.token_ids) for o in delivered if o.request_id == request_id][:1] == [1]
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
    sync = MMEngine(str(checkpoint_dir()), max_model_len=128, async_scheduling="off")
    expected = sync.generate("USER: <image>\nWhat is it? ASSISTANT:", images=[IMAGES[0]], sampling_params=params, use_tqdm=False)
    assert final.token_ids == expected[0].token_ids and final.finish_reason == "length"
    assert_books_consistent(engine)


def test_async_scheduling_is_validated_and_on_by_default_only_on_cuda(checkpoint_dir):
    with pytest.raises(ConfigError, match="async_scheduling"):
        MMEngine(str(checkpoint_dir()), async_scheduling="yes")
    engine = MMEngine(str(checkpoint_dir()), max_model_len=128)
    assert engine.steps.async_scheduling == (engine.device.type == "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU tests above check the same logic")
def test_async_scheduling_on_cuda_gives_the_tokens_of_synchronous_steps(checkpoint_dir):
    """On a GPU the next step really overlaps: CUDA graphs read the previous step's tokens on the device."""
    prompts = [f"USER: <image>\ntell me about {w} ASSISTANT:" for w in ("cats", "dogs", "boats", "trees")]
    images = [[IMAGES[i % 3]] for i in range(4)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True)] * 2
    results = {}
    for mode in ("off", "on"):
        engine = MMEngine(str(checkpoint_dir()), device="cuda", dtype="float32", max_model_len=256, async_scheduling=mode)
        results[mode] = _outputs(engine, prompts, images, params)
        assert engine.runner.decode_graphs is not None and engine.runner.decode_graphs.num_replays > 0
    assert results["on"] == results["off"]


@representative
def test_async_scheduling_with_cascade_attention(family):
    """Cascade steps (shared image prefixes attended to per group) take their decode inputs from the
    previous step on the device too."""
    system = family.prompt("Look carefully at this picture and answer briefly, please, in detail.", 1)
    prompts = [system + f" q{i} " + "word " * (i % 3) for i in range(6)]
    images = [[IMAGES[0]]] * 3 + [[IMAGES[1]]] * 3
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    results = {}
    for mode in ("off", "on"):
        engine = MMEngine(str(family.path), dtype="float32", device="cpu", max_model_len=256, block_size=4,
                          cascade_attention="on", async_scheduling=mode)
        results[mode] = _outputs(engine, prompts, images, params)
        assert engine.stats()["cascade_steps"] > 0
    assert results["on"] == results["off"]
