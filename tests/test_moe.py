"""Mixture-of-experts families (Qwen3-VL-MoE, Qwen3.5-MoE; 8 experts, top-2 in the tiny checkpoints):
greedy tokens equal transformers' with 0-2 pictures and a video, chunked prefill and prefix hits; a
batch gives each prompt its tokens alone; the router and experts equal transformers' modules (ties
included); per-expert checkpoints are stacked at load and a missing expert tensor is named."""

from __future__ import annotations

import pytest
import torch

from conftest import KERNEL_FP32, hf_greedy
from mmengine import MMEngine, SamplingParams
from mmengine.errors import UnsupportedModelError, WeightsMismatchError
from mmengine.layers.moe import FusedExperts, SparseMoeBlock
from mmengine.models.loader import fuse_expert_tensors
from mmengine.testing import make_test_image
from mmengine.testing.qwen_vl import qwen_vl_prompt

PICTURES = [make_test_image(31, size=(96, 96)), make_test_image(32, size=(64, 160))]
MOE = ["qwen3_vl_moe", "qwen3_5_moe"]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunks-of-8"])
def test_greedy_tokens_equal_transformers(family_checkpoint, name, chunk):
    path = family_checkpoint(name)
    engine = MMEngine(str(path), device="cpu", dtype="float32", **({"max_num_batched_tokens": chunk} if chunk else {}))
    prompts = [qwen_vl_prompt(f"Question {n}: compare them and say more.", n) for n in (0, 1, 2)]
    outs = engine.generate(prompts, images=[None, PICTURES[:1], PICTURES], sampling_params=_greedy(8), use_tqdm=False)
    for n, out in enumerate(outs):
        assert out.token_ids == hf_greedy(path, prompts[n], PICTURES[:n] or None, 8, ignore_eos=True)


@pytest.mark.parametrize("name", MOE)
def test_a_batch_and_prefix_hits_give_each_prompt_its_tokens_alone(family_checkpoint, name):
    path = family_checkpoint(name)
    prompts = [qwen_vl_prompt(f"Item {i}: " + "tell me more. " * (i % 4), i % 3) for i in range(8)]
    images = [PICTURES[: i % 3] or None for i in range(8)]
    engine = MMEngine(str(path), device="cpu", dtype="float32", block_size=8)
    together = engine.generate(prompts, images=images, sampling_params=_greedy(6), use_tqdm=False)
    again = engine.generate(prompts, images=images, sampling_params=_greedy(6), use_tqdm=False)  # prefix hits now
    assert engine.stats()["prefix_cache_hits"] > 0
    plain = MMEngine(str(path), device="cpu", dtype="float32", enable_prefix_caching=False)
    alone = [plain.generate(p, images=i, sampling_params=_greedy(6), use_tqdm=False)[0].token_ids for p, i in zip(prompts, images)]
    assert [o.token_ids for o in together] == alone
    assert [o.token_ids for o in again] == alone


@pytest.mark.parametrize("name", MOE)
def test_preemption_recomputes_to_the_same_tokens(family_checkpoint, name):
    path = family_checkpoint(name)
    prompts = [qwen_vl_prompt(f"Question {i}: " + "what is here? " * (i % 3), i % 2) for i in range(6)]
    images = [PICTURES[: i % 2] or None for i in range(6)]
    engine = MMEngine(str(path), device="cpu", dtype="float32", block_size=4, num_kv_blocks=40, enable_prefix_grouping=False)
    outs = engine.generate(prompts, images=images, sampling_params=_greedy(16), use_tqdm=False)
    assert engine.stats()["num_preemptions"] > 0
    for prompt, pics, out in zip(prompts, images, outs):
        assert out.token_ids == hf_greedy(path, prompt, pics, 16, ignore_eos=True)


def test_a_video_on_qwen3_vl_moe_equals_transformers(family_checkpoint):
    from test_video import VIDEO, chat, hf_video_greedy

    from mmengine.testing.video import make_test_clip

    path = family_checkpoint("qwen3_vl_moe")
    engine = MMEngine(str(path), device="cpu", dtype="float32", limit_mm_per_prompt={"image": 1, "video": 1})
    prompt, videos = chat(VIDEO + "What happens?"), [make_test_clip(6)]
    (out,) = engine.generate(prompt, videos=videos, sampling_params=_greedy(6), use_tqdm=False)
    assert out.token_ids == hf_video_greedy(engine, path, prompt, [], videos, 6)


def test_the_router_and_experts_equal_transformers_modules_ties_included():
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = Qwen3_5MoeTextConfig(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=24, hidden_act="silu")
    torch.manual_seed(0)
    reference = Qwen3_5MoeSparseMoeBlock(config)
    for param in reference.parameters():
        torch.nn.init.normal_(param, std=0.2)
    with torch.no_grad():
        reference.gate.weight[3] = reference.gate.weight[5]  # experts 3 and 5 tie for every token
    from mmengine.models.llama import DecoderMLP

    ours = SparseMoeBlock(config, DecoderMLP(config, config.shared_expert_intermediate_size))
    state = dict(reference.state_dict())
    for proj in ("gate_proj", "up_proj"):
        state.pop(f"shared_expert.{proj}.weight")
    state["shared_expert.gate_up_proj.weight"] = torch.cat([reference.shared_expert.gate_proj.weight,
                                                            reference.shared_expert.up_proj.weight])
    ours.load_state_dict(state, strict=True)
    x = torch.randn(37, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference(x[None])[0], atol=1e-6, rtol=1e-5)
        _, theirs_weights, theirs_experts = reference.gate(x)
        weights, experts = ours.gate(x)
    assert torch.equal(experts, theirs_experts) and torch.equal(weights, theirs_weights)
    assert (experts == 3).any() or (experts == 5).any()


