"""LoRA in units: the segmented kernel against its reference (Triton's interpreter, fp32 and fp16),
the adapter reader's refusals (each names the file and the tensor or field), the slot books, the
scheduler's cap on distinct adapters, and the engine API's typed errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helpers import make_request, make_scheduler
from mmengine.errors import AdapterError, AdapterInUseError, ConfigError, UnknownAdapterError
from mmengine.layers.lora import LoRASegments, add_lora, lora_reference
from mmengine.lora.adapter import DecoderShape, load_adapter
from mmengine.lora.manager import LoRAManager
from mmengine.lora.request import LoRARequest
from mmengine.core.request import RequestStatus

SHAPE = DecoderShape(2, {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16),
                         "gate_proj": (16, 32), "up_proj": (16, 32), "down_proj": (32, 16)})
PREFIX = "base_model.model.model.language_model.layers"


# -- the kernel ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_segmented_kernel_matches_the_reference_and_leaves_other_rows(dtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    rows, width, out_features, slots = 41, 24, 72, 3
    x = torch.randn(rows, 40, dtype=dtype, device=device) / 4
    a = torch.randn(slots, width, 40, dtype=dtype, device=device) / 4
    b = torch.randn(slots, out_features, width, dtype=dtype, device=device) / 4
    # a decode row, a 17-row prefill chunk and a 3-row one; rows 1, 2 and 20..37 are base-model rows
    segments = LoRASegments.build([0, 3, 38], [1, 17, 3], [2, 0, 1], torch.device(device))
    base = torch.randn(rows, out_features, dtype=dtype, device=device)
    expected, got = base.clone(), base.clone()
    lora_reference(expected, x, a, b, segments)
    add_lora(got, x, a, b, segments, use_kernels=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    untouched = [1, 2, *range(20, 38)]
    assert torch.equal(got[untouched], base[untouched]) and not torch.equal(got[0], base[0])


def test_the_reference_is_shrink_then_expand_per_segment():
    x, a, b = torch.randn(5, 4), torch.randn(2, 3, 4), torch.randn(2, 6, 3)
    y = torch.zeros(5, 6)
    lora_reference(y, x, a, b, LoRASegments.build([1], [3], [1], torch.device("cpu")))
    torch.testing.assert_close(y[1:4], x[1:4] @ a[1].T @ b[1].T)
    assert torch.equal(y[0], torch.zeros(6)) and torch.equal(y[4], torch.zeros(6))


# -- reading adapters ---------------------------------------------------------------------------


def write_adapter(directory: Path, rank: int = 2, projections=("q_proj", "down_proj"), config: dict | None = None,
                  tensors: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "use_dora": False} | (config or {})
    (directory / "adapter_config.json").write_text(json.dumps(body))
    if tensors is None:
        tensors = {}
        for layer in range(2):
            for proj in projections:
                block = "self_attn" if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
                fan_in, fan_out = SHAPE.features[proj]
                tensors[f"{PREFIX}.{layer}.{block}.{proj}.lora_A.weight"] = torch.randn(rank, fan_in)
                tensors[f"{PREFIX}.{layer}.{block}.{proj}.lora_B.weight"] = torch.randn(fan_out, rank)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def test_an_adapter_is_read_with_its_scaling(tmp_path):
    adapter = load_adapter("x", write_adapter(tmp_path / "x", rank=4), SHAPE, max_rank=8)
    assert adapter.rank == 4 and adapter.scaling == 2.0 and set(adapter.pairs) == {(0, "q_proj"), (0, "down_proj"), (1, "q_proj"), (1, "down_proj")}
    rs = load_adapter("rs", write_adapter(tmp_path / "rs", rank=4, config={"use_rslora": True}), SHAPE, max_rank=8)
    assert rs.scaling == 8 / 2  # alpha / sqrt(r)
    older = {k.replace("base_model.model.model.language_model.", "base_model.model.language_model.model."): v
             for k, v in _tensors(tmp_path / "x").items()}
    assert set(load_adapter("old", write_adapter(tmp_path / "old", rank=4, tensors=older), SHAPE, 8).pairs) == set(adapter.pairs)


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "adapter_model.safetensors"))


@pytest.mark.parametrize("config,match", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "biases"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"r": 16}, "exceeds max_lora_rank=8"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, config, match):
    directory = write_adapter(tmp_path / "a", config=config)
    with pytest.raises(AdapterError, match=match) as err:
        load_adapter("a", directory, SHAPE, max_rank=8)
    assert "adapter_config.json" in str(err.value)


@pytest.mark.parametrize("key,shape,match", [
    ("base_model.model.model.vision_tower.encoder.layers.0.self_attn.q_proj.lora_A.weight", (2, 16), "vision tower"),
    ("base_model.model.model.visual.blocks.0.attn.qkv.lora_A.weight", (2, 16), "vision tower"),
    ("base_model.model.lm_head.lora_A.weight", (2, 16), "LM head"),
    (f"{PREFIX}.0.self_attn.rotary.lora_A.weight", (2, 16), "not a LoRA weight of a decoder projection"),
    (f"{PREFIX}.5.self_attn.q_proj.lora_A.weight", (2, 16), "layer 5 does not exist"),
    (f"{PREFIX}.0.self_attn.q_proj.lora_A.weight", (2, 12), r"shape \(2, 12\), expected \(2, 16\)"),
])
def test_tensors_that_do_not_fit_are_refused_naming_the_tensor(tmp_path, key, shape, match):
    tensors = _tensors(write_adapter(tmp_path / "ok"))
    tensors.pop(f"{PREFIX}.0.self_attn.q_proj.lora_A.weight")
    tensors[key] = torch.randn(*shape)
    if "q_proj.lora_A" not in key or "layers.0" not in key:
        tensors[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"] = torch.randn(2, 16)
    directory = write_adapter(tmp_path / "bad", tensors=tensors)
    with pytest.raises(AdapterError, match=match):
        load_adapter("bad", directory, SHAPE, max_rank=8)


def test_missing_and_corrupt_files_are_refused(tmp_path):
    with pytest.raises(AdapterError, match="is not a directory"):
        load_adapter("a", tmp_path / "nowhere", SHAPE, 8)
    directory = write_adapter(tmp_path / "a")
    (directory / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        load_adapter("a", directory, SHAPE, 8)
    (directory / "adapter_model.safetensors").unlink()
    (directory / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(AdapterError, match="safe_serialization"):
        load_adapter("a", directory, SHAPE, 8)
    half = _tensors(write_adapter(tmp_path / "b"))
    half.pop(f"{PREFIX}.1.mlp.down_proj.lora_B.weight")
    with pytest.raises(AdapterError, match=r"layers.1.down_proj: lora_B is missing"):
        load_adapter("c", write_adapter(tmp_path / "c", tensors=half), SHAPE, 8)


# -- the books ----------------------------------------------------------------------------------


def test_slots_are_reused_lru_but_never_one_a_step_or_a_running_request_needs(tmp_path):
    manager = LoRAManager(SHAPE, max_loras=2, max_rank=4, max_cpu_loras=2)
    keys = [manager.add(LoRARequest(n, str(write_adapter(tmp_path / n)))) for n in "abc"]
    loaded = []
    load = lambda slot, adapter: loaded.append((slot, adapter.name))  # noqa: E731
    assert manager.activate([keys[0], keys[1]], set(), load) == {keys[0]: 0, keys[1]: 1}
    manager.activate([keys[1]], set(), load)  # "a" is now the least recently used
    assert manager.activate([keys[2]], {keys[1]}, load) == {keys[2]: 0}  # "a" goes, not running "b"
    assert manager.activate([keys[2]], {keys[2]}, load) == {keys[2]: 0} and len(loaded) == 3  # resident: no load
    assert manager.activate([keys[0]], {keys[1], keys[0]}, load) == {keys[0]: 0}  # "c" is neither needed nor running
    assert loaded == [(0, "a"), (1, "b"), (0, "c"), (0, "a")]
    # three adds, then every load that missed the two host copies read its files again (LRU host memory)
    assert manager.stats()["lora_slot_evictions"] == 2 and manager.stats()["lora_disk_reads"] == 3 + 4


def test_a_failed_slot_load_leaves_the_slot_booked_empty(tmp_path):
    manager = LoRAManager(SHAPE, max_loras=1, max_rank=4)
    key = manager.add(LoRARequest("a", str(write_adapter(tmp_path / "a"))))

    def failing(slot, adapter):
        raise MemoryError("injected")

    with pytest.raises(MemoryError):
        manager.activate([key], set(), failing)
    assert manager.slots == [None]


def test_registration_rules(tmp_path):
    manager = LoRAManager(SHAPE, max_loras=1, max_rank=4)
    first = manager.add(LoRARequest("a", str(write_adapter(tmp_path / "a"))))
    assert manager.add(LoRARequest("a", str(tmp_path / "a"))) == first  # the same again: no-op
    with pytest.raises(AdapterError, match="already registered"):
        manager.add(LoRARequest("a", str(write_adapter(tmp_path / "other"))))
    with pytest.raises(UnknownAdapterError, match="unknown LoRA adapter 'zzz'"):
        manager.key_of("zzz")
    with pytest.raises(AdapterInUseError, match="2 queued or running"):
        manager.remove("a", in_use=lambda key: 2)
    assert manager.remove("a", in_use=lambda key: 0) == first and manager.remove("a", in_use=lambda key: 0) is None
    # new weights under the old name get a new key: their blocks never hit the old ones
    write_adapter(tmp_path / "a", rank=3)
    assert manager.add(LoRARequest("a", str(tmp_path / "a"))) != first


def test_the_scheduler_admits_at_most_max_loras_adapters_at_once():
    scheduler = make_scheduler(max_loras=2, enable_lora=True)
    for i, name in enumerate(["a", "b", "c", "a", None, "c"]):
        scheduler.add_request(make_request(f"r{i}", 8, lora_name=name, tokens=list(range(100 * i, 100 * i + 8))))
    scheduler.schedule()
    running = {r.request_id for r in scheduler.running}
    assert running == {"r0", "r1", "r3", "r4"}  # "c" waits: two adapters already run
    for request in list(scheduler.running):
        if request.lora_name == "b":
            scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
    scheduler.schedule()
    assert {"r2", "r5"} <= {r.request_id for r in scheduler.running}


# -- the engine API -----------------------------------------------------------------------------


def test_engine_api_errors(checkpoint_dir, tmp_path):
    from mmengine import MMEngine

    plain = MMEngine(str(checkpoint_dir()), max_model_len=128)
    with pytest.raises(UnknownAdapterError, match="without enable_lora=True"):
        plain.generate("USER: hi ASSISTANT:", lora="x", use_tqdm=False)
    with pytest.raises(ConfigError, match="enable_lora=True"):
        plain.add_lora(LoRARequest("x", str(tmp_path)))
    assert plain.list_loras() == []
    engine = MMEngine(str(checkpoint_dir()), max_model_len=128, enable_lora=True, max_lora_rank=4)
    with pytest.raises(UnknownAdapterError, match="prompt 1: unknown LoRA adapter 'nope'"):
        engine.generate(["USER: hi ASSISTANT:"] * 2, lora=[None, "nope"], use_tqdm=False)
    with pytest.raises(AdapterError, match="adapter_config.json is missing"):
        engine.add_lora(LoRARequest("empty", str(tmp_path)))
    assert engine.list_loras() == [] and engine.stats()["requests_waiting"] == 0
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        MMEngine(str(checkpoint_dir()), enable_lora=True, max_loras=4, max_cpu_loras=2)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["reference", "triton"])
def test_graph_style_segments_skip_rows_on_slot_minus_one(use_kernels, no_tf32):
    """A decode graph's segments: one per row from device buffers, -1 for rows without an adapter."""
    # the kernels run where Triton does: compiled on a GPU, else in the interpreter on CPU tensors
    device = "cuda" if use_kernels and torch.cuda.is_available() else "cpu"
    x, a, b = (torch.randn(*shape).to(device) for shape in ((4, 8), (2, 4, 8), (2, 6, 4)))
    slots = torch.tensor([1, -1, 0, -1], dtype=torch.int32, device=device)
    segments = LoRASegments(torch.arange(4, dtype=torch.int32, device=device), torch.ones(4, dtype=torch.int32, device=device),
                            slots, max_len=1)
    y = torch.zeros(4, 6, device=device)
    add_lora(y, x, a, b, segments, use_kernels)
    torch.testing.assert_close(y[0], x[0] @ a[1].T @ b[1].T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y[2], x[2] @ a[0].T @ b[0].T, atol=1e-5, rtol=1e-5)
    assert not y[1].any() and not y[3].any()


