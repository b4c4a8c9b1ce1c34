"""Start-up pays what the first request would (issue 47, online throughput): Pillow's plugin registry, the
picture path and the chat template's compilation, in the engine's process, a front end and each preprocessing
worker; nothing of it is cached or counted as a picture."""

from __future__ import annotations

import pickle
import threading
from multiprocessing import Pipe
from types import SimpleNamespace

import PIL.Image
import pytest
import torch

from mmengine.config import EngineConfig
from mmengine.engine.startup import build_input_parts
from mmengine.entrypoints.chat import ChatTemplate
from mmengine.multimodal import preprocess_pool
from mmengine.multimodal.picture_preparer import PicturePreparer


@pytest.fixture(scope="module")
def config(checkpoint_dir) -> EngineConfig:
    return EngineConfig.from_kwargs(str(checkpoint_dir()), max_model_len=256, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def processor(config):
    return build_input_parts(config).input_processor


class _Calls:
    def __init__(self, monkeypatch, owner, name: str) -> None:
        self.count = 0
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)


def test_the_intake_warms_the_picture_path_at_start_up_and_counts_nothing(config, monkeypatch):
    monkeypatch.setattr(PIL.Image, "_initialized", 0)  # as in a fresh process: no plugin registered past the first five
    warm_ups = _Calls(monkeypatch, PicturePreparer, "warm_up")
    processor = build_input_parts(config).input_processor
    assert warm_ups.count == 1 and PIL.Image._initialized == 2  # every plugin registered before any request
    assert processor.num_images_decoded == processor.num_images_preprocessed == 0
    assert processor.cache.num_bytes == processor.cache.num_hits == processor.cache.num_misses == 0


def test_a_preprocessing_worker_warms_up_before_it_says_ready(config, processor, monkeypatch):
    spec = pickle.dumps(processor.pictures.spec())
    warm_ups = _Calls(monkeypatch, PicturePreparer, "warm_up")
    monkeypatch.setattr(torch, "set_num_threads", lambda _: None)  # the worker's, for its own process
    ours, theirs = Pipe()
    worker = threading.Thread(target=preprocess_pool.worker_main, args=(spec, theirs))  # its loop, in a thread here
    worker.start()
    try:
        status, _ = ours.recv()
        assert status == "ready" and warm_ups.count == 1
    finally:
        ours.send(None)
        worker.join(30)
    assert not worker.is_alive()


def test_the_chat_template_is_compiled_when_the_server_starts(processor, monkeypatch):
    renders = _Calls(monkeypatch, processor, "apply_chat_template")
    template = ChatTemplate(SimpleNamespace(input_processor=processor, tokenizer=processor.tokenizer))
    assert renders.count == 1  # at start-up, not at the first request
    template.render([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}])
    assert renders.count == 2
