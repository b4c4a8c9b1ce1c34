"""`echo` on /v1/completions, as lm-eval's `local-completions` scores loglikelihood requests with it
(`echo=True, logprobs=1, max_tokens=1, temperature=0`; `token_logprobs[ctxlen:-1]` summed): the prompt's
tokens lead the legacy logprobs (the first with a null logprob), each prompt token's log-probability equals
transformers' log_softmax over the tokens before it (fp32 CPU, 1e-4), prompts as text and as token ids,
`max_tokens` 0 (the prompt alone) and 1. Combinations not served are 400s naming the field.

The exact HTTP request lm-eval's `local-completions` sends, and its parsing of the answer, are checked
here; lm-eval itself (in the `test` extra) also runs a multiple-choice task of its own on a dataset written
here against the server and scores each choice as transformers does."""

from __future__ import annotations

import json

import httpx
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
        yield path, engine, running, client


def _log_softmax(path, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax after each position of `ids` [len(ids), vocab]."""
    model, _ = _hf_model(path, CPU_FP32)
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _token(engine: MMEngine, token_id: int) -> str:
    return token_text(engine.grammars.tokenizer.decode_bytes([token_id]))


@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("form", ["text", "token ids"])
@pytest.mark.parametrize("top", [1, 3])
def test_echoed_logprobs_equal_transformers(served, form, max_tokens, top):
    path, engine, _, client = served
    ids = engine.tokenizer(PROMPT)["input_ids"]
    prompt = PROMPT if form == "text" else ids
    answer = client.completions.create(model=MODEL_NAME, prompt=prompt, echo=True, logprobs=top, max_tokens=max_tokens,
                                       temperature=0)
    (choice,) = answer.choices
    expected = _log_softmax(path, ids)
    generated = [int(expected[-1].argmax())] if max_tokens else []  # greedy
    echoed = PROMPT if form == "text" else engine.tokenizer.decode(ids)
    assert choice.text == echoed + engine.tokenizer.decode(generated)
    logprobs = choice.logprobs
    assert logprobs.tokens == [_token(engine, t) for t in ids + generated]
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts the first token
    assert len(logprobs.token_logprobs) == len(ids) + max_tokens
    for position, token in enumerate((ids + generated)[1:], start=1):
        row = expected[position - 1]
        assert logprobs.token_logprobs[position] == pytest.approx(row[token].item(), abs=1e-4)
        best = row.topk(top)
        shown = logprobs.top_logprobs[position]
        assert len(shown) in (top, top + 1)  # the best, and the token itself when it is not among them
        assert shown[_token(engine, token)] == pytest.approx(row[token].item(), abs=1e-4)
        for best_token, value in zip(best.indices.tolist(), best.values.tolist()):
            assert shown[_token(engine, best_token)] == pytest.approx(value, abs=1e-4)
    assert choice.finish_reason == "length"
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == max_tokens


def _loglikelihood(path, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """transformers' log-probability of `continuation` after `context`, and whether it is the greedy one."""
    rows = _log_softmax(path, context + continuation)[len(context) - 1 : -1]
    picked = rows[torch.arange(len(continuation)), torch.tensor(continuation)]
    return picked.sum().item(), bool((rows.argmax(-1) == torch.tensor(continuation)).all())


def test_the_request_lm_eval_sends(served):
    """lm-eval 0.4's `local-completions` loglikelihood request, byte for byte in its fields: a batch of token-id
    prompts (context + continuation, no BOS by default), and its parse_logprobs: sum(token_logprobs[ctxlen:-1]),
    greedy when each equals the best of its top_logprobs."""
    path, engine, running, _ = served
    tokenizer = engine.tokenizer
    context = tokenizer.encode("Question: which boat floats? Answer:", add_special_tokens=False)
    continuations = [tokenizer.encode(" the red one", add_special_tokens=False), tokenizer.encode(" none", add_special_tokens=False)]
    prompts = [context + continuation for continuation in continuations]
    payload = {"model": MODEL_NAME, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    response = httpx.post(running.v1 + "/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for choice, prompt, continuation in zip(choices, prompts, continuations):
        ctxlen = len(context)
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        assert len(token_logprobs) == len(continuation) and len(choice["logprobs"]["tokens"]) == len(prompt) + 1
        expected, greedy = _loglikelihood(path, context, continuation)
        assert sum(token_logprobs) == pytest.approx(expected, abs=1e-3)
        assert all(value == max(top.values()) for value, top in zip(token_logprobs, tops)) == greedy


def test_echo_without_logprobs_streams_and_generates(served):
    """echo without logprobs: streamed (each choice's first chunk carries the prompt), and with generated
    tokens after it; the prompt_logprobs extra keeps its own k beside echo's logprobs."""
    path, engine, _, client = served
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "USER: hi"], echo=True, max_tokens=0, n=2,
                                            stream=True, stream_options={"include_usage": True}))
    texts = ["", "", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [PROMPT, PROMPT, "USER: hi", "USER: hi"]
    assert chunks[-1].usage.completion_tokens == 0
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, echo=True, max_tokens=3, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True, "prompt_logprobs": 1})
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
    (choice,) = whole.choices
    assert choice.text == PROMPT + plain.choices[0].text
    num_prompt = whole.usage.prompt_tokens
    assert choice.logprobs.tokens[num_prompt:] == plain.choices[0].logprobs.tokens
    assert choice.logprobs.token_logprobs[num_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert all(len(top) in (2, 3) for top in choice.logprobs.top_logprobs[1:])
    extra = choice.model_extra["prompt_logprobs"]
    assert extra[0] is None and all(len(entry) in (1, 2) for entry in extra[1:])  # its own k: 1 (+ the token itself)


@pytest.mark.parametrize("body, param", [
    ({"echo": True, "logprobs": 1, "stream": True}, "echo"),
    ({"echo": True, "n": 2, "use_beam_search": True}, "echo"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "suffix": "!"}, "suffix"),
])
def test_what_echo_does_not_serve_is_refused_by_name(served, body, param):
    _, _, running, _ = served
    response = httpx.post(running.v1 + "/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, **body},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


QUESTIONS = [
    {"question": "The boat on the river is", "choices": ["red", "a small green boat", "blue"], "answer": 0},
    {"question": "USER: how many sails? ASSISTANT:", "choices": ["two", "none at all", "three"], "answer": 2},
]


def test_an_lm_eval_multiple_choice_task_runs_against_the_server(served, tmp_path):
    """lm-eval's own `local-completions` model on a multiple-choice task whose dataset is written here (no
    download): every choice's loglikelihood is transformers', and acc follows from them."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    path, engine, running, _ = served
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "echo_mc.yaml").write_text(
        "task: mmengine_echo_mc\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {tmp_path / 'datasets'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_choice: choices\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n"
    )
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL_NAME, "base_url": running.v1 + "/completions", "tokenizer": str(path),
                    "tokenizer_backend": "huggingface", "max_retries": 1, "num_concurrent": 1},
        tasks=["mmengine_echo_mc"], task_manager=TaskManager(include_path=str(tasks), include_defaults=False), log_samples=True, bootstrap_iters=0,
    )
    samples = results["samples"]["mmengine_echo_mc"]
    assert len(samples) == len(QUESTIONS)
    tokenizer = engine.tokenizer
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        context = tokenizer.encode(doc["question"], add_special_tokens=False)
        scores = []
        for choice, (loglikelihood, greedy) in zip(doc["choices"], (r[0] for r in sample["resps"])):
            whole = tokenizer.encode(doc["question"] + " " + choice, add_special_tokens=False)  # lm-eval's target_delimiter
            expected, expected_greedy = _loglikelihood(path, context, whole[len(context):])
            assert loglikelihood == pytest.approx(expected, abs=1e-3) and greedy == expected_greedy
            scores.append(loglikelihood)
        correct += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    assert results["results"]["mmengine_echo_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))
