"""The small things users hit: request ids, abort outputs, idle steps, one warning, the demo's image
count, `python -m mmengine`, `--version`, a light `--help`, chat() with mm_uuids, a docstring."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from helpers import IMAGE_PROMPT, SHORT_GREEDY
from mmengine import MMEngine, SamplingParams
from mmengine.cli import main
from mmengine.testing import make_test_image

IMG = make_test_image(61)
GOOD, PARAMS = IMAGE_PROMPT, SHORT_GREEDY


@pytest.fixture(scope="module")
def engine(small_engine):
    return small_engine


def _drain(engine: MMEngine) -> dict:
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    return outputs


def test_automatic_ids_never_collide_with_chosen_ones(engine):
    first = engine.add_request(GOOD, [IMG], PARAMS)
    number = int(first.removeprefix("req-"))
    taken = [engine.add_request(GOOD, [IMG], PARAMS, request_id=f"req-{number + k}") for k in (1, 2)]
    automatic = engine.add_request(GOOD, [IMG], PARAMS)
    assert automatic not in taken and automatic != first
    outputs = _drain(engine)
    ids = [first, *taken, automatic]
    assert all(outputs[i].finish_reason == "length" for i in ids)
    assert len({tuple(outputs[i].token_ids) for i in ids}) == 1  # same prompt, same greedy tokens


def test_an_aborted_request_yields_an_abort_output(engine):
    keep = engine.add_request(GOOD, [IMG], PARAMS)
    drop = engine.add_request(GOOD, [make_test_image(62)], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    delivered = []  # what step() handed over for it (with async scheduling tokens arrive a call later)
    while len(delivered) < 2:
        delivered += [o.token_ids for o in engine.step() if o.request_id == drop]
    assert engine.abort_request(drop) and not engine.abort_request(drop)
    (aborted,) = [o for o in engine.step() if o.request_id == drop]
    assert aborted.finished and aborted.finish_reason == "abort" and aborted.token_ids == delivered[-1]
    assert _drain(engine)[keep].token_ids == engine.generate(GOOD, images=[IMG], sampling_params=PARAMS, use_tqdm=False)[0].token_ids


def test_step_on_an_idle_engine_does_nothing(engine):
    assert not engine.has_unfinished_requests()
    steps = engine.stats()["steps"]
    assert engine.step() == [] and engine.step() == []
    assert engine.stats()["steps"] == steps


def test_the_encoder_cache_size_warning_is_printed_once(checkpoint_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="mmengine"):
        MMEngine(str(checkpoint_dir()), max_model_len=128, encoder_cache_size=1)
    assert sum("encoder_cache_size=1 is below one item" in r.getMessage() for r in caplog.records) == 1


def test_the_demo_uses_as_many_unique_images_as_it_says(checkpoint_dir, capsys):
    args = ["demo", "--requests", "6", "--max-tokens", "2", "--cache-dir", str(checkpoint_dir().parent), "--max-model-len", "128"]
    assert main([*args, "--unique-images", "4"]) == 0
    assert "6 requests (5 images, 4 unique)" in capsys.readouterr().out  # requests 0,1,2,4,5 show images 0,1,2,3,0
    assert main([*args, "--unique-images", "9"]) == 0
    assert "6 requests (5 images, 5 unique)" in capsys.readouterr().out


def test_python_dash_m_mmengine_and_version():
    from mmengine import __version__

    version = subprocess.run([sys.executable, "-m", "mmengine", "--version"], capture_output=True, text=True, check=True)
    assert version.stdout.strip() == f"mmengine {__version__}"
    usage = subprocess.run([sys.executable, "-m", "mmengine", "--help"], capture_output=True, text=True, check=True)
    assert "demo" in usage.stdout and "budget" in usage.stdout


def test_help_and_the_errors_module_load_neither_torch_nor_transformers():
    probe = (
        "import sys, mmengine.errors, mmengine.cli\n"
        "try:\n    mmengine.cli.main(['--help'])\nexcept SystemExit as exit:\n    assert exit.code == 0\n"
        "print(sorted(m for m in ('torch', 'transformers', 'PIL', 'numpy') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_chat_takes_mm_uuids(engine):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    runs = engine.stats()["encoder_runs"]
    (first,) = engine.chat(messages, images=[IMG], mm_uuids=["photo-7"], sampling_params=PARAMS, use_tqdm=False)
    # another picture under the same id is trusted to be the same item: no new encode, same tokens
    (second,) = engine.chat(messages, images=[make_test_image(63)], mm_uuids=["photo-7"], sampling_params=PARAMS, use_tqdm=False)
    assert engine.stats()["encoder_runs"] == runs + 1 and second.token_ids == first.token_ids


def test_the_engine_class_documents_its_use():
    doc = MMEngine.__doc__ or ""
    assert all(word in doc for word in ("generate(", "add_request(", "step()", "abort_request(", "thread"))
