"""Served videos: the openai client sends a video_url (a data: URL or an allowed file), then a second
question about the same clip, which reuses its cached KV blocks and encoder outputs; bad video URLs
are 400s that name the video."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest
from serve_helpers import API_KEY, MODEL_NAME, running_server

from mmengine import MMEngine
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.entrypoints.media import MediaPolicy
from test_video import clip
from test_video_inputs import encode_mp4

MP4 = encode_mp4(clip(12, 48, 64))
DATA_URL = "data:video/mp4;base64," + base64.b64encode(MP4).decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    (root / "clip.mp4").write_bytes(MP4)
    return root


@pytest.fixture(scope="module")
def server(family_checkpoint, media_dir):
    engine = MMEngine(str(family_checkpoint("qwen2_5_vl")), dtype="float32", device="cpu", max_model_len=1024)
    settings = ServerSettings(MODEL_NAME, api_key=API_KEY, media=MediaPolicy(allowed_local_media_path=media_dir.resolve()))
    with running_server(AsyncMMEngine(engine), settings) as running:
        yield running


def _ask(client: openai.OpenAI, url: str, question: str):
    return client.chat.completions.create(
        model=MODEL_NAME, max_tokens=5, temperature=0,
        messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                               {"type": "text", "text": question}]}],
    )


def test_a_second_question_about_a_clip_reuses_its_cache(server, media_dir):
    with openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=60) as client:
        first = _ask(client, DATA_URL, "What happens in this clip?")
        runs = server.async_engine.engine.stats()["encoder_runs"]
        second = _ask(client, f"file://{media_dir / 'clip.mp4'}", "What happens in this clip, again?")
    assert first.choices[0].message.content is not None
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert server.async_engine.engine.stats()["encoder_runs"] == runs  # the clip was not encoded again


@pytest.mark.parametrize(("url", "code", "words"), [
    ("data:video/mp4;base64,bm90IGEgdmlkZW8=", "unsupported_media_container", "video 0: the data is not an accepted video"),
    # ffconcat naming a file beside the server's: refused before FFmpeg sees it
    ("data:video/mp4;base64,ZmZjb25jYXQgdmVyc2lvbiAxLjAKZmlsZSBjbGlwLm1wNAo=", "unsupported_media_container", "video 0: the data is not an accepted video"),
    ("data:image/png;base64,AAAA", "invalid_video_url", "video 0: a data: URL of type 'image/png' is not a video"),
    ("http://example.com/clip.mp4", "remote_media_disabled", "http(s) video URLs are not fetched"),
    ("file:///etc/passwd", "local_media_forbidden", "outside the allowed local media directory"),
])
def test_bad_video_urls_are_400s_naming_the_video(server, url, code, words):
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "?"}]}]}
    response = httpx.post(server.v1 + "/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and words in error["message"]