def test_experts_that_get_no_token_are_skipped():
    experts = FusedExperts(4, 8, 6, "silu")
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    x = torch.randn(5, 8)
    ids = torch.tensor([[0, 2]] * 5)
    weights = torch.full((5, 2), 0.5)
    expected = sum(0.5 * (torch.nn.functional.silu(x @ experts.gate_up_proj[e, :6].T) * (x @ experts.gate_up_proj[e, 6:].T))
                   @ experts.down_proj[e].T for e in (0, 2))
    with torch.no_grad():
        torch.testing.assert_close(experts(x, weights, ids), expected, atol=1e-5, rtol=1e-5)


def test_per_expert_tensors_are_stacked_and_a_missing_one_is_named():
    tensors = [(f"m.layers.0.mlp.experts.{e}.{p}.weight", torch.full((2, 3) if p != "down_proj" else (3, 2), float(e)))
               for e in range(2) for p in ("gate_proj", "up_proj", "down_proj")]
    fused = dict(fuse_expert_tensors([("other", torch.zeros(1)), *tensors], num_experts=2))
    assert fused["m.layers.0.mlp.experts.gate_up_proj"].shape == (2, 4, 3) and "other" in fused
    assert fused["m.layers.0.mlp.experts.down_proj"][1].eq(1).all()
    with pytest.raises(WeightsMismatchError, match=r"lacks 1 expert tensor\(s\): m.layers.0.mlp.experts.1.down_proj.weight"):
        list(fuse_expert_tensors(tensors[:-1], num_experts=2))
    with pytest.raises(WeightsMismatchError, match="names expert 2, but the model has 2"):
        list(fuse_expert_tensors([("x.experts.2.up_proj.weight", torch.zeros(1))], num_experts=2))


def test_lora_on_a_moe_decoder_is_refused_by_name(family_checkpoint):
    with pytest.raises(UnsupportedModelError, match="LoRA adapters are not supported on mixture-of-experts decoders"):
        MMEngine(str(family_checkpoint("qwen3_vl_moe")), enable_lora=True, max_loras=1, max_lora_rank=8)


@pytest.mark.parametrize("name", MOE)
def test_the_fused_moe_kernel_in_the_engine_matches_transformers(family_checkpoint, no_tf32, name):
    """The Triton backend with the fused kernels (the MoE kernel among them): compiled on a GPU, in
    Triton's interpreter on CPU."""
    path = family_checkpoint(name)
    engine = MMEngine(str(path), max_model_len=256, attn_backend="triton", enforce_eager=True, **KERNEL_FP32.engine_kwargs)
    prompt = qwen_vl_prompt("Compare them.", 1)
    from mmengine.kernels import fused_moe as kernel_module

    calls = {"n": 0}
    original = kernel_module.fused_moe

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    kernel_module.fused_moe = counted
    try:
        (out,) = engine.generate(prompt, images=PICTURES[:1], sampling_params=_greedy(4), use_tqdm=False)
    finally:
        kernel_module.fused_moe = original
    assert calls["n"] > 0  # the kernel ran, not the PyTorch experts
    assert out.token_ids == hf_greedy(path, prompt, PICTURES[:1], 4, KERNEL_FP32, ignore_eos=True)


def test_the_budget_counts_every_experts_weights(family_checkpoint, capsys):
    from mmengine.cli import main

    path = family_checkpoint("qwen3_vl_moe")
    main(["budget", "--model", str(path), "--device", "cpu"])
    shown = capsys.readouterr().out
    engine = MMEngine(str(path), device="cpu", dtype="float32")
    params = sum(p.numel() for p in engine.runner.model.parameters())
    routed = sum(layer.mlp.experts.gate_up_proj.numel() + layer.mlp.experts.down_proj.numel()
                 for layer in engine.runner.model.language_model.layers if hasattr(layer.mlp, "experts"))
    assert routed == 1 * 8 * 3 * 32 * 64  # one MoE layer (the other is mlp_only), 8 experts of gate, up and down
    assert f"weights                         {params * 4:>12}   bytes: {params} parameters" in shown
    assert f"of which routed experts       {routed * 4:>12}   bytes: 8 experts a MoE layer, a token reads 2: " \
           f"{(params - routed + routed // 4) * 4} bytes" in shown


def test_decode_graph_steps_give_the_eager_tokens(family_checkpoint):
    """Decode steps through the static graph buffers (on CPU the EagerCapturer stand-in) of a MoE decoder."""
    from mmengine.runner.cuda_graphs import EagerCapturer

    path = family_checkpoint("qwen3_vl_moe")
    prompts = [qwen_vl_prompt(f"Question {i}: what now?", i % 2) for i in range(3)]
    images = [PICTURES[: i % 2] or None for i in range(3)]
    results = {}
    for graphs in (False, True):
        engine = MMEngine(str(path), device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)
        if graphs:
            engine.runner.capture_cuda_graphs(EagerCapturer())
        results[graphs] = [o.token_ids for o in engine.generate(prompts, images=images, sampling_params=_greedy(6), use_tqdm=False)]
        if graphs:
            assert engine.runner.decode_graphs.num_replays >= 3
    assert results[True] == results[False]
