"""Video inputs through the public API: files and bytes decoded with PyAV, the same clip given as
frames, prompt dicts and chat parts; and bad input (corrupt, truncated, too long, too large, the wrong
count, a model without videos) refused with a typed error naming the video, the engine serving on."""

from __future__ import annotations

import io
import os
import tempfile

import av
import numpy as np
import pytest

from mmengine import MMEngine, SamplingParams
from mmengine.errors import (
    CorruptVideoError,
    InvalidInputError,
    ItemTooLargeError,
    TooManyVideosError,
    VideoCountMismatchError,
    UnsupportedContainerError,
    VideoTooLargeError,
)
from mmengine.multimodal.video import Video
from hostile_media import hostile_payloads
from test_video import VIDEO, chat, clip

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
PROMPT = chat(VIDEO + "What happens?")


def encode_mp4(frames: np.ndarray, rate: int = 4, faststart: bool = False) -> bytes:
    """An MPEG-4 Part 2 clip (every PyAV wheel carries that encoder); `faststart` puts the index (and its
    frame count) before the frames, so a cut file still announces every frame."""
    if faststart:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "clip.mp4")
            _encode(av.open(path, mode="w", options={"movflags": "faststart"}), frames, rate)
            with open(path, "rb") as file:
                return file.read()
    out = io.BytesIO()
    _encode(av.open(out, mode="w", format="mp4"), frames, rate)
    return out.getvalue()


def _encode(container, frames: np.ndarray, rate: int) -> None:
    with container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def decoded_frames(data: bytes) -> np.ndarray:
    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


@pytest.fixture(scope="module")
def engine(family_checkpoint):
    return MMEngine(str(family_checkpoint("qwen2_5_vl")), dtype="float32", device="cpu",
                    limit_mm_per_prompt={"image": 1, "video": 2}, max_video_seconds=30)


@pytest.fixture(scope="module")
def mp4():
    return encode_mp4(clip(16, 48, 64))


def answer(engine: MMEngine, prompt, **kwargs) -> list[int]:
    return list(engine.generate(prompt, sampling_params=GREEDY, use_tqdm=False, **kwargs)[0].token_ids)


def test_a_file_bytes_and_its_decoded_frames_give_one_answer(engine, tmp_path):
    mp4 = encode_mp4(clip(16, 48, 64, seed=5))  # a clip no other test gives this engine
    path = tmp_path / "clip.mp4"
    path.write_bytes(mp4)
    before = engine.stats()["videos_decoded"]
    from_file = answer(engine, PROMPT, videos=[str(path)])
    from_bytes = answer(engine, PROMPT, videos=[mp4])
    # 16 frames at 4 frames/s, sampled at the checkpoint's 2 frames/s: the same frames, given decoded
    from_frames = answer(engine, PROMPT, videos=[Video(decoded_frames(mp4), fps=2.0, frame_rate=4.0)])
    assert from_file == from_bytes == from_frames
    assert engine.stats()["videos_decoded"] - before == 1  # the same bytes again: the processor cache's


def test_prompt_dicts_and_chat_parts_take_videos(engine, mp4):
    expected = answer(engine, PROMPT, videos=[mp4])
    assert answer(engine, {"prompt": PROMPT, "multi_modal_data": {"video": mp4}}) == expected
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]}]
    out = engine.chat(messages, videos=[mp4], sampling_params=GREEDY, use_tqdm=False)
    assert list(out[0].token_ids) == expected
    # an OpenAI video_url part (a data: URL), as the server takes it
    import base64

    url = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    parts = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": "What happens?"}]}]
    assert list(engine.chat(parts, sampling_params=GREEDY, use_tqdm=False)[0].token_ids) == expected


