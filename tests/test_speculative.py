"""Speculative decoding (spec/): the config, the n-gram proposer, and that verifying drafts never changes a
token. The engine tests run each family twice, once without speculation (the reference: its tokens equal
transformers' elsewhere) and once with it, on a dense decoder (LLaVA), a hybrid one whose recurrent states
must roll back past rejected drafts (Qwen3.5), a windowed one (Gemma 4) and a chunked one (Llama 4). Besides the n-gram proposer, an
oracle proposes the reference continuation with chosen drafts corrupted, so every acceptance pattern (all,
some, none) happens at known steps and the counters can be checked exactly."""

from __future__ import annotations

import argparse
import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from books import assert_books_consistent
from mmengine import MMEngine, SamplingParams
from mmengine.config import EngineConfig
from mmengine.entrypoints.engine_flags import add_engine_options, engine_options
from mmengine.errors import ConfigError
from mmengine.spec import NgramProposer, SpecCounters, accepted_prefix, ngram_drafts
from mmengine.spec.backoff import DraftBackoff
from mmengine.testing import make_test_image
from mmengine.testing.qwen_vl import qwen_vl_prompt

K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PICTURES = [make_test_image(31, size=(64, 64)), make_test_image(32, size=(48, 96))]


# -- the config ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, named", [
    ({"method": "carrier-pigeon", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
    ("ngram", "speculative_config"),
])
def test_bad_speculative_configs_are_refused_by_name(spec, named):
    with pytest.raises(ConfigError, match=named):
        EngineConfig("model", speculative_config=spec)


def test_speculative_config_defaults_and_async_scheduling():
    config = EngineConfig("model", speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    spec = config.spec_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 4, 3, 3)
    assert EngineConfig("model").spec_config.num_speculative_tokens == 0
    assert EngineConfig("model", speculative_config=NGRAM, async_scheduling="on").scheduler_config.async_scheduling == "on"


def test_the_command_line_flag_takes_vllm_json_and_key_value_pairs():
    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    for text in ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}',
                 "method=ngram,num_speculative_tokens=3,prompt_lookup_max=4"):
        options = engine_options(parser.parse_args(["--speculative-config", text]))
        assert options == {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}}
        assert EngineConfig("model", **options).spec_config.prompt_lookup_max == 4


# -- proposing and accepting ---------------------------------------------------------------------------

def test_ngram_drafts_take_the_latest_longest_match():
    def drafts(tokens: list[int], k: int = 3, low: int = 1, high: int = 3) -> list[int]:
        return ngram_drafts(np.array(tokens), k, low, high)

    # the suffix [1, 2] occurs at 0 (followed by 3 4 5) and at 5 (followed by 9 9): the later one wins
    assert drafts([1, 2, 3, 4, 5, 1, 2, 9, 9, 7, 1, 2]) == [9, 9, 7]
    assert drafts([5, 6, 7, 8, 7, 0, 5, 6, 7]) == [8, 7, 0]  # a 3-gram match beats a later 1-gram one
    assert drafts([1, 2, 3]) == []  # the suffix occurs only as itself
    assert drafts([4, 4]) == [4]  # what follows the match, up to the end
    assert drafts([1, 2, 3, 4, 5, 1, 2], k=2) == [3, 4]
    assert drafts([1, 2, 3, 1, 2], k=0) == []
    assert drafts([1, 2, 3, 4, 9, 2, 3], low=3) == []  # only a 2-gram repeats


