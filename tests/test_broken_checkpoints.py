"""Incomplete, mis-shaped and broken checkpoints never load: each is a typed error naming the tensor
(with its expected and actual shape) or the file at fault. Known-ignorable tensors load fine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from mmengine import MMEngine, SamplingParams
from mmengine.errors import CheckpointError, WeightsMismatchError
from mmengine.testing import TinyLlavaSpec, make_test_image

PROMPT = "USER: <image>\nWhat is shown here? ASSISTANT:"
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
IMAGE = make_test_image(21)
LM = "language_model.model."


def _copy(checkpoint_dir, tmp_path, spec=TinyLlavaSpec()):
    dst = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir(spec), dst)
    return dst


def _edit_tensors(path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})


def _generate(path) -> list[int]:
    engine = MMEngine(str(path), max_model_len=128)
    return engine.generate(PROMPT, images=[IMAGE], sampling_params=PARAMS, use_tqdm=False)[0].token_ids


DROPPED = [
    f"{LM}layers.0.self_attn.q_proj.weight",
    f"{LM}layers.1.self_attn.v_proj.weight",
    f"{LM}layers.1.mlp.down_proj.weight",
    f"{LM}layers.0.mlp.up_proj.weight",
    f"{LM}embed_tokens.weight",
    f"{LM}norm.weight",
    "language_model.lm_head.weight",  # untied: the head is needed
    "multi_modal_projector.linear_1.weight",
    "multi_modal_projector.linear_2.bias",
    "vision_tower.encoder.layers.0.mlp.fc1.weight",
    "vision_tower.embeddings.patch_embedding.weight",
    "vision_tower.pre_layrnorm.bias",
]


@pytest.mark.parametrize("dropped", DROPPED)
def test_a_missing_tensor_is_named(checkpoint_dir, tmp_path, dropped):
    path = _copy(checkpoint_dir, tmp_path)
    shape = []
    _edit_tensors(path, lambda t: shape.extend(t.pop(dropped).shape))
    with pytest.raises(WeightsMismatchError) as err:
        MMEngine(str(path), max_model_len=128)
    message = str(err.value)
    assert dropped.removeprefix(LM).removeprefix("language_model.") in message
    assert "[" + ", ".join(map(str, shape)) + "]" in message and "model.safetensors" in message


RESHAPED = [
    ("multi_modal_projector.linear_1.bias", (1,)),  # used to broadcast silently on copy
    ("multi_modal_projector.linear_2.weight", (64, 32)),
    (f"{LM}layers.0.self_attn.k_proj.weight", (64, 64)),
    (f"{LM}layers.1.mlp.gate_proj.weight", (128, 32)),
    (f"{LM}embed_tokens.weight", (401, 64)),
    (f"{LM}norm.weight", (63,)),
    ("vision_tower.encoder.layers.1.self_attn.q_proj.bias", (31,)),
    ("vision_tower.embeddings.class_embedding", (1, 32)),
]


@pytest.mark.parametrize("name,shape", RESHAPED)
def test_a_mis_shaped_tensor_names_both_shapes_and_the_file(checkpoint_dir, tmp_path, name, shape):
    import torch

    path = _copy(checkpoint_dir, tmp_path)
    expected = []

    def edit(tensors):
        expected.extend(tensors[name].shape)
        tensors[name] = torch.zeros(shape)

    _edit_tensors(path, edit)
    with pytest.raises(WeightsMismatchError) as err:
        MMEngine(str(path), max_model_len=128)
    message = str(err.value)
    assert name in message and "model.safetensors" in message
    assert f"has shape [{', '.join(map(str, shape))}], expected [{', '.join(map(str, expected))}]" in message


def test_weights_of_a_differently_sized_model_are_a_typed_error(checkpoint_dir, tmp_path):
    path = _copy(checkpoint_dir, tmp_path)
    other = checkpoint_dir(TinyLlavaSpec(hidden_size=32, intermediate_size=64, seed=5))
    shutil.copy(other / "model.safetensors", path / "model.safetensors")
    with pytest.raises(WeightsMismatchError, match=r"has shape \[.*\], expected \["):
        MMEngine(str(path), max_model_len=128)


def test_unexpected_and_repeated_tensors_are_refused(checkpoint_dir, tmp_path):
    path = _copy(checkpoint_dir, tmp_path)
    _edit_tensors(path, lambda t: t.update({"vision_tower.encoder.layers.7.mlp.fc1.bias": t["vision_tower.post_layernorm.bias"]}))
    with pytest.raises(WeightsMismatchError, match=r"unexpected tensor 'vision_tower\.encoder\.layers\.7"):
        MMEngine(str(path), max_model_len=128)

    both = tmp_path / "both_layouts"
    shutil.copytree(checkpoint_dir(), both)
    norm = f"{LM}norm.weight"
    _edit_tensors(both, lambda t: t.update({"model.language_model.norm.weight": t[norm]}))
    with pytest.raises(WeightsMismatchError, match="loaded once") as err:
        MMEngine(str(both), max_model_len=128)
    assert "model.language_model.norm.weight" in str(err.value) and norm in str(err.value)


def test_a_tensor_in_two_shards_is_refused(checkpoint_dir, tmp_path):
    path = _copy(checkpoint_dir, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 - 1 :]  # one name in both
    save_file({k: tensors[k] for k in first}, str(path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in second}, str(path / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightsMismatchError, match=f"{names[len(names) // 2 - 1]}.*stored twice") as err:
        MMEngine(str(path), max_model_len=128)
    assert "model-00001-of-00002.safetensors" in str(err.value) and "model-00002-of-00002.safetensors" in str(err.value)


def test_known_ignorable_tensors_load_and_change_nothing(checkpoint_dir, tmp_path):
    """Rotary caches, position ids, the unused pooling head and post-layernorm, and the vision layers
    past the selected one are skipped explicitly; the output is the original checkpoint's."""
    import torch

    reference = _generate(checkpoint_dir())
    path = _copy(checkpoint_dir, tmp_path)

    def edit(tensors):
        tensors[f"{LM}layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        tensors["vision_tower.embeddings.position_ids"] = torch.arange(17)[None]
        tensors["vision_tower.head.probe"] = torch.ones(1, 1, 32)
        tensors["vision_tower.post_layernorm.weight"] = torch.full((32,), 7.0)  # unused: changes nothing
        tensors["vision_tower.encoder.layers.2.mlp.fc1.weight"] = torch.full((64, 32), 7.0)  # the unused last layer

    _edit_tensors(path, edit)
    assert _generate(path) == reference


def test_a_tied_checkpoint_needs_no_lm_head_but_an_untied_one_does(checkpoint_dir, tmp_path):
    tied = TinyLlavaSpec(text_model="qwen2", vision_model="siglip", tie_word_embeddings=True, seed=1)
    engine = MMEngine(str(checkpoint_dir(tied)), max_model_len=128)
    model = engine.runner.model
    assert model.lm_head.weight.data_ptr() == model.language_model.embed_tokens.weight.data_ptr()
    path = _copy(checkpoint_dir, tmp_path)
    _edit_tensors(path, lambda t: t.pop("language_model.lm_head.weight"))
    with pytest.raises(WeightsMismatchError, match=r"'lm_head\.weight' \[\d+, 64\]"):
        MMEngine(str(path), max_model_len=128)


def _truncate(path):
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _garbage(path):
    (path / "model.safetensors").write_bytes(bytes(range(256)) * 40)


def _bad_config_json(path):
    (path / "config.json").write_text('{"model_type": "llava", ')


def _rejected_config(path):
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["num_attention_heads"] = 3
    (path / "config.json").write_text(json.dumps(config))


def _no_tokenizer(path):
    (path / "tokenizer.json").unlink()


def _bad_tokenizer(path):
    (path / "tokenizer.json").write_text("{")


def _no_processor(path):
    (path / "processor_config.json").unlink()


def _bad_generation_config(path):
    (path / "generation_config.json").write_text("[")


def _bad_index(path):
    (path / "model.safetensors.index.json").write_text("{oops")


BROKEN_FILES = [
    (_truncate, "model.safetensors"),
    (_garbage, "model.safetensors"),
    (_bad_config_json, "config.json"),
    (_rejected_config, "config.json"),
    (_no_tokenizer, "tokenizer.json"),
    (_bad_tokenizer, "tokenizer.json"),
    (_no_processor, "preprocessor_config.json"),
    (_bad_generation_config, "generation_config.json"),
    (_bad_index, "model.safetensors.index.json"),
]


@pytest.mark.parametrize("breaker,culprit", BROKEN_FILES, ids=[b.__name__ for b, _ in BROKEN_FILES])
def test_a_broken_file_is_a_checkpoint_error_naming_it(checkpoint_dir, tmp_path, breaker, culprit):
    path = _copy(checkpoint_dir, tmp_path)
    breaker(path)
    with pytest.raises(CheckpointError) as err:
        MMEngine(str(path), max_model_len=128)
    assert str(path / culprit) in str(err.value)
    assert isinstance(err.value, ValueError)


def test_in_flight_requests_survive_a_broken_checkpoint_elsewhere(checkpoint_dir, tmp_path):
    engine = MMEngine(str(checkpoint_dir()), max_model_len=128)
    request_id = engine.add_request(PROMPT, [IMAGE], PARAMS)
    engine.step()
    path = _copy(checkpoint_dir, tmp_path)
    _truncate(path)
    with pytest.raises(CheckpointError):
        MMEngine(str(path), max_model_len=128)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert outputs[request_id].token_ids == _generate(checkpoint_dir())


def test_cli_prints_one_line_for_a_broken_checkpoint(checkpoint_dir, tmp_path):
    path = _copy(checkpoint_dir, tmp_path)
    _bad_config_json(path)
    for args in (["generate", "--model", str(path), "--prompt", "hi"], ["budget", "--model", str(path)]):
        result = subprocess.run([sys.executable, "-m", "mmengine", *args], capture_output=True, text=True)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mmengine: error: ") and str(path / "config.json") in lines[0]