def test_a_batch_mixes_videos_images_and_text(engine, mp4):
    prompts = [PROMPT, chat("just text"), chat(VIDEO + "again?"), PROMPT]
    outs = engine.generate(prompts, videos=[[mp4], None, [clip(4)], [mp4]], sampling_params=GREEDY, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [4] * 4
    assert outs[0].token_ids == outs[3].token_ids


@pytest.mark.parametrize(
    "bad, error, words",
    [
        (b"not a video at all", UnsupportedContainerError, "video 0: the data is not an accepted video container"),
        (hostile_payloads("clip.mp4", 45678)["ffconcat"], UnsupportedContainerError, "video 0: the data is not an accepted video"),
        (hostile_payloads("clip.mp4", 45678)["hls"], UnsupportedContainerError, "video 0: the data is not an accepted video"),
        ("cut", CorruptVideoError, "video 0: cannot decode"),  # the index is at the end: the container is unreadable
        ("truncated", CorruptVideoError, "video 0: truncated: the container announces 16 frames but holds"),
        ("/nonexistent/clip.mp4", CorruptVideoError, "cannot read"),
        ("long", VideoTooLargeError, "exceeds max_video_seconds=30"),
        (np.zeros((4, 10, 10), np.uint8), InvalidInputError, "uint8 [frames, height, width, 3]"),
        (Video(clip(4), fps=1.0, num_frames=4), InvalidInputError, "exclusive"),
        (Video(clip(4), num_frames=10**9), InvalidInputError, "video 0: num_frames=1000000000 exceeds the video processor's max_frames=64"),
        (Video(clip(4), max_pixels=10**7, min_pixels=10**7), ItemTooLargeError, "video 0: each temporal patch becomes"),
    ],
    ids=["garbage", "ffconcat", "hls", "cut", "truncated", "missing-file", "too-long", "bad-array", "fps-and-num-frames", "num-frames-bomb",
         "too-many-tokens"],
)
def test_bad_videos_are_refused_by_name_and_the_engine_serves_on(engine, mp4, bad, error, words):
    if isinstance(bad, str) and bad == "cut":
        bad = mp4[: len(mp4) // 2]
    elif isinstance(bad, str) and bad == "truncated":
        whole = encode_mp4(clip(16, 48, 64), faststart=True)
        bad = whole[: len(whole) * 6 // 10]
    elif isinstance(bad, str) and bad == "long":
        bad = encode_mp4(clip(62, 16, 16), rate=2)  # 31 seconds
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        engine.generate(PROMPT, videos=[bad], sampling_params=GREEDY, use_tqdm=False)
    assert len(answer(engine, PROMPT, videos=[clip(4)])) == 4


def test_frames_larger_than_max_image_pixels_are_refused_before_decoding(family_checkpoint, mp4):
    small = MMEngine(str(family_checkpoint("qwen2_vl")), dtype="float32", device="cpu", max_image_pixels=1000)
    with pytest.raises(VideoTooLargeError, match="64x48 = 3072 pixels exceed max_image_pixels=1000"):
        small.generate(PROMPT, videos=[mp4], sampling_params=GREEDY, use_tqdm=False)
    assert small.stats()["videos_decoded"] == 0


def test_marker_counts_and_limits(engine):
    with pytest.raises(VideoCountMismatchError, match="1 <|video_pad|> marker"):
        engine.generate(PROMPT, videos=[clip(2), clip(2)], sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(VideoCountMismatchError, match="no video was given"):
        engine.generate(PROMPT, sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(TooManyVideosError, match="at most 2"):
        engine.generate(chat(VIDEO * 3), videos=[clip(2)] * 3, sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="bare"):
        engine.generate(PROMPT, videos=clip(2), sampling_params=GREEDY, use_tqdm=False)


def test_a_model_without_videos_says_so(family_checkpoint):
    llava = MMEngine(str(family_checkpoint("llava")), dtype="float32", device="cpu")
    with pytest.raises(InvalidInputError, match="takes no videos"):
        llava.generate("USER: hi ASSISTANT:", videos=[clip(2)], sampling_params=GREEDY, use_tqdm=False)


def test_a_uuid_names_a_video_without_reading_it_again(engine, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(encode_mp4(clip(8, 48, 64, seed=9)))
    first = answer(engine, PROMPT, videos=[Video(str(path), uuid="clip-9")])
    before = engine.stats()
    path.unlink()  # a known id reads nothing: the file is not even opened
    assert answer(engine, PROMPT, videos=[Video(str(path), uuid="clip-9")]) == first
    after = engine.stats()
    assert (after["videos_preprocessed"], after["videos_decoded"]) == (before["videos_preprocessed"], before["videos_decoded"])


def test_a_ray_replica_row_carries_videos(family_checkpoint, mp4):
    """The replica a Ray batch or Serve deployment runs (here without Ray) answers rows with a videos column."""
    from mmengine.ray.replica import EngineReplica

    replica = EngineReplica(str(family_checkpoint("qwen2_5_vl")), {"dtype": "float32", "device": "cpu"}, replica_id=0)
    rows = [{"prompt": PROMPT, "videos": [mp4], "sampling_params": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}},
            {"prompt": chat("text only"), "sampling_params": {"max_tokens": 2}}]
    out = replica.generate(rows)
    expected = answer(MMEngine(str(family_checkpoint("qwen2_5_vl")), dtype="float32", device="cpu"), PROMPT, videos=[mp4])
    assert out[0]["token_ids"] == expected and len(out[1]["token_ids"]) == 2


def test_mm_uuids_by_modality_name_videos(engine):
    frames = clip(6, seed=11)
    first = answer(engine, PROMPT, videos=[frames], mm_uuids={"video": ["clip-11"]})
    before = engine.stats()["videos_preprocessed"]
    assert answer(engine, PROMPT, videos=[frames.copy()], mm_uuids={"image": [], "video": ["clip-11"]}) == first
    assert engine.stats()["videos_preprocessed"] == before  # the id stands for the clip: nothing read again
    with pytest.raises(InvalidInputError, match="mm_uuids has 2 entries for 1 video"):
        engine.generate(PROMPT, videos=[frames], mm_uuids={"video": ["a", "b"]}, sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="unknown modalities \\['audio'\\]"):
        engine.generate(PROMPT, videos=[frames], mm_uuids={"audio": ["a"]}, sampling_params=GREEDY, use_tqdm=False)


@pytest.mark.parametrize(("container", "codec"), [("mp4", "mpeg4"), ("webm", "libvpx-vp9"), ("matroska", "mpeg4"),
                                                  ("mpegts", "mpeg4"), ("avi", "mpeg4")])
def test_containers_whose_headers_lie_are_counted_by_their_packets(container, codec):
    """Matroska and MPEG-TS announce wrong frame counts and rates (PyAV reads 4104 frames at 1 fps from
    this Matroska file): frames are counted by demuxing, the rate is frames / duration."""
    from mmengine.multimodal import video as video_io

    frames = clip(15, 48, 64)
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as muxer:
        stream = muxer.add_stream(codec, rate=5)
        stream.height, stream.width, stream.pix_fmt = 48, 64, "yuv420p"
        for frame in frames:
            muxer.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        muxer.mux(stream.encode())
    info = video_io.probe(out.getvalue(), 0, max_seconds=60, max_frame_pixels=10**6)
    assert (info.num_frames, info.fps, info.height, info.width) == (15, 5.0, 48, 64)
    decoded = video_io.decode(out.getvalue(), [0, 7, 14], info, 0)
    assert np.array_equal(decoded, decoded_frames(out.getvalue())[[0, 7, 14]])


def test_the_async_engine_streams_an_answer_about_a_video(engine):
    import asyncio

    from mmengine.engine.async_engine import AsyncMMEngine

    async def ask() -> list[int]:
        async with AsyncMMEngine(engine) as served:
            tokens: list[int] = []
            async for delta in served.generate(PROMPT, None, GREEDY, videos=[clip(4, seed=21)]):
                tokens += delta.token_ids
            return tokens

    assert asyncio.run(ask()) == answer(engine, PROMPT, videos=[clip(4, seed=21)])