def test_the_ngram_proposer_keeps_each_requests_tokens_as_they_grow():
    proposer = NgramProposer(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    tokens = [7, 8, 9, 1]
    assert proposer.propose("a", tokens, max_drafts=3) == []
    for token in [7, 8]:  # the request's output grows: only the new tokens are copied in
        tokens.append(token)
    assert proposer.propose("a", tokens, max_drafts=3) == [9, 1, 7]
    assert proposer.propose("a", tokens, max_drafts=1) == [9]
    tokens += list(range(100, 300))  # past the buffer's first size
    tokens += [100, 101]
    assert proposer.propose("a", tokens, max_drafts=3) == [102, 103, 104]
    assert proposer.propose("b", [5, 5], max_drafts=3) == [5]  # another request, its own history
    proposer.forget("a")
    assert proposer.propose("a", [1, 2, 1], max_drafts=3) == [2, 1]  # a new request under the old id


def test_accepted_prefix_and_counters():
    assert accepted_prefix([5, 6, 7], [5, 6, 8, 1]) == 2
    assert accepted_prefix([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accepted_prefix([5, 6, 7], [5, 6, 7, 1]) == 3
    counters = SpecCounters(3)
    counters.record(3, 2)
    counters.record(1, 1)
    assert counters.stats() == {
        "spec_draft_tokens": 4, "spec_accepted_tokens": 3, "spec_verify_steps": 2,
        "spec_drafted_position_0": 2, "spec_accepted_position_0": 2, "spec_drafted_position_1": 1,
        "spec_accepted_position_1": 1, "spec_drafted_position_2": 1, "spec_accepted_position_2": 0,
    }


def test_draft_backoff_pauses_a_request_whose_drafts_keep_failing():
    backoff = DraftBackoff(patience=2, first_pause=2, max_pause=4)
    drafting = []
    for accepted in [0, 0, None, None, 0, 0, None, None, None, None, 0, 0, None, None, None, None, 1, 0, 0, None, None]:
        allowed = backoff.allows("a")
        drafting.append(allowed)
        assert allowed == (accepted is not None)
        if allowed:
            backoff.record("a", accepted)
    # pauses of 2, 4, then capped at 4; a kept draft ends the doubling (the next pause is 2 again)
    assert backoff.num_paused_steps == 2 + 4 + 4 + 2
    assert backoff.allows("b")  # each request its own
    backoff.forget("a")
    assert backoff.allows("a")


# -- the engine ----------------------------------------------------------------------------------------

class OracleProposer:
    """Proposes each request's reference continuation (by the prompt it starts with), with the draft at
    `wrong_at(step)` (None: none) replaced by a token the model does not emit there; records how many
    drafts should be accepted."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], wrong_at=lambda step: None) -> None:
        self.references = references
        self.wrong_at = wrong_at
        self.expected_accepted = 0
        self.proposals = 0

    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        for prompt, answer in self.references.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = answer[done : done + min(K, max_drafts)]
                wrong = self.wrong_at(self.proposals)
                self.proposals += 1
                if wrong is not None and wrong < len(drafts):
                    drafts[wrong] = (drafts[wrong] + 1) % 50
                    self.expected_accepted += wrong
                else:
                    self.expected_accepted += len(drafts)
                return drafts
        return []

    def forget(self, request_id: str) -> None:
        pass


FAMILY_CASES = {
    "llava": lambda text, n: "USER: " + "<image>\n" * n + text + " ASSISTANT:",
    "qwen3_5": qwen_vl_prompt,
    "gemma4": lambda text, n: "<bos><|turn>user\n" + "\n\n<|image|>\n\n" * n + text + "<turn|>\n<|turn>model\n",
    # chunked local attention: kept runs cross chunk boundaries, where the chunked pool frees blocks
    "llama4": lambda text, n: ("<|begin_of_text|><|header_start|>user<|header_end|>\n\n" + "<|image|>" * n + text
                               + "<|eot|><|header_start|>assistant<|header_end|>\n\n"),
}


@pytest.fixture(scope="module", params=list(FAMILY_CASES))
def engines(request, family_checkpoint):
    """(family, reference engine, speculating engine, the reference's greedy outputs for _batch), built once
    per family for the module."""
    path = str(family_checkpoint(request.param))
    options = dict(device="cpu", dtype="float32", max_model_len=256, block_size=8)
    reference = MMEngine(path, **options)
    prompts, images = _batch(request.param)
    expected = reference.generate(prompts, images=images, sampling_params=_greedy(MAX_TOKENS), use_tqdm=False)
    return request.param, reference, MMEngine(path, speculative_config=NGRAM, **options), expected


MAX_TOKENS = 20


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def _batch(family: str) -> tuple[list[str], list]:
    prompt = FAMILY_CASES[family]
    prompts = [prompt("Say it again and again.", 0), prompt("What is here?", 1), prompt("Compare them all.", 2 if family != "gemma4" else 1)]
    images = [None, PICTURES[:1], PICTURES[:2] if family != "gemma4" else PICTURES[1:]]
    return prompts, images


def _with_proposer(engine: MMEngine, proposer):
    previous, engine.steps.drafts.proposer = engine.steps.drafts.proposer, proposer
    return previous


def _spec_counts(engine: MMEngine) -> Counter:
    return Counter({k: v for k, v in engine.stats().items() if k.startswith("spec_") or k in ("steps", "decode_steps")})


def _run_with(engine: MMEngine, proposer, prompts, images, params: SamplingParams) -> tuple[list, Counter]:
    """generate() with `proposer` in place of the engine's; the outputs, and the counters the call moved."""
    previous = _with_proposer(engine, proposer)
    try:
        before = _spec_counts(engine)
        outs = engine.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    finally:
        _with_proposer(engine, previous)
    return outs, _spec_counts(engine) - before


def test_ngram_drafts_keep_greedy_tokens(engines):
    family, _, speculating, expected = engines
    prompts, images = _batch(family)
    before = _spec_counts(speculating)
    outs = speculating.generate(prompts, images=images, sampling_params=_greedy(MAX_TOKENS), use_tqdm=False)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    done = _spec_counts(speculating) - before
    assert done["spec_draft_tokens"] > 0 and done["spec_verify_steps"] > 0
    assert_books_consistent(speculating)


@pytest.mark.parametrize("engines, pattern", [("llava", "all-right"), ("llava", "mixed"), ("qwen3_5", "mixed"), ("gemma4", "mixed"),
                                              ("llama4", "mixed")],
                         indirect=["engines"])
def test_every_acceptance_pattern_keeps_greedy_tokens(engines, pattern):
    """Oracle drafts: all accepted, or by step all / two of three / none / one. With a hybrid decoder, every
    rejection rolls the recurrent states back; with windows, freed window blocks must never be ones a kept
    position reads."""
    family, _, speculating, expected = engines
    prompts, images = _batch(family)
    wrong_at = {"all-right": lambda step: None, "mixed": lambda step: [None, 2, 0, 1][step % 4]}[pattern]
    oracle = OracleProposer(_references(expected), wrong_at)
    outs, done = _run_with(speculating, oracle, prompts, images, _greedy(MAX_TOKENS))
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert done["spec_accepted_tokens"] == oracle.expected_accepted > 0
    if pattern == "all-right":
        assert done["spec_accepted_tokens"] == done["spec_draft_tokens"]
        # alone, a request's verify steps emit K + 1 tokens each: its decode tokens in a quarter of the steps
        (alone,), done = _run_with(speculating, OracleProposer(_references(expected)), prompts[0], None, _greedy(MAX_TOKENS))
        assert alone.token_ids == expected[0].token_ids
        assert done["decode_steps"] == math.ceil((MAX_TOKENS - 1) / (K + 1))
    assert_books_consistent(speculating)


class NeverProposer:
    def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        return []

    def forget(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("engines", ["llava", "qwen3_5"], indirect=True)
def test_async_scheduling_with_drafts_keeps_the_tokens_and_overlaps_the_steps_without_drafts(engines):
    """Async scheduling on with speculation: a step whose successor drafts is read before that one is launched
    (its drafts follow its tokens; a verify step's kept run sets the next positions); the others are launched
    ahead. The tokens are those without speculation, with n-gram drafts, oracle drafts in every acceptance
    pattern, and none at all (then every step but the first is launched ahead)."""
    family, reference, _, expected = engines
    engine = MMEngine(reference.config.model, device="cpu", dtype="float32", max_model_len=256, block_size=8,
                      speculative_config=NGRAM, async_scheduling="on")
    assert engine.steps.async_scheduling
    prompts, images = _batch(family)
    tokens = [e.token_ids for e in expected]
    # n-gram: the random weights' rare matches seldom survive one more token, so most steps run ahead
    outs = engine.generate(prompts, images=images, sampling_params=_greedy(MAX_TOKENS), use_tqdm=False)
    assert [o.token_ids for o in outs] == tokens and engine.stats()["steps_launched_ahead"] > 0
    # (the oracle's own count of what it expects kept would include the look-ahead's proposals)
    oracle = OracleProposer(_references(expected), lambda step: [None, 2, 0, 1][step % 4])
    outs, done = _run_with(engine, oracle, prompts, images, _greedy(MAX_TOKENS))
    assert [o.token_ids for o in outs] == tokens
    assert 0 < done["spec_accepted_tokens"] < done["spec_draft_tokens"]
    before = engine.stats()
    outs, done = _run_with(engine, NeverProposer(), prompts, images, _greedy(MAX_TOKENS))
    assert [o.token_ids for o in outs] == tokens
    assert engine.stats()["steps_launched_ahead"] - before["steps_launched_ahead"] == done["steps"] - 1
    # alone, with every draft right: after a prompt step of one token (a full prefix hit) drafts are expected at
    # once; after a longer one (a hybrid model resumes from a block's checkpoint) the first decode is launched
    # ahead of the prompt's token, which no draft can follow yet. Then every step verifies K drafts after the
    # one before was read.
    before = engine.stats()
    (alone,), done = _run_with(engine, OracleProposer(_references(expected)), prompts[0], None, _greedy(MAX_TOKENS))
    assert alone.token_ids == tokens[0]
    ahead = int(len(alone.prompt_token_ids) - alone.num_cached_tokens > 1)
    assert engine.stats()["steps_launched_ahead"] - before["steps_launched_ahead"] == ahead
    assert done["decode_steps"] == ahead + math.ceil((MAX_TOKENS - 1 - ahead) / (K + 1))
    assert_books_consistent(engine)


@pytest.mark.parametrize("engines", ["llava", "qwen3_5"], indirect=True)
def test_verify_steps_share_a_small_token_budget_with_prefill_chunks(engines):
    """A 6-token budget: prompts prefill in chunks (cutting pictures) while others verify, and a decode's
    drafts are cut to what the budget leaves after the requests before it; the tokens do not change."""
    family, reference, _, expected = engines
    prompts, images = _batch(family)
    engine = MMEngine(reference.config.model, device="cpu", dtype="float32", max_model_len=256, block_size=8,
                      max_num_batched_tokens=6, speculative_config=NGRAM)
    oracle = OracleProposer(_references(expected), lambda step: [None, 2][step % 2])
    _with_proposer(engine, oracle)
    outs = engine.generate(prompts, images=images, sampling_params=_greedy(MAX_TOKENS), use_tqdm=False)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    stats = engine.stats()
    assert 0 < stats["spec_accepted_tokens"] and stats["spec_draft_tokens"] < oracle.proposals * K  # some were cut
    assert_books_consistent(engine)


def _references(outputs) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's expanded token ids (as the engine holds them) -> its reference answer."""
    return {tuple(out.prompt_token_ids): list(out.token_ids) for out in outputs}


@pytest.mark.parametrize("engines", ["llava", "qwen3_5"], indirect=True)
def test_penalized_requests_draft_and_keep_their_tokens(engines):
    """Presence, frequency and repetition penalties with drafts: each verify row is penalized as if the drafts
    before it were output, and only kept tokens are counted, so the tokens are those without speculation
    (and not those without the penalties: the test would see penalties that missed a row)."""
    family, reference, speculating, expected_plain = engines
    prompts, images = _batch(family)
    penalized = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, presence_penalty=0.8,
                               frequency_penalty=0.6, repetition_penalty=1.4)
    expected = reference.generate(prompts, images=images, sampling_params=penalized, use_tqdm=False)
    assert [e.token_ids for e in expected] != [e.token_ids for e in expected_plain]
    oracle = OracleProposer(_references(expected), lambda step: [None, 2, 0, 1][step % 4])
    outs, done = _run_with(speculating, oracle, prompts, images, penalized)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert done["spec_accepted_tokens"] == oracle.expected_accepted > 0
    assert speculating.runner.penalties.num_rows_in_use == 0


@pytest.mark.parametrize("engines", ["llava"], indirect=True)
def test_requests_whose_drafts_all_fail_back_off(engines):
    """Every first draft wrong: each request verifies two steps, then decodes without drafts for 2, 4, 8
    steps between pairs of verify steps; the tokens do not change."""
    family, _, speculating, expected = engines
    prompts, images = _batch(family)
    outs, done = _run_with(speculating, OracleProposer(_references(expected), lambda step: 0), prompts, images, _greedy(MAX_TOKENS))
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert done["spec_accepted_tokens"] == 0 and done["spec_backoff_steps"] > 0
    # 19 decode steps a request: verify at 1-2, 5-6, 11-12, paused 3-4, 7-10 and 13-19
    assert done["spec_verify_steps"] == 6 * len(prompts) and done["spec_backoff_steps"] == 13 * len(prompts)


def _async_twin(reference: MMEngine) -> MMEngine:
    """A speculating engine like the `engines` fixture's, with async scheduling on (the step after a verify step
    is launched before the verify's outputs are detokenized and checked for stop strings and grammar ends)."""
    engine = MMEngine(reference.config.model, device="cpu", dtype="float32", max_model_len=256, block_size=8,
                      speculative_config=NGRAM, async_scheduling="on")
    assert engine.steps.async_scheduling
    return engine


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("engines", ["llava"], indirect=True)
def test_stops_inside_an_accepted_run_end_the_output_as_without_speculation(engines, async_on):
    """A stop token, a stop string and max_tokens falling inside a run of accepted drafts cut it there: the
    tokens, text, finish reasons and log-probabilities (the target's) are those of decoding without
    speculation."""
    family, reference, speculating, full = engines
    if async_on:
        speculating = _async_twin(reference)
    prompts, images = _batch(family)
    tokenizer = reference.tokenizer
    cases, many_prompts, many_images = [], [], []
    for prompt, image, out in zip(prompts, images, full):
        stop_text = tokenizer.decode(out.token_ids[9:11]).strip()
        params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[out.token_ids[6]], logprobs=2),
                  SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)]
        if stop_text:
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=[stop_text], logprobs=0))
        cases += params
        many_prompts += [prompt] * len(params)
        many_images += [image] * len(params)
    expected = reference.generate(many_prompts, images=many_images, sampling_params=cases, use_tqdm=False)
    oracle = OracleProposer(_references(full))
    previous = _with_proposer(speculating, oracle)
    try:
        outs = speculating.generate(many_prompts, images=many_images, sampling_params=cases, use_tqdm=False)
    finally:
        _with_proposer(speculating, previous)
    for out, want in zip(outs, expected):
        assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason)
        assert (out.logprobs is None) == (want.logprobs is None)
        for got, ref in zip(out.logprobs or [], want.logprobs or [], strict=True):
            assert got.token_id == ref.token_id and got.logprob == pytest.approx(ref.logprob, abs=1e-4)
            assert [t for t, _ in got.top] == [t for t, _ in ref.top]
    assert_books_consistent(speculating)


