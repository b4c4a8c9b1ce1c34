"""Structured output in the engine (SamplingParams(structured_output=...)): every answer matches its
JSON schema, regex, choice or grammar, greedy and sampled, with and without async scheduling, in a
batch with unconstrained requests that it leaves as they were; specs compile once; bad specs are
typed errors and the engine keeps serving."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from mmengine import MMEngine, SamplingParams, StructuredOutputParams
from mmengine.errors import ConfigError
from mmengine.sample.structured_output.masks import apply_token_bitmask
from mmengine.testing import make_test_image, tiny_qwen_vl_path
from mmengine.testing.schemas import SCHEMAS

PICTURE = make_test_image(3, size=(56, 56))


@pytest.fixture(scope="module")
def engines():
    path = tiny_qwen_vl_path()
    return {mode: MMEngine(str(path), device="cpu", dtype="float32", async_scheduling=mode) for mode in ("off", "on")}


def _question(engine: MMEngine, text: str) -> str:
    return engine.input_processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}])


def _replays(engine: MMEngine, spec: StructuredOutputParams, tokens: list[int]) -> bool:
    """Whether `tokens` are accepted one by one by a fresh matcher of `spec` (a valid prefix at every step)."""
    matcher = engine.grammars.matcher(spec)
    return all(matcher.consume_token(token) for token in tokens)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_every_schema_answer_validates_in_a_mixed_batch(engines, mode):
    engine = engines[mode]
    names = list(SCHEMAS)
    free = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts, params = [], []
    for i, name in enumerate(names):
        spec = StructuredOutputParams(json=SCHEMAS[name])
        sampled = dict(temperature=1.0, seed=i) if i % 2 else dict(temperature=0)
        prompts.append(_question(engine, f"Give me {name}"))
        params.append(SamplingParams(max_tokens=200, structured_output=spec, **sampled))
    prompts.append(_question(engine, "Describe it freely."))
    params.append(free)
    outs = engine.generate(prompts, images=[[PICTURE]] * len(prompts), sampling_params=params, use_tqdm=False)
    for name, out, p in zip(names, outs, params):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
        assert " " not in out.text.replace('" ', "").split('"')[0]  # compact: no whitespace before the first string
        assert _replays(engine, p.structured_output, out.token_ids[:-1] if out.stop_reason in engine.eos_token_ids else out.token_ids)
    alone = engine.generate(prompts[-1], images=[PICTURE], sampling_params=free, use_tqdm=False)[0]
    assert outs[-1].token_ids == alone.token_ids  # the unconstrained row is untouched by its neighbours' masks


def test_async_scheduling_gives_the_same_constrained_tokens(engines):
    spec = StructuredOutputParams(json=SCHEMAS["receipt"])
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured_output=spec) for s in range(3)]
    prompts = [_question(engines["off"], "The receipt, please.")] * 3
    off, on = (engines[m].generate(prompts, images=[[PICTURE]] * 3, sampling_params=params, use_tqdm=False) for m in ("off", "on"))
    assert [o.token_ids for o in off] == [o.token_ids for o in on]
    assert len({o.text for o in off}) > 1  # seeds give different answers


def test_choice_regex_grammar_and_json_object(engines):
    engine = engines["on"]
    specs = {
        "choice": StructuredOutputParams(choice=["red", "green", "light blue"]),
        "regex": StructuredOutputParams(regex=r"[0-9]{3}-[a-z]{2,4}"),
        "grammar": StructuredOutputParams(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
        "json_object": StructuredOutputParams(json_object=True),
    }
    for seed in range(3):
        params = [SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured_output=s) for s in specs.values()]
        outs = engine.generate(["Answer:"] * len(specs), sampling_params=params, use_tqdm=False)
        texts = dict(zip(specs, (o.text for o in outs)))
        assert all(o.finish_reason == "stop" for o in outs), texts
        assert texts["choice"] in ("red", "green", "light blue")
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", texts["regex"])
        assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", texts["grammar"])
        assert isinstance(json.loads(texts["json_object"]), dict)


def test_a_spec_compiles_once_and_masks_are_counted(engines):
    engine = engines["off"]
    spec = StructuredOutputParams(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                        "required": ["n"], "additionalProperties": False})
    compiled, masks = engine.grammars.num_compiled, engine.runner.grammar_masks.num_masks
    same = StructuredOutputParams(json=json.dumps(spec.json))  # equal schema given as text: the same cache entry
    outs = engine.generate(["a", "b"], sampling_params=[SamplingParams(max_tokens=20, temperature=0, structured_output=s)
                                                         for s in (spec, same)], use_tqdm=False)
    assert engine.grammars.num_compiled == compiled + 1
    assert [json.loads(o.text)["n"] in range(10) for o in outs] == [True, True]
    assert engine.runner.grammar_masks.num_masks - masks == sum(len(o.token_ids) for o in outs)


@pytest.mark.parametrize("bad, match", [
    (dict(json={"type": "strin"}), "json cannot be used: Invalid type: strin"),
    (dict(regex="a(b"), "regex cannot be used: .*unclosed group"),
    (dict(grammar="start: missing_rule"), "grammar cannot be used: .*unknown name"),
    (dict(json='{"type": '), "json is not valid JSON"),
    (dict(json={"type": "string", "pattern": "(("}), "json cannot be used"),
])
def test_bad_specs_are_typed_errors_and_the_engine_keeps_serving(engines, bad, match):
    engine = engines["on"]
    with pytest.raises(ConfigError, match=match):
        engine.generate(["fine", "bad"], sampling_params=[SamplingParams(max_tokens=2),
                                                           SamplingParams(structured_output=StructuredOutputParams(**bad))],
                        use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.generate("still serving", sampling_params=SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids


def test_params_need_exactly_one_kind():
    with pytest.raises(ConfigError, match="exactly one of"):
        StructuredOutputParams()
    with pytest.raises(ConfigError, match="exactly one of"):
        StructuredOutputParams(regex="a", choice=["a"])
    with pytest.raises(ConfigError, match="choice must hold non-empty strs"):
        StructuredOutputParams(choice=["a", ""])
    with pytest.raises(ConfigError, match="whitespace_pattern applies to json"):
        StructuredOutputParams(regex="a", whitespace_pattern=" ?")
    with pytest.raises(ConfigError, match="structured_output"):
        SamplingParams(structured_output={"json": {}})


def test_whitespace_pattern_allows_what_it_names(engines):
    engine = engines["off"]
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
              "additionalProperties": False}
    spec = StructuredOutputParams(json=schema, whitespace_pattern=" ")
    outs = engine.generate(["w"] * 4, sampling_params=[SamplingParams(max_tokens=40, temperature=1.0, seed=s, structured_output=spec)
                                                       for s in range(4)], use_tqdm=False)
    for out in outs:
        assert json.loads(out.text)["a"] in range(10) and "\n" not in out.text


def test_apply_token_bitmask_matches_a_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    allowed = torch.rand(2, 70) > 0.5
    words = torch.zeros(2, 3, dtype=torch.int64)
    for row in range(2):
        for token in allowed[row].nonzero().flatten().tolist():
            words[row, token // 32] |= 1 << (token % 32)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    out = apply_token_bitmask(logits, torch.tensor([2, 0]), bitmask)
    assert torch.equal(out[1], logits[1])
    for row, source in ((2, 0), (0, 1)):
        assert torch.equal(out[row].isinf(), ~allowed[source])
        assert torch.equal(out[row][allowed[source]], logits[row][allowed[source]])


def test_with_async_scheduling_masks_wait_for_the_previous_tokens_not_the_forward(engines):
    """Each constrained step launches its forward first, then reads the previous step's tokens (and
    feeds them to the grammars), then samples: the forward runs while the host works."""
    engine = engines["on"]
    events: list[str] = []
    runner, scheduler = engine.runner, engine.scheduler
    launch, sample, resolve = runner.launch, runner.sample, scheduler.resolve_tokens

    def record(name, method):
        def wrapped(*args, **kwargs):
            events.append(name)
            return method(*args, **kwargs)
        return wrapped

    runner.launch, runner.sample, scheduler.resolve_tokens = record("launch", launch), record("sample", sample), record("resolve", resolve)
    try:
        spec = StructuredOutputParams(regex="[a-z]{12}")
        (out,) = engine.generate("x", sampling_params=SamplingParams(max_tokens=20, temperature=0, structured_output=spec),
                                 use_tqdm=False)
    finally:
        del runner.launch, runner.sample, scheduler.resolve_tokens
    assert re.fullmatch("[a-z]{12}", out.text)
    steady = "".join(e[0] for e in events)  # l(aunch) r(esolve) s(ample)
    assert steady.startswith("ls") and "lrs" * 5 in steady and "srs" not in steady
