"""Where a served chat's images and template come from: file:// URLs only under the allowed directory,
http(s) URLs only when fetching is enabled, and the model's chat template or --chat-template's (a
chat without either is a 400 that says so)."""

from __future__ import annotations

import functools
import http.server
import shutil
import threading

import httpx
import pytest
from serve_helpers import MODEL_NAME, data_url, image_part, running_server

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.errors import InvalidInputError
from mmengine.entrypoints.media import MediaPolicy
from mmengine.testing import CHAT_TEMPLATE, make_test_image

IMAGE = make_test_image(301)


def _chat(url: str) -> dict:
    return {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": [image_part(url), {"type": "text", "text": "What is it?"}]}]}


def _post(server, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + "/chat/completions", json=body, timeout=60)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    IMAGE.save(root / "allowed" / "picture.png")
    IMAGE.save(root / "outside.png")
    (root / "allowed" / "escape.png").symlink_to(root / "outside.png")
    return root


@pytest.fixture(scope="module")
def image_host(media_dir):
    """A loopback HTTP server for the image files (the only network a test may use)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dir / "allowed"))
    handler.log_message = lambda *args: None
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def server(checkpoint_dir, media_dir):
    policy = MediaPolicy(allowed_local_media_path=(media_dir / "allowed").resolve(), allow_remote_media=True)
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME, media=policy)) as running:
        yield running


def test_file_and_http_urls_give_the_data_url_answer(server, media_dir, image_host):
    expected = _post(server, _chat(data_url(IMAGE))).json()["choices"][0]["message"]["content"]
    for url in (f"file://{media_dir / 'allowed' / 'picture.png'}", f"{image_host}/picture.png"):
        response = _post(server, _chat(url))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == expected


@pytest.mark.parametrize(("where", "code"), [
    ("outside.png", "local_media_forbidden"),
    ("allowed/escape.png", "local_media_forbidden"),  # a symlink out of the directory
    ("allowed/missing.png", "invalid_image_url"),
])
def test_local_files_outside_the_allowed_directory_are_refused(server, media_dir, where, code):
    response = _post(server, _chat(f"file://{media_dir / where}"))
    assert response.status_code == 400 and response.json()["error"]["code"] == code


def test_a_failed_fetch_is_a_400(server, image_host):
    response = _post(server, _chat(f"{image_host}/missing.png"))
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "remote_media_failed" and "404" in error["message"]


def test_a_chat_needs_a_template(checkpoint_dir, tmp_path):
    bare = tmp_path / "no-template"
    shutil.copytree(checkpoint_dir(), bare)
    (bare / "chat_template.jinja").unlink()
    engine = MMEngine(str(bare), max_model_len=256)
    with pytest.raises(InvalidInputError, match="no chat template"):  # offline chat() says so too
        engine.chat([{"role": "user", "content": "hi"}])
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME)) as server:
        refused = _post(server, _chat(data_url(IMAGE)))
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "missing_chat_template" and "--chat-template" in error["message"]
        completion = httpx.post(server.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "USER: hi ASSISTANT:",
                                                                  "max_tokens": 3}, timeout=60)
        assert completion.status_code == 200  # raw prompts need no template
    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME, chat_template=CHAT_TEMPLATE)) as server:
        answer = _post(server, _chat(data_url(IMAGE)))
        assert answer.status_code == 200
    (expected,) = MMEngine(str(checkpoint_dir()), max_model_len=256).chat(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}], images=[IMAGE],
        sampling_params=SamplingParams(max_tokens=6, temperature=0), use_tqdm=False,
    )
    assert answer.json()["choices"][0]["message"]["content"] == expected.text