@pytest.mark.parametrize("engines", ["qwen3_5"], indirect=True)
def test_preempted_requests_keep_their_tokens_and_the_books_stay_consistent(engines):
    """Six prompts in 16 KV blocks of 4 tokens: requests are preempted between verify steps (with their
    drafts' blocks) and resume; each still gets its tokens."""
    family, reference, _, _ = engines
    prompt = FAMILY_CASES[family]
    prompts = [prompt(f"Question {i}: " + "say it again " * (i % 3), 0) for i in range(6)]
    expected = reference.generate(prompts, sampling_params=_greedy(10), use_tqdm=False)
    engine = MMEngine(reference.config.model, device="cpu", dtype="float32", max_model_len=256, block_size=4,
                      num_kv_blocks=16, enable_prefix_grouping=False, speculative_config=NGRAM)
    oracle = OracleProposer(_references(expected), lambda step: [None, 1][step % 2])
    _with_proposer(engine, oracle)
    outs = engine.generate(prompts, sampling_params=_greedy(10), use_tqdm=False)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    stats = engine.stats()
    # drafts that found no free blocks were dropped before anyone was preempted for them: fewer accepted
    assert stats["num_preemptions"] > 0 and 0 < stats["spec_accepted_tokens"] <= oracle.expected_accepted
    assert_books_consistent(engine)


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("engines", ["llava"], indirect=True)
def test_structured_output_checks_the_drafts_and_ends_where_the_grammar_does(engines, async_on):
    """Under a grammar the drafts it allows are verified with each row masked as the grammar stands after
    the drafts before it (and rolled back); the JSON and its tokens are those without speculation, and the
    grammar's end cuts a run as it would end the output."""
    from mmengine.sample.structured_output.params import StructuredOutputParams

    family, reference, speculating, _ = engines
    if async_on:
        speculating = _async_twin(reference)
    prompts, images = _batch(family)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "tags": {"type": "array", "items": {"enum": ["aa", "bb"]}, "maxItems": 4}},
              "required": ["name", "tags"]}
    params = SamplingParams(max_tokens=48, temperature=0, structured_output=StructuredOutputParams(json=schema))
    expected = reference.generate(prompts[:2], images=images[:2], sampling_params=params, use_tqdm=False)
    # the drafts run on past the JSON's end into an EOS the grammar allows there: the end must cut the run
    eos = min(reference.eos_token_ids)
    oracle = OracleProposer({prompt: answer + [eos] for prompt, answer in _references(expected).items()},
                            lambda step: [None, None, 1, 0][step % 4])
    outs, done = _run_with(speculating, oracle, prompts[:2], images[:2], params)
    for out, want in zip(outs, expected):
        assert (out.token_ids, out.text, out.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert done["spec_accepted_tokens"] > 0
    assert_books_consistent(speculating)


@pytest.mark.parametrize("engines", ["llava"], indirect=True)
def test_streams_carry_each_verify_steps_run(engines):
    """Through AsyncMMEngine (the server's engine), a verify step's kept run arrives as one delta: the
    deltas add up to the reference's tokens, text and log-probabilities, a stop string inside a run ends
    the stream there, and the stream is shorter than its tokens."""
    import asyncio

    from mmengine.engine.async_engine import AsyncMMEngine

    family, reference, speculating, expected = engines
    prompts, _ = _batch(family)
    stop_text = reference.tokenizer.decode(expected[0].token_ids[12:14]).strip()
    cases = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1),
             SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, stop=[stop_text])]
    want = reference.generate([prompts[0]] * 2, sampling_params=cases, use_tqdm=False)

    async def stream_all():
        async with AsyncMMEngine(speculating) as async_engine:
            results = []
            for params in cases:  # one at a time: each runs alone, its runs whole
                deltas = [d async for d in await async_engine.add_request(prompts[0], None, params)]
                results.append(deltas)
            return results

    previous = _with_proposer(speculating, OracleProposer(_references(expected)))
    try:
        streamed = asyncio.run(asyncio.wait_for(stream_all(), 120))
    finally:
        _with_proposer(speculating, previous)
    for deltas, reference_out in zip(streamed, want):
        assert [t for d in deltas for t in d.token_ids] == reference_out.token_ids
        assert "".join(d.text for d in deltas) == reference_out.text
        assert deltas[-1].finish_reason == reference_out.finish_reason
        assert len(deltas) < len(reference_out.token_ids) and any(len(d.token_ids) > 1 for d in deltas)
    logprobs = [entry for d in streamed[0] for entry in d.logprobs]
    assert [e.token_id for e in logprobs] == want[0].token_ids
    assert [e.logprob for e in logprobs] == pytest.approx([e.logprob for e in want[0].logprobs], abs=1e-4)


