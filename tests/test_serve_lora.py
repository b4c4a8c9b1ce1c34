"""LoRA through `mmengine serve`: the `openai` client selects an adapter by `model`, answers equal the
offline engine's under the same adapter, /v1/models lists adapters with their base as parent,
adapters load and unload at run time, and bad adapter requests get typed HTTP errors."""

from __future__ import annotations

import httpx
import openai
import pytest
from serve_helpers import MODEL_NAME, data_url, image_part, running_server

from mmengine import LoRARequest, MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.testing import make_test_image

OPTIONS = {"max_model_len": 512, "device": "cpu", "dtype": "float32", "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
PICTURE = make_test_image(77, size=(64, 48))
QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def adapters(lora_adapters):
    return lora_adapters("llava")


@pytest.fixture(scope="module")
def server(checkpoint_dir, adapters):
    engine = MMEngine(str(checkpoint_dir()), **OPTIONS)
    settings = ServerSettings(MODEL_NAME, lora_modules={"qv4": str(adapters["qv4"])}, lora_runtime_updates=True)
    with running_server(AsyncMMEngine(engine), settings) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def _ask(client, model: str) -> str:
    answer = client.chat.completions.create(
        model=model, max_tokens=8, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [image_part(data_url(PICTURE)), {"type": "text", "text": QUESTION}]}],
    )
    assert answer.model == model
    return answer.choices[0].message.content


def _offline(checkpoint_dir, lora) -> str:
    engine = MMEngine(str(checkpoint_dir()), **OPTIONS)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    (out,) = engine.chat(messages, images=[PICTURE], sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                         lora=lora, use_tqdm=False)
    return out.text


def test_the_model_field_selects_the_adapter(client, checkpoint_dir, adapters):
    with_adapter, base = _ask(client, "qv4"), _ask(client, MODEL_NAME)
    assert with_adapter == _offline(checkpoint_dir, LoRARequest("qv4", str(adapters["qv4"])))
    assert base == _offline(checkpoint_dir, None) and base != with_adapter


def test_models_lists_adapters_with_their_parent(server, adapters):
    cards = {card["id"]: card for card in httpx.get(server.v1 + "/models", timeout=30).json()["data"]}
    assert cards[MODEL_NAME]["parent"] is None
    assert cards["qv4"]["parent"] == MODEL_NAME and cards["qv4"]["root"] == str(adapters["qv4"])


def test_an_unknown_model_or_adapter_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        _ask(client, "no-such-adapter")
    assert err.value.body["code"] == "model_not_found" and "no-such-adapter" in err.value.body["message"]


def test_adapters_load_and_unload_at_run_time(server, client, adapters, tmp_path):
    post = lambda path, body: httpx.post(server.v1 + path, json=body, timeout=60)  # noqa: E731
    loaded = post("/load_lora_adapter", {"lora_name": "all8", "lora_path": str(adapters["all8"])})
    assert loaded.status_code == 200, loaded.text
    assert _ask(client, "all8") != _ask(client, MODEL_NAME)
    again = post("/load_lora_adapter", {"lora_name": "all8", "lora_path": str(adapters["all8"])})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    assert post("/unload_lora_adapter", {"lora_name": "all8"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _ask(client, "all8")
    missing = post("/unload_lora_adapter", {"lora_name": "all8"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    broken = post("/load_lora_adapter", {"lora_name": "broken", "lora_path": str(tmp_path)})
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_adapter"
    assert "adapter_config.json is missing" in broken.json()["error"]["message"]
    named_as_base = post("/load_lora_adapter", {"lora_name": MODEL_NAME, "lora_path": str(adapters["mlp2"])})
    assert named_as_base.status_code == 400
    assert server.wait_until_idle()["mmengine_kv_blocks_free"] == server.metrics()["mmengine_kv_blocks_total"]


def test_runtime_updates_are_off_unless_asked_for(checkpoint_dir):
    engine = MMEngine(str(checkpoint_dir()), **OPTIONS)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME)) as running:
        answer = httpx.post(running.v1 + "/load_lora_adapter", json={"lora_name": "x", "lora_path": "/tmp"}, timeout=30)
        assert answer.status_code == 404
