"""Gemma 4 audio inputs (fp32, CPU) against transformers: greedy tokens equal transformers' generate for a
clip, and a picture plus a clip; a clip is decoded and resampled to 16 kHz mono with PyAV, and its
encoder output is cached under the hash of that waveform, so the same sound as WAV, FLAC or samples is
encoded once; corrupt and over-long clips are typed errors naming the prompt and the clip, and the
engine serves on; the server takes OpenAI's input_audio parts."""

from __future__ import annotations

import base64
import functools
import io
import wave
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
import torch
from serve_helpers import API_KEY, MODEL_NAME, running_server

from mmengine import MMEngine, SamplingParams
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.errors import (
    AudioCountMismatchError,
    AudioTooLongError,
    ConfigError,
    CorruptAudioError,
    InvalidInputError,
    TooManyAudiosError,
    UnsupportedContainerError,
)
from mmengine.models.registry import load_hf_processor
from mmengine.multimodal.audio import Audio, AudioLimits, decode, resample
from mmengine.testing.gemma4 import gemma4_prompt
from mmengine.testing.images import make_test_image
from hostile_media import FileOpenWatch, hostile_payloads

RATE = 16_000
QUESTION = "Tell me about this sound and the red square, then count to ten slowly, please."
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def tone(seconds: float, rate: int = RATE, frequency: float = 440.0) -> np.ndarray:
    """A tone with a rising second partial (so that its frames differ), quantized to 16 bits as a WAV holds it."""
    t = np.arange(int(seconds * rate)) / rate
    samples = 0.3 * np.sin(2 * np.pi * frequency * t) + 0.2 * np.sin(2 * np.pi * (200 + 900 * t) * t)
    return (np.round(samples * 32767) / 32768).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = RATE) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(np.round(samples * 32768).astype(np.int16).tobytes())
    return buffer.getvalue()