# -- sampling ------------------------------------------------------------------------------------------

def test_sampling_with_drafts_keeps_the_target_distribution(family_checkpoint):
    """Seeded sampling (temperature 1, top-k 3) of 600 requests whose second token is drafted as its most
    likely one: the three tokens' joint frequencies match the model's exact probabilities (a chi-square test;
    drafts accepted always or never would fail it by far). Seeds make it deterministic."""
    path = str(family_checkpoint("llava"))
    options = dict(device="cpu", dtype="float32", max_model_len=128)
    reference = MMEngine(path, **options)
    prompt = "USER: Tell me anything at all. ASSISTANT:"
    (first,) = reference.generate(prompt, sampling_params=SamplingParams(max_tokens=1, temperature=0, logprobs=3), use_tqdm=False)
    prompt_ids = list(first.prompt_token_ids)
    exact: dict[tuple[int, ...], dict[int, float]] = {(): _top3(first)}
    for depth in (1, 2):
        prefixes = [prefix + (token,) for prefix in exact if len(prefix) == depth - 1 for token in exact[prefix]]
        outs = reference.generate([{"prompt_token_ids": prompt_ids + list(p)} for p in prefixes],
                                  sampling_params=SamplingParams(max_tokens=1, temperature=0, logprobs=3), use_tqdm=False)
        exact.update({prefix: _top3(out) for prefix, out in zip(prefixes, outs)})

    class MostLikely:  # drafts: the most likely continuation
        def propose(self, request_id: str, token_ids: Sequence[int], max_drafts: int) -> list[int]:
            prefix, drafts = tuple(token_ids[len(prompt_ids):]), []
            while len(drafts) < min(2, max_drafts) and prefix in exact:
                best = max(exact[prefix], key=exact[prefix].get)
                drafts.append(best)
                prefix += (best,)
            return drafts

        def forget(self, request_id: str) -> None:
            pass

    speculating = MMEngine(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, max_num_seqs=256, **options)
    _with_proposer(speculating, MostLikely())
    n = 600  # three tokens each: the second drafted (verified with the third sampled after it), or not
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=seed, ignore_eos=True) for seed in range(n)]
    outs = speculating.generate([prompt] * n, sampling_params=params, use_tqdm=False)
    seen = Counter(tuple(out.token_ids[:3]) for out in outs)
    cells = {(a, b, c): exact[()][a] * exact[(a,)][b] * exact[(a, b)][c]
             for a in exact[()] for b in exact[(a,)] for c in exact[(a, b)]}
    assert set(seen) <= set(cells)
    chi2 = sum((seen[cell] - n * p) ** 2 / (n * p) for cell, p in cells.items())
    dof = len(cells) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)
    stats = speculating.stats()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    # a seed gives the same tokens again, whatever else is in the batch
    again = speculating.generate([prompt] * 40, sampling_params=params[100:140], use_tqdm=False)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs[100:140]]


