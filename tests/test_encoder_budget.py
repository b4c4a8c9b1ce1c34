"""The autotuned encoder budget: the formula, the `mmengine budget` CLI, and what the engine uses."""

from __future__ import annotations

import json
import logging
import math
import shutil
import subprocess
import sys

import pytest
import torch

from mmengine import MMEngine, SamplingParams
from mmengine.cli import main
from mmengine.encoder_cache.budget import compute_encoder_budget
from mmengine.models.llava import LlavaFamily
from mmengine.errors import ItemTooLargeError, UnsupportedModelError
from mmengine.models.loader import checkpoint_dtype
from mmengine.models.registry import load_hf_config
from mmengine.testing import TinyLlavaSpec, build_llava_checkpoint, make_test_image


def expected(m, batched, seqs, limit, pinned, override=None):
    per_step = 1 if m > batched else math.ceil(batched / m)
    num_items = min(per_step + 1, seqs * limit)
    compute = num_items * m if override is None else max(override, m)
    return per_step, num_items, compute, compute + pinned


@pytest.mark.parametrize(
    "m,batched,seqs,limit,override",
    [(576, 2048, 64, 1, None), (576, 512, 64, 4, None), (16, 2048, 64, 8, None), (16, 8, 3, 2, None),
     (729, 8192, 2, 1, None), (576, 2048, 64, 1, 10_000), (576, 2048, 64, 1, 100)],
)
def test_formula(m, batched, seqs, limit, override):
    budget = compute_encoder_budget(m, batched, seqs, {"image": limit}, pinned_room_tokens=4096, bytes_per_token=8192, encoder_cache_size=override)
    per_step, num_items, compute, capacity = expected(m, batched, seqs, limit, 4096, override)
    assert (budget.items_per_step, budget.num_items, budget.compute_budget_tokens) == (per_step, num_items, compute)
    assert budget.cache_capacity_tokens == capacity and budget.cache_bytes == capacity * 8192


def test_small_override_is_raised_to_one_item_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        budget = compute_encoder_budget(576, 2048, 8, {"image": 1}, 0, 2, encoder_cache_size=100)
    assert budget.compute_budget_tokens == 576 and "raised to 576" in caplog.text


@pytest.mark.parametrize(
    "args,batched,seqs,limit,override",
    [([], 2048, 64, 8, None), (["--max-num-batched-tokens", "8", "--max-num-seqs", "3", "--limit-mm-per-prompt", "image=2"], 8, 3, 2, None),
     (["--max-num-batched-tokens", "100"], 100, 64, 8, None), (["--encoder-cache-size", "40"], 2048, 64, 8, 40),
     (["--max-num-seqs", "1", "--limit-mm-per-prompt", "image=1"], 2048, 1, 1, None)],
)
def test_cli_json_matches_the_formula(checkpoint_dir, capsys, args, batched, seqs, limit, override):
    path = checkpoint_dir()
    argv = ["budget", "--model", str(path), "--json", "--num-kv-blocks", "10", "--block-size", "8", "--device", "cpu", *args]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    per_step, num_items, compute, capacity = expected(16, batched, seqs, limit, 80, override)
    assert report["max_tokens_per_item"] == 16
    assert (report["items_per_step"], report["slack_items"], report["num_items"]) == (per_step, 1, num_items)
    assert report["items_cap"] == seqs * limit
    assert report["compute_budget_tokens"] == compute and report["cache_capacity_tokens"] == capacity
    assert report["cache_bytes"] == capacity * 64 * 4  # hidden 64, float32 (dtype auto on CPU)


def test_cli_human_output_names_every_term_and_source(checkpoint_dir):
    result = subprocess.run(
        [sys.executable, "-m", "mmengine.cli", "budget", "--model", str(checkpoint_dir()), "--max-num-seqs", "4"],
        capture_output=True, text=True, check=True,
    )
    out = result.stdout
    for term in ("M (max embeddings per item)", "items per step", "slack items", "items cap", "num items",
                 "compute budget", "pinned room", "cache capacity", "cache size (bytes)"):
        assert term in out
    assert "max_num_seqs=4 (--max-num-seqs)" in out and "max_num_batched_tokens=2048 (default)" in out
    assert "image_size 32 / patch_size 8" in out


@pytest.mark.parametrize("weights_dtype", ["float32", "bfloat16"])
def test_engine_uses_the_same_budget_as_the_cli(checkpoint_dir, tmp_path, capsys, weights_dtype):
    """Device and dtype left to auto on both sides: the CLI resolves them as the engine does (fp32 on
    CPU whatever the checkpoint holds; the checkpoint's 16-bit dtype, else bf16, on a GPU)."""
    path = checkpoint_dir() if weights_dtype == "float32" else build_llava_checkpoint(tmp_path / "m", dtype=weights_dtype)
    assert checkpoint_dtype(path) == getattr(torch, weights_dtype)
    engine = MMEngine(str(path), max_model_len=256, block_size=8, max_num_seqs=3, max_num_batched_tokens=40)
    main(["budget", "--model", str(path), "--json", "--block-size", "8", "--max-num-seqs", "3",
          "--max-num-batched-tokens", "40", "--num-kv-blocks", str(engine.kv_cache.num_blocks)])
    report = json.loads(capsys.readouterr().out)
    assert report == engine.encoder_budget.to_json()
    assert report["bytes_per_token"] == 64 * engine.dtype.itemsize
    assert engine.encoder_cache.capacity == engine.encoder_budget.cache_capacity_tokens