def flac_bytes(samples: np.ndarray, rate: int = RATE) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="flac") as container:
        stream = container.add_stream("flac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.round(samples * 32768).astype(np.int16)[None, :], format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buffer.getvalue()


def prompt_with(text: str, num_images: int = 0, num_audios: int = 1) -> str:
    return gemma4_prompt(text, num_images, num_audios)


CLIP = tone(0.8)  # 20 audio tokens
WAV = wav_bytes(CLIP)
PICTURE = make_test_image(3, (64, 40))


@pytest.fixture(scope="module")
def path(family_checkpoint) -> Path:
    return family_checkpoint("gemma4")


@pytest.fixture(scope="module")
def engine(path) -> MMEngine:
    return MMEngine(str(path), device="cpu", dtype="float32", max_model_len=512, enforce_eager=True, block_size=4,
                    limit_mm_per_prompt={"image": 2, "audio": 2}, max_audio_seconds=2)


@functools.cache
def _hf(path: Path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval(), load_hf_processor(path)


def hf_greedy(path: Path, prompt: str, images: list, waveforms: list[np.ndarray], max_new_tokens: int) -> list[int]:
    model, processor = _hf(path)
    inputs = processor(text=prompt, images=images or None, audio=waveforms, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _tokens(engine: MMEngine, prompt: str, audios: list, images: list | None = None, params: SamplingParams = GREEDY):
    return engine.generate(prompt, images=images, audios=audios, sampling_params=params, use_tqdm=False)[0]


# -- decoding ---------------------------------------------------------------------------------------


def test_wav_flac_and_samples_decode_to_one_waveform():
    """16-bit PCM at 16 kHz decodes to its samples exactly; at 8 kHz, WAV, FLAC and float samples go
    through the one resampler and agree sample for sample."""
    limits = AudioLimits(30.0, "max_audio_seconds=30")
    np.testing.assert_array_equal(decode(WAV, "audio 0", RATE, limits), CLIP)
    low = tone(0.5, 8000)
    from_wav = decode(wav_bytes(low, 8000), "audio 0", RATE, limits)
    assert len(from_wav) == 8000
    np.testing.assert_array_equal(decode(flac_bytes(low, 8000), "audio 0", RATE, limits), from_wav)
    np.testing.assert_array_equal(resample(low, 8000, RATE, "audio 0"), from_wav)


# -- parity with transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("num_images", [0, 1])
def test_greedy_tokens_equal_transformers(path, engine, num_images):
    """A clip (given as WAV) alone and after a picture, in a prompt past the window of 8."""
    prompt = prompt_with(QUESTION, num_images)
    images = [PICTURE] * num_images
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    out = _tokens(engine, prompt, [WAV], images or None, params)
    model, processor = _hf(path)
    assert out.prompt_token_ids == processor(text=prompt, images=images or None, audio=[CLIP])["input_ids"][0]
    assert out.token_ids == hf_greedy(path, prompt, images, [CLIP], 16)


def test_resampled_samples_equal_transformers_on_the_resampled_waveform(path, engine):
    """Samples at 8 kHz: the engine's 16 kHz waveform (the resampler above) is what transformers is given."""
    low = tone(0.6, 8000, 330.0)
    prompt = prompt_with("What is this?")
    out = _tokens(engine, prompt, [(low, 8000)])
    assert out.token_ids == hf_greedy(path, prompt, [], [resample(low, 8000, RATE, "audio 0")], GREEDY.max_tokens)


def test_a_different_clip_changes_the_answer(engine):
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    prompt = prompt_with("What is this?")
    first = _tokens(engine, prompt, [WAV], params=params).logprobs[0].top
    other = _tokens(engine, prompt, [wav_bytes(tone(0.8, frequency=1200.0))], params=params).logprobs[0].top
    assert first != other


# -- the encoder cache -----------------------------------------------------------------------------


def test_one_encoder_run_per_clip(engine):
    """One sound as WAV twice in a prompt, then as FLAC and as samples: one encoder run. The prompt again:
    a prefix hit and no re-encode. Two clips of different lengths batched together equal each alone."""
    sound = tone(0.8, frequency=550.0)
    wav = wav_bytes(sound)
    prompt = prompt_with("Are these the same?", num_audios=2)
    before = engine.stats()
    first = _tokens(engine, prompt, [wav, wav])
    items = engine.input_processor.process(prompt, None, GREEDY, audios=[wav, wav]).mm_items
    assert [item.modality for item in items] == ["audio", "audio"] and items[0].mm_hash == items[1].mm_hash
    assert items[0].length == 20
    assert _tokens(engine, prompt, [flac_bytes(sound), (sound, RATE)]).token_ids == first.token_ids
    again = _tokens(engine, prompt, [Audio(wav), wav])
    stats = engine.stats()
    assert again.token_ids == first.token_ids and again.num_cached_tokens > 0
    assert stats["encoder_runs"] - before["encoder_runs"] == 1
    assert stats["reencodes_after_prefix_hit"] == before["reencodes_after_prefix_hit"]
    # WAV, FLAC and samples each decoded once (the WAV's bytes are remembered), their features extracted once
    assert stats["audios_decoded"] - before["audios_decoded"] == 3
    assert stats["audios_preprocessed"] - before["audios_preprocessed"] == 1
    short, long = (engine.family.audio_item(tone(seconds)) for seconds in (0.3, 0.9))
    model = engine.runner.model
    together = model.encode_items([short, long])
    for alone, batched in zip(model.encode_items([short]) + model.encode_items([long]), together):
        torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-5)


def test_a_uuid_names_a_clip(engine):
    prompt = prompt_with("What is this?")
    first = _tokens(engine, prompt, [WAV]).token_ids
    named = engine.generate(prompt, audios=[wav_bytes(tone(0.5, frequency=523.0))], mm_uuids={"audio": ["clip-a"]},
                            sampling_params=GREEDY, use_tqdm=False)[0]
    decoded = engine.stats()["audios_decoded"]
    again = engine.generate({"prompt": prompt, "multi_modal_data": {"audio": WAV}}, mm_uuids={"audio": ["clip-a"]},
                            sampling_params=GREEDY, use_tqdm=False)[0]
    assert again.token_ids == named.token_ids != first and engine.stats()["audios_decoded"] == decoded


# -- limits and errors -----------------------------------------------------------------------------


def test_bad_clips_are_typed_errors_naming_prompt_and_clip(engine):
    prompt = prompt_with("What is this?")
    good = _tokens(engine, prompt, [WAV]).token_ids
    cases = [
        ([b"RIFF" + bytes(4) + b"WAVE" + bytes(range(200))], CorruptAudioError, "prompt 1: audio 0: cannot decode"),
        ([b"RIFF" + bytes(range(200))], UnsupportedContainerError, "prompt 1: audio 0: the data is not an accepted audio"),
        ([WAV[: len(WAV) // 2]], CorruptAudioError, "prompt 1: audio 0: truncated: the WAV header states"),
        ([wav_bytes(tone(2.5))], AudioTooLongError, r"prompt 1: audio 0: the container states 2.50 s exceeds max_audio_seconds=2"),
        ([(tone(2.5), RATE)], AudioTooLongError, r"prompt 1: audio 0: 2.50 s exceeds max_audio_seconds=2"),
        ([np.zeros((2, 800), np.float32)], InvalidInputError, "mono"),
        ([(np.zeros(800, np.float32), 0)], InvalidInputError, "sampling_rate must be an int"),
        ([np.zeros(800, np.float32)], InvalidInputError, "need their sampling rate"),
        ([(np.zeros(80, np.float32), RATE)], InvalidInputError, "too short"),
        ([WAV, WAV], AudioCountMismatchError, r"1 <\|audio\|> marker"),
        ([WAV] * 3, TooManyAudiosError, "at most 2"),
    ]
    for audios, error, match in cases:
        with pytest.raises(error, match=match):
            engine.generate([prompt, prompt], audios=[[WAV], audios], sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(AudioCountMismatchError, match="no audio was given"):
        engine.generate(prompt, sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="prompt_token_ids with audio"):
        engine.generate({"prompt_token_ids": [2, 5, 6]}, audios=[WAV], sampling_params=GREEDY, use_tqdm=False)
    assert _tokens(engine, prompt, [WAV]).token_ids == good  # and it serves on


def test_a_family_without_audio_refuses_it_by_name(small_engine):
    with pytest.raises(InvalidInputError, match="takes no audio"):
        small_engine.generate("USER: hi ASSISTANT:", audios=[WAV], sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(InvalidInputError, match="unknown modalities \\['audio'\\]"):
        small_engine.generate("USER: hi ASSISTANT:", mm_uuids={"audio": ["a"]}, sampling_params=GREEDY, use_tqdm=False)


def test_budget_counts_the_longest_clip(path, engine):
    family = engine.family
    assert family.bidirectional_modalities == {"image", "video"}  # audio attends causally
    assert family.max_tokens_by_modality() == {"image": 70, "audio": 750}  # 30 s, 25 tokens a second
    assert family.max_tokens_per_item({"image": 1, "audio": 1}) == 750
    assert family.max_tokens_per_item({"image": 1, "audio": 1}, max_audio_seconds=2) == 70  # 50 tokens
    assert family.max_tokens_per_item({"image": 1, "audio": 1}, max_audio_seconds=4) == 100
    assert family.max_tokens_per_item({"image": 1, "audio": 0}) == 70
    assert "audio: at most 480000 samples" in family.explain_max_tokens_per_item({"audio": 1}, 4)
    assert engine.encoder_budget.max_tokens_per_item == 70
    with pytest.raises(ConfigError, match="limit_mm_per_prompt"):
        MMEngine(str(path), device="cpu", limit_mm_per_prompt={"sound": 1})


def test_the_memory_profile_encodes_a_step_of_the_longest_clips(engine):
    """The GPU start-up profile runs the largest encoder work a step can do: with audio, a batch of the
    longest clips beside the pictures' batch (here through the CPU path: the batches and their encoding)."""
    runner = engine.runner
    batches = runner.profile_encoder_batches(images_per_step=2, encoder_budget_tokens=160)
    assert [len(batch) for batch in batches] == [2, 3]  # 160 tokens of the budget: 3 clips of 50 (max_audio_seconds=2)
    with torch.inference_mode():
        outputs = engine.runner.model.encode_items(batches[1])
    assert [tuple(o.shape) for o in outputs] == [(50, engine.family.text_config.hidden_size)] * 3
    engine.config.multimodal_config.limit_mm_per_prompt["audio"], saved = 0, engine.config.multimodal_config.limit_mm_per_prompt["audio"]
    try:
        assert [len(batch) for batch in runner.profile_encoder_batches(2, 160)] == [2]  # no clip can come
    finally:
        engine.config.multimodal_config.limit_mm_per_prompt["audio"] = saved


def test_chat_takes_audio_parts(engine):
    """MMEngine.chat: {"type": "audio"} parts with audios=, or OpenAI input_audio parts, as generate() answers."""
    expected = _tokens(engine, prompt_with("What is this?"), [WAV]).token_ids
    data = {"data": base64.b64encode(WAV).decode(), "format": "wav"}
    for part, audios in (({"type": "audio"}, [WAV]), ({"type": "input_audio", "input_audio": data}, None)):
        messages = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
        assert engine.chat(messages, sampling_params=GREEDY, audios=audios, use_tqdm=False)[0].token_ids == expected


# -- serving ---------------------------------------------------------------------------------------


def test_the_server_takes_input_audio_parts(engine, tmp_path, monkeypatch):
    """A chat with an input_audio part answers as generate() does with the clip; bad parts are 400s naming it.
    ffconcat bytes naming a WAV in the server's working directory are refused, and the file is never opened."""
    expected = _tokens(engine, prompt_with("What is this?"), [WAV])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "secret.wav").write_bytes(WAV)
    watch = FileOpenWatch(tmp_path / "secret.wav")

    def chat(server, part: dict) -> httpx.Response:
        body = {"model": MODEL_NAME, "max_tokens": GREEDY.max_tokens, "temperature": 0, "ignore_eos": True,
                "messages": [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]}
        return httpx.post(server.v1 + "/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)

    def audio_part(data: bytes, audio_format: str = "wav") -> dict:
        return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": audio_format}}

    with running_server(AsyncMMEngine(engine), ServerSettings(MODEL_NAME, api_key=API_KEY)) as server:
        answer = chat(server, audio_part(WAV))
        corrupt = chat(server, audio_part(b"not audio", "mp3"))
        bad_format = chat(server, audio_part(WAV, "midi"))
        no_data = chat(server, {"type": "input_audio", "input_audio": {"format": "wav"}})
        hostile = {name: chat(server, audio_part(data)) for name, data in hostile_payloads("secret.wav", 45678).items()}
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == expected.text
    assert answer.json()["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert corrupt.status_code == 400 and corrupt.json()["error"]["code"] == "unsupported_media_container"
    assert "audio 0: the data is not an accepted audio container" in corrupt.json()["error"]["message"]
    for name, refused in hostile.items():
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "unsupported_media_container", name
        assert "audio 0: the data is not an accepted audio container" in refused.json()["error"]["message"], name
    assert watch.events() == 0
    watch.close()
    assert bad_format.status_code == 400 and "format 'midi'" in bad_format.json()["error"]["message"]
    assert no_data.status_code == 400 and "input_audio" in no_data.json()["error"]["message"]