def _top3(out) -> dict[int, float]:
    """The next token's distribution under top-k 3 at temperature 1: the three most likely, renormalised."""
    top = out.logprobs[0].top
    total = sum(math.exp(value) for _, value in top)
    return {token: math.exp(value) / total for token, value in top}


# -- the caches ----------------------------------------------------------------------------------------

def test_hybrid_prefix_hits_with_speculation_are_at_least_those_without(family_checkpoint):
    """Qwen3.5: a repeated prompt with a picture, then the next turn of the chat as token ids, compute no
    more with speculation (every step verifying accepted and rejected drafts) than without: rejected drafts
    leave no trace in the recurrent checkpoints, and the accepted runs' states are checkpointed as a
    decode's would be."""
    path = str(family_checkpoint("qwen3_5"))
    options = dict(device="cpu", dtype="float32", max_model_len=256, block_size=8)
    prompt = qwen_vl_prompt("What is here? Describe it at length.", 1)
    computed = {}
    answers = {}
    for name, spec in (("off", None), ("on", NGRAM)):
        engine = MMEngine(path, speculative_config=spec, **options)
        if spec is not None:
            _with_proposer(engine, OracleProposer(answers["off"], lambda step: [None, 1, 2][step % 3]))
        counts, outputs = [], []
        for _ in range(2):
            before = engine.stats()["prefill_tokens_computed"]
            (out,) = engine.generate(prompt, images=PICTURES[:1], sampling_params=_greedy(MAX_TOKENS), use_tqdm=False)
            counts.append(engine.stats()["prefill_tokens_computed"] - before)
            outputs.append(out)
        chat = list(outputs[0].prompt_token_ids[:1]) + [11] * 30  # a text-only chat: its first turn, then the next
        (turn,) = engine.generate({"prompt_token_ids": chat}, sampling_params=_greedy(MAX_TOKENS), use_tqdm=False)
        follow_up = {"prompt_token_ids": chat + turn.token_ids + [12] * 5}
        if spec is None:
            answers["off"] = _references(outputs[:1] + [turn])
        before = engine.stats()["prefill_tokens_computed"]
        (last,) = engine.generate(follow_up, sampling_params=_greedy(4), use_tqdm=False)
        counts.append(engine.stats()["prefill_tokens_computed"] - before)
        computed[name] = counts
        answers[name + "-tokens"] = [o.token_ids for o in outputs] + [turn.token_ids, last.token_ids]
        assert_books_consistent(engine)
    assert answers["on-tokens"] == answers["off-tokens"]
    repeat_on, repeat_off = computed["on"][1], computed["off"][1]
    assert repeat_on <= repeat_off <= 8  # a repeated prompt recomputes at most one block
    assert computed["on"][2] <= computed["off"][2] <= 5 + 8  # the next turn: its new tokens, at most a block more
