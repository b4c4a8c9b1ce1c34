"""Weight updates with requests in flight (engine.update_weights, reset_prefix_cache, reset_encoder_cache):
one rule for every cache group. A request running across the update computes nothing that is cached again
(full KV blocks, the sliding-window pool's blocks, recurrent-state checkpoints, encoder outputs), so a
request made after the update gets what an engine started on the updated checkpoint gives, hits included."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from books import assert_books_consistent
from mmengine import MMEngine, SamplingParams
from mmengine.errors import ConfigError, InvalidInputError, WeightsMismatchError
from mmengine.models.loader import iter_checkpoint
from mmengine.testing.gemma4 import gemma4_prompt
from mmengine.testing.images import make_test_image
from mmengine.testing.qwen_vl import qwen_vl_prompt

QUESTION = "Tell me about the red square and the blue circle, then count to ten slowly, please, one by one."
PICTURE = make_test_image(7, (64, 48))
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5)


def perturbed(path: Path, seed: int, only: str | None = None) -> dict[str, torch.Tensor]:
    """Every floating tensor of the checkpoint (or those whose name contains `only`) moved by seeded noise of
    a fifth of its own spread: a weight update as an RL step makes one."""
    generator = torch.Generator().manual_seed(seed)
    moved = {}
    for name, tensor in iter_checkpoint(path):
        if not tensor.is_floating_point() or (only is not None and only not in name):
            continue
        spread = tensor.float().std().item() if tensor.numel() > 1 else 0.0
        noise = torch.randn(tensor.shape, generator=generator) * (0.2 * spread or 0.02)
        moved[name] = (tensor.float() + noise).to(tensor.dtype)
    return moved


def updated_checkpoint(path: Path, weights: dict[str, torch.Tensor], out: Path) -> Path:
    """A copy of the checkpoint with `weights` in place of its own: where a fresh engine starts from."""
    shutil.copytree(path, out)
    tensors = dict(iter_checkpoint(path))
    tensors.update(weights)
    for stale in out.glob("*.safetensors*"):
        stale.unlink()
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(out / "model.safetensors"))
    return out


# (family, engine options, prompt, pictures): chunks small enough that the update lands mid-prompt (LLaVA's
# inside its picture, whose encoder output the request still reads then)
CASES = {
    "llava": (dict(max_num_batched_tokens=12, block_size=8), "USER: <image>\n" + QUESTION + " ASSISTANT:", [PICTURE]),
    "gemma4": (dict(max_num_batched_tokens=80, block_size=8, sliding_kv_ratio=0.5), gemma4_prompt(QUESTION * 2, 1), [PICTURE]),
    "qwen3_5": (dict(max_num_batched_tokens=16, block_size=16), qwen_vl_prompt(QUESTION, 1), [PICTURE]),
}


def _engine(path: Path, options: dict) -> MMEngine:
    return MMEngine(str(path), device="cpu", dtype="float32", max_model_len=512, enforce_eager=True,
                    enable_prefix_grouping=False, **options)


def _run_until_done(engine: MMEngine, bound: int = 200) -> None:
    for _ in range(bound):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError(f"requests still unfinished after {bound} steps")


@pytest.mark.parametrize("family", sorted(CASES))
def test_a_request_running_across_an_update_leaves_nothing_stale_in_any_cache(family, family_checkpoint, tmp_path):
    options, prompt, pictures = CASES[family]
    path = family_checkpoint(family)
    weights = perturbed(path, seed=3)
    expected = _engine(updated_checkpoint(path, weights, tmp_path / "updated"), options).generate(
        prompt, images=pictures, sampling_params=PARAMS, use_tqdm=False)[0]

    engine = _engine(path, options)
    engine.add_request(prompt, pictures, PARAMS, request_id="across")
    across = engine.scheduler.requests["across"]
    (picture,) = across.mm_items
    inside = family == "llava"  # the update lands inside the picture (else past it, and halfway through the text)
    while across.num_computed_tokens < (picture.offset + 1 if inside else across.num_prompt_tokens // 2):
        engine.step()
    assert picture.offset < across.num_computed_tokens < (picture.end if inside else across.num_prompt_tokens)
    assert engine.update_weights(weights) > len(weights) // 2  # (tensors the model skips at load, it skips here too)
    assert engine.stats()["kv_blocks_cached"] == 0
    engine.add_request(prompt, pictures, PARAMS, request_id="after")  # computes every block again, while "across" runs on
    _run_until_done(engine)
    assert_books_consistent(engine)

    again = engine.generate(prompt, images=pictures, sampling_params=PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # a prefix hit, on what "after" cached
    assert again.token_ids == expected.token_ids
    for got, want in zip(again.logprobs, expected.logprobs):
        assert [token for token, _ in got.top] == [token for token, _ in want.top]
        assert [value for _, value in got.top] == pytest.approx([value for _, value in want.top], abs=1e-4)
    assert_books_consistent(engine)


def test_a_decoder_only_update_keeps_the_encoder_cache(family_checkpoint):
    """Pictures' embeddings depend on the tower alone: an update of the decoder keeps them (no encoder run
    again), an update of the tower drops them."""
    options, prompt, pictures = CASES["llava"]
    path = family_checkpoint("llava")
    engine = _engine(path, options)
    engine.generate(prompt, images=pictures, sampling_params=PARAMS, use_tqdm=False)
    runs = engine.stats()["encoder_runs"]
    engine.update_weights(perturbed(path, seed=4, only="language_model"))
    engine.generate(prompt, images=pictures, sampling_params=PARAMS, use_tqdm=False)
    assert engine.stats()["encoder_runs"] == runs
    engine.update_weights(perturbed(path, seed=5, only="vision_tower"))
    engine.generate(prompt, images=pictures, sampling_params=PARAMS, use_tqdm=False)
    assert engine.stats()["encoder_runs"] == runs + 1


def test_bad_updates_are_refused_by_name_and_the_engine_serves_on(family_checkpoint, tmp_path):
    options, prompt, pictures = CASES["llava"]
    path = family_checkpoint("llava")
    engine = _engine(path, options)
    before = engine.generate(prompt, images=pictures, sampling_params=PARAMS, use_tqdm=False)[0].token_ids
    name, tensor = next(iter(iter_checkpoint(path)))
    with pytest.raises(WeightsMismatchError, match=r"unexpected tensor 'no.such.weight'"):
        engine.update_weights({"no.such.weight": torch.zeros(2)})
    with pytest.raises(WeightsMismatchError, match=rf"tensor '{name}' has shape \[1\], expected"):
        engine.update_weights({name: torch.zeros(1)})
    with pytest.raises(WeightsMismatchError, match=rf"tensor '{name}' loads the same parameter"):
        engine.update_weights([(name, tensor), (name, tensor)])
    with pytest.raises(InvalidInputError, match="not a checkpoint directory"):
        engine.update_weights(str(tmp_path / "missing"))
    with pytest.raises(InvalidInputError, match=r"item 0 is not a \(name, tensor\) pair"):
        engine.update_weights([name])
    # every refusal left the weights as they were (the pair given twice loaded the same values once)
    assert engine.generate(prompt, images=pictures, sampling_params=PARAMS, use_tqdm=False)[0].token_ids == before
    assert engine.update_weights(str(path)) > 0  # a checkpoint directory, the same weights
    assert engine.generate(prompt, images=pictures, sampling_params=PARAMS, use_tqdm=False)[0].token_ids == before
    assert_books_consistent(engine)


def test_update_weights_refuses_weights_the_quantized_kernels_hold():
    """The runner refuses to replace weights its quantized kernels hold, by name (no such engine on CPU:
    the check itself)."""
    from mmengine.runner.model_runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    runner.num_quantized_projections = 3
    with pytest.raises(ConfigError, match="3 projections run on quantized weights"):
        runner.update_weights([], [])


def test_the_async_engine_updates_between_steps_with_a_stream_in_flight(family_checkpoint):
    """AsyncMMEngine.update_weights takes the engine between two steps: the stream it was called from
    finishes, the books agree, and a request after it gets the (here unchanged) checkpoint's answer."""
    import asyncio

    from mmengine import AsyncMMEngine

    options, prompt, pictures = CASES["llava"]
    path = family_checkpoint("llava")
    engine = _engine(path, options)
    expected = engine.generate(prompt, images=pictures, sampling_params=PARAMS, use_tqdm=False)[0].token_ids
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def main() -> tuple[int, int, list[int]]:
        async with AsyncMMEngine(engine) as async_engine:
            stream = await async_engine.add_request(prompt, pictures, long)
            loaded, seen = 0, 0
            async for delta in stream:
                seen += len(delta.token_ids)
                if seen >= 3 and not loaded:  # the stream is mid-answer
                    loaded = await async_engine.update_weights(str(path))
            after = await async_engine.add_request(prompt, pictures, PARAMS)
            return loaded, seen, [token async for delta in after for token in delta.token_ids]

    loaded, seen, tokens = asyncio.run(asyncio.wait_for(main(), 120))
    assert loaded > 0 and seen == 40 and tokens == expected
    assert not engine.has_unfinished_requests()
    assert_books_consistent(engine)