def test_an_adapter_removed_while_a_prompt_is_preprocessed_is_refused_at_queueing(checkpoint_dir, tmp_path):
    from mmengine import MMEngine

    engine = MMEngine(str(checkpoint_dir()), max_model_len=128, enable_lora=True, max_lora_rank=4)
    from mmengine.testing.lora import build_random_adapter

    engine.add_lora(LoRARequest("a", str(build_random_adapter(checkpoint_dir(), tmp_path / "a", rank=2))))
    original = engine.input_processor.process

    def remove_meanwhile(*args, **kwargs):
        processed = original(*args, **kwargs)
        assert engine.remove_lora("a")  # no request uses it yet
        return processed

    engine.input_processor.process = remove_meanwhile
    with pytest.raises(UnknownAdapterError, match="'a' was removed before the request was queued"):
        engine.generate(["USER: hi ASSISTANT:"], lora="a", use_tqdm=False)
    assert not engine.has_unfinished_requests() and engine.list_loras() == []
    engine.add_lora(LoRARequest("a", str(tmp_path / "a")))
    with pytest.raises(UnknownAdapterError, match="'a' was removed before the request was queued"):  # add_request alike
        engine.add_request("USER: hi ASSISTANT:", lora="a")
    assert not engine.has_unfinished_requests()