def _bytes_per_token(path, capsys, *args: str) -> int:
    assert main(["budget", "--model", str(path), "--json", "--num-kv-blocks", "4", *args]) == 0
    return json.loads(capsys.readouterr().out)["bytes_per_token"]


def test_cli_dtype_follows_device_and_flag(checkpoint_dir, tmp_path, capsys):
    bf16 = build_llava_checkpoint(tmp_path / "bf16", dtype="bfloat16")
    assert _bytes_per_token(checkpoint_dir(), capsys, "--device", "cpu") == 64 * 4
    assert _bytes_per_token(bf16, capsys, "--device", "cpu") == 64 * 4  # auto on CPU is fp32, not the checkpoint's bf16
    assert _bytes_per_token(bf16, capsys, "--device", "cpu", "--dtype", "bfloat16") == 64 * 2
    assert _bytes_per_token(checkpoint_dir(), capsys, "--device", "cpu", "--dtype", "float16") == 64 * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; without one --device cuda is an error (tested)")
def test_cli_dtype_auto_on_cuda_is_16_bit(checkpoint_dir, tmp_path, capsys):
    half = build_llava_checkpoint(tmp_path / "fp16", dtype="float16")
    # auto on CUDA: bf16 (fp16 where bf16 is unsupported) for a float32 checkpoint, never its fp32
    assert _bytes_per_token(checkpoint_dir(), capsys, "--device", "cuda") == 64 * 2
    assert _bytes_per_token(half, capsys, "--device", "cuda") == 64 * 2
    assert _bytes_per_token(checkpoint_dir(), capsys, "--device", "cuda", "--dtype", "float32") == 64 * 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: --device cuda is valid here (tested)")
def test_cli_device_cuda_without_a_gpu_is_a_clean_error(checkpoint_dir, capsys):
    assert main(["budget", "--model", str(checkpoint_dir()), "--device", "cuda"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize("vision,strategy", [("clip", "default"), ("clip", "full"), ("siglip", "full"), ("siglip", "default")])
def test_max_tokens_per_item_matches_what_the_processor_produces(checkpoint_dir, vision, strategy):
    path = checkpoint_dir(TinyLlavaSpec(vision_model=vision, vision_feature_select_strategy=strategy))
    engine = MMEngine(str(path), max_model_len=256)
    processed = engine.input_processor.process("USER: <image>\nhi", [make_test_image(0)], SamplingParams())
    assert processed.mm_items[0].length == LlavaFamily(load_hf_config(path)).max_tokens_per_item() == engine.family.max_tokens_per_item()
    (out,) = engine.generate("USER: <image>\nhi", images=[make_test_image(0)], use_tqdm=False)  # and the encoder agrees
    assert out.finished


def test_a_processor_that_disagrees_with_the_model_is_rejected_at_start_up(checkpoint_dir, tmp_path):
    path = tmp_path / "mismatched"
    shutil.copytree(checkpoint_dir(), path)
    config = json.loads((path / "processor_config.json").read_text())
    config["image_processor"]["crop_size"] = {"height": 64, "width": 64}
    config["image_processor"]["size"] = {"shortest_edge": 64}
    (path / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"into 128 placeholder tokens but the model makes 32 embeddings for them \(\[16, 16\]\)"):
        MMEngine(str(path), max_model_len=256)


def test_an_item_bigger_than_one_steps_encoder_budget_is_rejected_at_input(checkpoint_dir):
    """Unreachable for fixed-size LLaVA-1.5 items (the budget is at least M); the guard for models whose
    items vary in size, exercised by shrinking the bound the engine hands the processor."""
    engine = MMEngine(str(checkpoint_dir()), max_model_len=256)
    engine.input_processor.max_tokens_per_item = 8
    with pytest.raises(ItemTooLargeError, match="prompt 1: image 0 needs 16 embeddings"):
        engine.generate(["USER: hi", "USER: <image>\nhi"], images=[[], [make_test_image(0)]], use_tqdm=False)
    assert not engine.has_unfinished_requests()


def test_a_video_counts_as_its_items_in_the_cap():
    """One sequence with one video may need a whole step's worth of items (its temporal patches): the
    cap counts a video as the most items it can make, not as one."""
    as_one = compute_encoder_budget(100, 2048, 1, {"image": 2, "video": 1}, 0, 2)
    as_items = compute_encoder_budget(100, 2048, 1, {"image": 2, "video": 1}, 0, 2, items_per_video=30)
    assert (as_one.items_cap, as_one.num_items) == (2, 2)
    assert (as_items.items_cap, as_items.num_items) == (30, 22)  # min(ceil(2048 / 100) + 1, 30)
