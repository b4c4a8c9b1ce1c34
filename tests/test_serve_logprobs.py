"""Logprobs in the OpenAI API: chat's `logprobs`/`top_logprobs` and completions' `logprobs=N`, equal to
log_softmax over transformers' logits (fp32 CPU) to 1e-4, top lists sorted and of the asked length,
the same streamed as whole."""

from __future__ import annotations

import openai
import pytest
import torch
from serve_helpers import MODEL_NAME, reference_server

from conftest import CPU_FP32, _hf_model
from mmengine import MMEngine
from mmengine.entrypoints.logprobs_format import token_text

PROMPT = "USER: tell me about the boats on the river ASSISTANT:"


@pytest.fixture(scope="module")
def served(checkpoint_dir):
    path = checkpoint_dir()
    with reference_server(path) as (engine, running, client):
        yield path, engine, client


def _reference(path, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at each generated position [len(output_ids), vocab]."""
    model, processor = _hf_model(path, CPU_FP32)
    ids = torch.tensor([prompt_ids + output_ids[:-1]])
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    return logits[-len(output_ids):].float().log_softmax(-1)


def _token(engine: MMEngine, token_id: int) -> str:
    return token_text(engine.grammars.tokenizer.decode_bytes([token_id]))  # "bytes:\\xNN" for part of a character


def test_completion_logprobs_equal_transformers(served):
    path, engine, client = served
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0.7, seed=5, logprobs=3,
                                       extra_body={"ignore_eos": True})
    logprobs = answer.choices[0].logprobs
    prompt_ids = engine.tokenizer(PROMPT)["input_ids"]
    # the ids behind the strings: the same seeded request offline
    from mmengine import SamplingParams

    (offline,) = engine.generate(PROMPT, sampling_params=SamplingParams(max_tokens=6, temperature=0.7, seed=5, ignore_eos=True),
                                 use_tqdm=False)
    expected = _reference(path, prompt_ids, offline.token_ids)
    assert logprobs.tokens == [_token(engine, t) for t in offline.token_ids]
    if not any(t.startswith("bytes:") for t in logprobs.tokens):
        assert "".join(logprobs.tokens) == answer.choices[0].text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    for position, token_id in enumerate(offline.token_ids):
        assert logprobs.token_logprobs[position] == pytest.approx(expected[position, token_id].item(), abs=1e-4)
        best = expected[position].topk(3)
        top = logprobs.top_logprobs[position]
        assert len(top) in (3, 4)  # the 3 best, and the sampled token when it is not among them
        for token_id_best, value in zip(best.indices.tolist(), best.values.tolist()):
            assert top[_token(engine, token_id_best)] == pytest.approx(value, abs=1e-4)


def test_chat_logprobs_streamed_equal_whole_and_are_sorted(served):
    _, engine, client = served
    ask = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me about boats."}], max_tokens=5, temperature=0,
               logprobs=True, top_logprobs=4, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**ask).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **ask):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    # equal tokens; values to fp32 rounding (the second request reads the first's cached prefix)
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [(e.token, [t.token for t in e.top_logprobs]) for e in whole]
    assert [t.logprob for e in streamed for t in e.top_logprobs] == pytest.approx(
        [t.logprob for e in whole for t in e.top_logprobs], abs=1e-4)
    assert len(whole) == 5
    for entry in whole:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert entry.logprob == values[0] and entry.token == entry.top_logprobs[0].token  # greedy takes the best
        assert token_text(bytes(entry.bytes)) == entry.token
    plain = client.chat.completions.create(**{**ask, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_prompt_logprobs_extra_on_completions_and_chat(served):
    path, engine, client = served
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0,
                                       extra_body={"prompt_logprobs": 2})
    entries = answer.choices[0].model_extra["prompt_logprobs"]
    prompt_ids = engine.tokenizer(PROMPT)["input_ids"]
    model, _ = _hf_model(path, CPU_FP32)
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([prompt_ids])).logits[0].float().log_softmax(-1)
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for position in range(1, len(prompt_ids)):
        token = prompt_ids[position]
        entry = entries[position]
        assert entry[str(token)]["logprob"] == pytest.approx(expected[position - 1, token].item(), abs=1e-4)
        best = expected[position - 1].topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in best] == [1, 2]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="cannot stream"):
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})


def test_logprobs_need_no_grammar_engine_and_a_grammar_it_cannot_serve_is_a_400(checkpoint_dir, monkeypatch):
    """A tokenizer the grammar engine cannot read (llguidance refuses WordPiece decoders): logprobs still
    answer, with each token's text from the tokenizer itself; a request that needs a grammar is a 400
    naming why, never a 500."""
    from mmengine import SamplingParams
    from mmengine.errors import UnsupportedModelError
    from mmengine.sample.structured_output.grammar import GrammarCompiler

    def unreadable(self):
        raise UnsupportedModelError("structured output cannot use this tokenizer: llguidance says it has no byte decoder")

    monkeypatch.setattr(GrammarCompiler, "tokenizer", property(unreadable))
    with reference_server(checkpoint_dir()) as (engine, _, client):
        answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True, "prompt_logprobs": 1})
        (offline,) = engine.generate(PROMPT, sampling_params=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                                     use_tqdm=False)
        decode = engine.tokenizer.decode
        expected = [decode([t], skip_special_tokens=False, clean_up_tokenization_spaces=False) for t in offline.token_ids]
        assert answer.choices[0].logprobs.tokens == expected
        assert all(len(top) == 2 for top in answer.choices[0].logprobs.top_logprobs)
        chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                              logprobs=True, top_logprobs=2)
        assert len(chat.choices[0].logprobs.content) == chat.usage.completion_tokens
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           response_format={"type": "json_object"})
        assert refused.value.status_code == 400 and "cannot use this tokenizer" in refused.value.message
        assert refused.value.body["param"] == "response_format"
