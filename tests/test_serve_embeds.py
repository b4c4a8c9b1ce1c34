"""image_embeds content parts through `mmengine serve --enable-mm-embeds`: the answer equals the offline
engine's for the same embeddings; without the flag, and for every untrusted payload that is not a
dense floating-point tensor (pickled objects, sparse tensors, integers, bad base64, too large), a 400."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch
from serve_helpers import MODEL_NAME, running_server

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings

OPTIONS = {"max_model_len": 256, "device": "cpu", "dtype": "float32"}
QUESTION = "What is in the picture?"


def _b64(obj) -> str:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def _messages(payload) -> list:
    return [{"role": "user", "content": [{"type": "image_embeds", "image_embeds": payload}, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def embeds() -> torch.Tensor:
    return torch.randn(16, 64, generator=torch.Generator().manual_seed(3)) / 10  # the tiny LLaVA: 16 tokens of 64


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), **OPTIONS)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME, enable_mm_embeds=True)) as running:
        yield running


def test_embeddings_answer_as_offline(server, checkpoint_dir, embeds):
    client = openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model=MODEL_NAME, messages=_messages(_b64(embeds)), max_tokens=6, temperature=0,
                                            extra_body={"ignore_eos": True})
    offline = MMEngine(str(checkpoint_dir()), **OPTIONS)
    (expected,) = offline.chat([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}],
                               images=[{"image_embeds": embeds}], sampling_params=SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                               use_tqdm=False)
    assert answer.choices[0].message.content == expected.text
    dict_form = client.chat.completions.create(model=MODEL_NAME, messages=_messages({"image_embeds": _b64(embeds)}), max_tokens=6,
                                               temperature=0, extra_body={"ignore_eos": True})
    assert dict_form.choices[0].message.content == expected.text
    assert server.metrics()["mmengine_encoder_runs_total"] == 0


class NotATensor:
    pass


@pytest.mark.parametrize("payload,match", [
    ("not base64 !!", "not valid base64"),
    (base64.b64encode(b"garbage").decode(), "not a tensor saved with torch.save"),
    ("PICKLED", "not a tensor saved with torch.save"),
    ("SPARSE", "dense"),
    ("INTEGER", "floating-point"),
    ("EXTRA_KEYS", "exactly 'image_embeds'"),
    ("x" * (90 * 1024 * 1024), "larger than"),
])
def test_untrusted_payloads_are_refused(server, payload, match):
    payload = {
        "PICKLED": lambda: _b64({"image_embeds": NotATensor()}),
        "SPARSE": lambda: _b64(torch.sparse_coo_tensor(torch.tensor([[0], [0]]), torch.tensor([1.0]), (16, 64))),
        "INTEGER": lambda: _b64(torch.zeros(16, 64, dtype=torch.int64)),
        "EXTRA_KEYS": lambda: _b64({"image_embeds": torch.zeros(16, 64), "code": torch.zeros(1)}),
    }.get(payload, lambda: payload)()
    answer = httpx.post(server.v1 + "/chat/completions", json={"model": MODEL_NAME, "messages": _messages(payload)}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert match in answer.json()["error"]["message"] and answer.json()["error"]["code"] == "invalid_image_embeds"


def test_embeddings_are_off_without_the_flag(checkpoint_dir, embeds):
    engine = MMEngine(str(checkpoint_dir()), **OPTIONS)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME)) as running:
        answer = httpx.post(running.v1 + "/chat/completions", json={"model": MODEL_NAME, "messages": _messages(_b64(embeds))}, timeout=60)
    assert answer.status_code == 400 and "--enable-mm-embeds" in answer.json()["error"]["message"]
