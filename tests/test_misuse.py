"""Every misuse of the API or the CLI is a typed ValueError naming the culprit; the request already in
flight and the next request are unharmed."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import IMAGE_PROMPT, SHORT_GREEDY
from mmengine import MMEngine
from mmengine.cli import main
from mmengine.errors import ConfigError, InvalidInputError, MMEngineError
from mmengine.testing import make_test_image

IMG = make_test_image(51)
GOOD, PARAMS = IMAGE_PROMPT, SHORT_GREEDY


@pytest.fixture(scope="module")
def engine(small_engine):
    return small_engine


@pytest.fixture(scope="module")
def reference(engine):
    return engine.generate(GOOD, images=[IMG], sampling_params=PARAMS, use_tqdm=False)[0].token_ids


def _chat(text="hi"):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


# (case id, the misuse, error type, a piece of the message naming the culprit)
API_MISUSES = [
    ("bare PIL image", lambda e: e.generate(GOOD, images=IMG, use_tqdm=False), InvalidInputError, "bare PIL.Image.Image"),
    ("bare ndarray", lambda e: e.generate(GOOD, images=np.asarray(IMG), use_tqdm=False), InvalidInputError, "bare numpy.ndarray"),
    ("bare path string", lambda e: e.generate(GOOD, images="cat.png", use_tqdm=False), InvalidInputError, "bare str"),
    ("bare image to add_request", lambda e: e.add_request(GOOD, IMG), InvalidInputError, "pass [image]"),
    ("bare images in a batch", lambda e: e.generate([GOOD, GOOD], images=[[IMG], IMG], use_tqdm=False), InvalidInputError, "prompt 1: images"),
    ("dict sampling_params", lambda e: e.generate(GOOD, images=[IMG], sampling_params={"max_tokens": 3}, use_tqdm=False), InvalidInputError, "got dict"),
    ("list sampling_params to add_request", lambda e: e.add_request(GOOD, [IMG], [PARAMS]), InvalidInputError, "got list"),
    ("generate(None)", lambda e: e.generate(None, use_tqdm=False), InvalidInputError, "got NoneType"),
    ("generate(123)", lambda e: e.generate(123, use_tqdm=False), InvalidInputError, "got int"),
    ("generate(bytes)", lambda e: e.generate(b"USER: hi ASSISTANT:", use_tqdm=False), InvalidInputError, "got bytes"),
    ("a bytes prompt in a batch", lambda e: e.generate(["USER: hi", b"x"], use_tqdm=False), InvalidInputError, "prompt 1: a prompt must be a str, got bytes"),
    ("cache_salt=123", lambda e: e.generate(GOOD, images=[IMG], cache_salt=123, use_tqdm=False), InvalidInputError, "cache_salt must be"),
    ("cache_salt=123 to add_request", lambda e: e.add_request(GOOD, [IMG], cache_salt=123), InvalidInputError, "cache_salt must be"),
    ("lone surrogate", lambda e: e.generate("USER: hi \ud800 ASSISTANT:", use_tqdm=False), InvalidInputError, "lone surrogate '\\ud800' at character 9"),
    ("chat(str)", lambda e: e.chat("hello", use_tqdm=False), InvalidInputError, "messages must be a list"),
    ("chat unknown role", lambda e: e.chat([{"role": "wizard", "content": "hi"}], use_tqdm=False), InvalidInputError, "role 'wizard'"),
    ("chat without content", lambda e: e.chat([{"role": "user"}], use_tqdm=False), InvalidInputError, "message 0 has no 'content'"),
    ("chat bad part", lambda e: e.chat([{"role": "user", "content": [{"type": "audio"}]}], use_tqdm=False), InvalidInputError, "'audio'"),
    ("chat lone surrogate", lambda e: e.chat(_chat("\udfff"), images=[IMG], use_tqdm=False), InvalidInputError, "lone surrogate"),
    ("request_id=5", lambda e: e.add_request(GOOD, [IMG], request_id=5), InvalidInputError, "request_id must be"),
    ("mm_uuids not a list", lambda e: e.add_request(GOOD, [IMG], mm_uuids="cat"), InvalidInputError, "mm_uuids must be a list"),
]

CONFIG_MISUSES = [
    ("device=0", {"device": 0}, "device must be"),
    ("device='cuda:x'", {"device": "cuda:x"}, "'cuda:x'"),
    ("dtype=[...]", {"dtype": ["float32"]}, "dtype must be"),
    ("attn_backend=None", {"attn_backend": None}, "attn_backend must be"),
    ("enable_prefix_grouping='yes'", {"enable_prefix_grouping": "yes"}, "enable_prefix_grouping must be a bool"),
    ("num_kv_blocks=10**8 on CPU", {"num_kv_blocks": 10**8, "device": "cpu"}, "num_kv_blocks=100000000 needs"),
]


def _assert_unharmed(engine: MMEngine, in_flight: str, reference: list[int]) -> None:
    assert set(engine.scheduler.requests) == {in_flight}  # the misuse queued nothing
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert outputs[in_flight].token_ids == reference
    (nxt,) = engine.generate(GOOD, images=[IMG], sampling_params=PARAMS, use_tqdm=False)
    assert nxt.token_ids == reference


@pytest.mark.parametrize("case", API_MISUSES, ids=[c[0] for c in API_MISUSES])
def test_api_misuse_is_a_typed_error(engine, reference, case):
    _, misuse, error, culprit = case
    in_flight = engine.add_request(GOOD, [IMG], PARAMS)
    engine.step()
    with pytest.raises(error) as err:
        misuse(engine)
    assert isinstance(err.value, ValueError) and culprit in str(err.value)
    _assert_unharmed(engine, in_flight, reference)


@pytest.mark.parametrize("case", CONFIG_MISUSES, ids=[c[0] for c in CONFIG_MISUSES])
def test_config_misuse_is_a_typed_error(engine, reference, case):
    _, options, culprit = case
    in_flight = engine.add_request(GOOD, [IMG], PARAMS)
    engine.step()
    with pytest.raises(ConfigError) as err:
        MMEngine(engine.config.model, max_model_len=128, **options)
    assert culprit in str(err.value)
    _assert_unharmed(engine, in_flight, reference)


@pytest.mark.parametrize(
    "argv,culprit",
    [
        (["budget", "--block-size", "0"], "block_size must be a positive int, got 0"),
        (["budget", "--num-kv-blocks", "-3"], "num_kv_blocks must be a positive int, got -3"),
        (["budget", "--max-model-len", "0"], "max_model_len must be a positive int, got 0"),
        (["demo", "--unique-images", "0"], "--unique-images must be a positive int, got 0"),
        (["demo", "--requests", "0"], "--requests must be a positive int, got 0"),
        (["demo", "--block-size", "3"], "block_size must be a power of two"),
        (["generate", "--max-tokens", "0", "--prompt", "hi"], "max_tokens"),
        (["generate", "--device", "cuda:x", "--prompt", "hi"], "'cuda:x'"),
    ],
)
def test_cli_arguments_follow_the_engine_rules(checkpoint_dir, capsys, argv, culprit):
    if argv[0] in ("budget", "generate"):
        argv = [argv[0], "--model", str(checkpoint_dir()), *argv[1:]]
    else:
        argv = [*argv, "--cache-dir", str(checkpoint_dir().parent)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmengine: error: ") and culprit in err[0], err


def test_every_typed_error_is_an_mmengine_error_and_a_value_error():
    import mmengine.errors as errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, MMEngineError) and c is not MMEngineError]
    # a dead engine, or CUDA graphs a GPU failed to capture, is the engine's state, not the request's or the
    # configuration's fault
    runtime = {errors.EngineDeadError, errors.CudaGraphCaptureError}
    assert runtime <= set(classes) and all(issubclass(c, RuntimeError) for c in runtime)
    assert all(issubclass(c, ValueError) for c in classes if c not in runtime)
