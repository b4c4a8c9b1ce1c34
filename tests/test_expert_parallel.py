"""Expert parallelism (`enable_expert_parallel=True`, distributed/parallel_experts.py): at tensor_parallel_size=2 on
CPU with gloo each rank holds 4 of the 8 experts of every MoE layer whole (attention still split by heads), and
Qwen3-VL-MoE (experts stored fused) and Qwen3.5-MoE (stored one by one, a gated shared expert split as an MLP) give
TP 1's and transformers' greedy tokens with pictures, chunked prefill and a prefix hit, logprobs within 1e-4 of TP 1
in fp32; a rank reads only its experts from the checkpoint (of an FP8 one too); the fused kernel skips the pairs
routed to the other rank; what it refuses is named before any process starts; `mmengine budget` counts a rank's
experts.

One TP 2 engine per family serves the module (starting one costs two interpreters importing torch and
transformers: both start at once, in threads, while the first test builds its references); everything else runs in
this process."""

from __future__ import annotations

import re
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import chat_formats
from conftest import CPU_FP32, hf_greedy
from helpers import RecordedSlices
from mmengine import MMEngine, SamplingParams
from mmengine.errors import ConfigError
from mmengine.testing import make_test_image

# 32 tokens a step: a prompt with pictures prefills in chunks (a picture's placeholders fit one step)
OPTIONS = {"max_model_len": 256, "max_num_batched_tokens": 32}
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=2)


# The TP 2 engines start in threads, both at once, while this process builds the TP 1 engines and transformers' models
_starting: list[Future] = []


def settled() -> None:
    """Waits until no engine of this module is starting (its worker processes all up, or failed)."""
    wait(_starting)


@pytest.fixture(scope="module")
def ep_engines(family_checkpoint):
    paths = {name: family_checkpoint(name) for name in ("qwen3_vl_moe", "qwen3_5_moe")}
    with ThreadPoolExecutor(len(paths)) as pool:
        futures = {name: pool.submit(MMEngine, str(path), tensor_parallel_size=2, enable_expert_parallel=True, **OPTIONS)
                   for name, path in paths.items()}
        _starting.extend(futures.values())
        yield {name: (paths[name], future) for name, future in futures.items()}
        for future in futures.values():
            if future.exception() is None:
                future.result().shutdown()


def engines(ep_engines, name: str) -> tuple[Path, MMEngine, MMEngine]:
    path, future = ep_engines[name]
    one = MMEngine(str(path), **OPTIONS)
    return path, one, future.result()


@pytest.fixture(scope="module")
def vl_moe(ep_engines):
    return engines(ep_engines, "qwen3_vl_moe")


@pytest.fixture(scope="module")
def hybrid_moe(ep_engines):
    return engines(ep_engines, "qwen3_5_moe")


def same_tokens_and_logprobs(ones, twos) -> None:
    for one, two in zip(ones, twos, strict=True):
        assert two.token_ids == one.token_ids
        assert max(abs(a.logprob - b.logprob) for a, b in zip(one.logprobs, two.logprobs)) < 1e-4
        if one.prompt_logprobs:
            assert max(abs(a.logprob - b.logprob) for a, b in zip(one.prompt_logprobs[1:], two.prompt_logprobs[1:])) < 1e-4


def repeat_hits_the_prefix_cache(engine: MMEngine, prompt: str, images: list, expected: list[int]) -> dict:
    """The repeat computes at most one block and encodes nothing; the stats before and after."""
    before = engine.stats()
    again = engine.generate(prompt, images=images, sampling_params=GREEDY, use_tqdm=False)[0]
    after = engine.stats()
    assert again.token_ids == expected
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] <= 16
    assert again.num_cached_tokens >= len(again.prompt_token_ids) - 16
    assert after["encoder_runs"] == before["encoder_runs"]
    return {name: after[name] - before[name] for name in after if isinstance(after[name], int)}


def test_qwen3_vl_moe_gives_tp1_and_transformers_tokens_with_pictures_chunks_and_a_prefix_hit(vl_moe):
    path, one, ep = vl_moe
    prompts = [chat_formats.user_turn("qwen3_vl_moe", "Compare the pictures.", 2),
               chat_formats.user_turn("qwen3_vl_moe", "Tell me a story.", 0)]
    images = [[make_test_image(11), make_test_image(12, size=(64, 30))], []]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0, logprobs=2, prompt_logprobs=1), GREEDY]
    ones = one.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    twos = ep.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    same_tokens_and_logprobs(ones, twos)
    for prompt, pictures, two in zip(prompts, images, twos):
        assert two.token_ids == hf_greedy(path, prompt, pictures, 8, CPU_FP32, ignore_eos=True)
    assert len(twos[0].prompt_token_ids) > OPTIONS["max_num_batched_tokens"]  # its prefill took two steps
    repeat_hits_the_prefix_cache(ep, prompts[0], images[0], twos[0].token_ids)


def test_qwen3_5_moe_gives_tp1_and_transformers_tokens_and_resumes_from_a_state_checkpoint(hybrid_moe):
    """The hybrid decoder (Gated DeltaNet split by heads), the routed experts whole per rank from a checkpoint that
    stores them one by one, the gated shared expert split as an MLP."""
    path, one, ep = hybrid_moe
    prompt = chat_formats.user_turn("qwen3_5_moe", "What is shown here? Describe it.", 1)
    images = [make_test_image(11)]
    expected = one.generate(prompt, images=images, sampling_params=GREEDY, use_tqdm=False)
    got = ep.generate(prompt, images=images, sampling_params=GREEDY, use_tqdm=False)
    same_tokens_and_logprobs(expected, got)
    assert got[0].token_ids == hf_greedy(path, prompt, images, 8, CPU_FP32, ignore_eos=True)
    assert len(got[0].prompt_token_ids) > OPTIONS["max_num_batched_tokens"]
    assert repeat_hits_the_prefix_cache(ep, prompt, images, got[0].token_ids)["state_checkpoint_hits"] >= 1


def test_a_batch_mixing_pictures_and_text_gives_tp1_tokens(hybrid_moe):
    """Tokens of one step routed to experts on both ranks, several requests at once."""
    _, one, ep = hybrid_moe
    prompts = [chat_formats.user_turn("qwen3_5_moe", "Tell me a story.", 0), chat_formats.user_turn("qwen3_5_moe", "Colours?", 1),
               chat_formats.user_turn("qwen3_5_moe", "Count to ten.", 0)]
    images = [[], [make_test_image(5)], []]
    same_tokens_and_logprobs(one.generate(prompts, images=images, sampling_params=GREEDY, use_tqdm=False),
                             ep.generate(prompts, images=images, sampling_params=GREEDY, use_tqdm=False))


# -- in this process: loading, the kernel, the refusals, the budget ---------------------------------------------



def load_rank(path: Path, rank: int) -> torch.nn.Module:
    """Rank `rank` of 2's model with expert parallelism, built and loaded here (no collective runs)."""
    from mmengine.config import EngineConfig
    from mmengine.distributed.process_group import TensorParallelGroup
    from mmengine.distributed.sharded_model import tensor_parallel_family
    from mmengine.engine.startup import build_input_parts

    family = build_input_parts(EngineConfig(str(path), max_model_len=256)).family
    ranked = tensor_parallel_family(family, TensorParallelGroup(rank, 2, torch.device("cpu")), expert_parallel=True)
    model = type(ranked).model_class(family.hf_config)
    model.load_weights(type("Weights", (), {"model_dir": str(path)})())
    return model


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return {name: tensor for file in sorted(path.glob("*.safetensors")) for name, tensor in load_file(str(file)).items()}


# family -> (its experts in our model's decoder, in the checkpoint, and how the checkpoint stores them)
LAYOUTS = {
    "qwen3_vl_moe": ("layers.0.mlp.experts", "model.language_model.layers.0.mlp.experts", "fused"),  # [E, 2I, H], [E, H, I]
    "qwen3_5_moe": ("layers.0.mlp.experts", "model.language_model.layers.0.mlp.experts", "apart"),  # one by one
    "gemma4": ("layers.0.experts", "model.language_model.layers.0.experts", "fused"),  # its MoE block's
    "llama4": ("layers.1.feed_forward.experts", "language_model.model.layers.1.feed_forward.experts", "transposed"),  # [E, H, 2I]
}


@pytest.mark.parametrize("family", list(LAYOUTS))
def test_a_rank_holds_and_reads_only_its_whole_experts(family_checkpoint, monkeypatch, family):
    """Rank 1 of 2: the second half of the experts whole, equal to the checkpoint's; of a fused tensor it reads those
    rows, of experts stored apart it opens none of the first half. (Gemma 4's MoE block and Llama 4's experts run the
    same layer as Qwen's; their TP 2 engines with expert parallelism were checked by hand against TP 1's tokens.)"""
    from mmengine.distributed.parallel_experts import ExpertParallelFusedExperts

    if family == "gemma4":
        from mmengine.testing.gemma4 import TinyGemma4Spec, tiny_gemma4_path

        path = tiny_gemma4_path(TinyGemma4Spec(enable_moe_block=True))
    else:
        path = family_checkpoint(family)
    ours, prefix, layout = LAYOUTS[family]
    recorded = RecordedSlices(monkeypatch)
    experts = load_rank(path, 1).language_model.get_submodule(ours)
    assert isinstance(experts, ExpertParallelFusedExperts)
    total = experts.num_checkpoint_experts
    half = range(total // 2, total)
    assert experts.num_experts == total // 2 and experts.held == half
    tensors = checkpoint(path)
    if layout == "apart":
        for local, expert in enumerate(half):
            gate_up = torch.cat([tensors[f"{prefix}.{expert}.gate_proj.weight"], tensors[f"{prefix}.{expert}.up_proj.weight"]])
            assert torch.equal(experts.gate_up_proj[local], gate_up)
            assert torch.equal(experts.down_proj[local], tensors[f"{prefix}.{expert}.down_proj.weight"])
        read = {int(m[1]) for name in recorded.reads if (m := re.search(r"\.experts\.(\d+)\.", name))}
        assert read == set(half)
        return
    gate_up, down = tensors[f"{prefix}.gate_up_proj"][half.start :], tensors[f"{prefix}.down_proj"][half.start :]
    if layout == "transposed":
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    assert torch.equal(experts.gate_up_proj, gate_up) and torch.equal(experts.down_proj, down)
    assert recorded.reads[f"{prefix}.gate_up_proj"] == [(slice(half.start, total),)]


def test_an_fp8_checkpoints_experts_are_dequantized_on_their_rank_and_the_others_left_unread(family_checkpoint, tmp_path, monkeypatch):
    """Quantized checkpoints load at TP > 1 dequantized (docs/parallelism.md): a rank reads and dequantizes its
    experts (weights and scales), none of the other rank's."""
    from mmengine.testing.quantize import quantize_checkpoint

    quantized, reference = quantize_checkpoint(family_checkpoint("qwen3_5_moe"), tmp_path / "q", "fp8")
    recorded = RecordedSlices(monkeypatch)
    experts = load_rank(quantized, 0).language_model.layers[1].mlp.experts
    tensors = checkpoint(reference)
    prefix = "model.language_model.layers.1.mlp.experts"
    for expert in range(4):
        gate_up = torch.cat([tensors[f"{prefix}.{expert}.gate_proj.weight"], tensors[f"{prefix}.{expert}.up_proj.weight"]])
        torch.testing.assert_close(experts.gate_up_proj[expert], gate_up, rtol=0, atol=1e-6)
    read = {int(m[1]) for name in recorded.reads if (m := re.search(r"\.experts\.(\d+)\.", name))}
    assert read == {0, 1, 2, 3} and any(name.endswith("weight_scale_inv") for name in recorded.reads)


def test_the_fused_kernel_skips_the_pairs_another_rank_computes():
    """kernels/fused_moe.py with skip_past_end (Triton's interpreter on CPU): each rank's half of the experts, the
    other half's pairs weighing zero, sums to the whole layer."""
    from mmengine.distributed.parallel_experts import ExpertParallelFusedExperts
    from mmengine.distributed.process_group import TensorParallelGroup
    from mmengine.layers.moe import FusedExperts

    gen = torch.Generator().manual_seed(0)
    dense = FusedExperts(8, 32, 16, "silu", 2)
    with torch.no_grad():
        dense.gate_up_proj.copy_(torch.randn(8, 32, 32, generator=gen) * 0.2)
        dense.down_proj.copy_(torch.randn(8, 32, 16, generator=gen) * 0.2)
    x = torch.randn(40, 32, generator=gen)
    ids = torch.randn(40, 8, generator=gen).topk(2, dim=-1).indices
    weights = torch.rand(40, 2, generator=gen).softmax(-1)
    total = torch.zeros_like(x)
    with torch.no_grad():
        for rank in range(2):
            group = TensorParallelGroup(rank, 2, torch.device("cpu"))
            group.all_reduce = lambda t: t  # the sum over the ranks is this test's
            experts = ExpertParallelFusedExperts(dense, group, "experts")
            experts.weight_loader(experts.gate_up_proj, dense.gate_up_proj.data)
            experts.weight_loader(experts.down_proj, dense.down_proj.data)
            kernel = experts(x, weights, ids, use_kernel=True)
            torch.testing.assert_close(kernel, experts(x, weights, ids), atol=1e-5, rtol=1e-5)  # the PyTorch path
            total += kernel
        torch.testing.assert_close(total, dense(x, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("model", "options", "named"), [
    ("qwen3_vl_moe", {}, r"enable_expert_parallel needs tensor_parallel_size > 1"),
    ("qwen3_vl_moe", {"tensor_parallel_size": 3}, r"enable_expert_parallel needs num_experts=8 divisible by tensor_parallel_size=3"),
    ("llava", {"tensor_parallel_size": 2}, r"enable_expert_parallel: .*has no experts"),
    ("qwen3_vl_moe", {"tensor_parallel_size": 2, "enable_expert_parallel": "yes"}, r"enable_expert_parallel must be a bool"),
])
def test_what_expert_parallelism_refuses_is_named_before_any_process_starts(family_checkpoint, model, options, named):
    from test_tensor_parallel import children

    settled()  # (no engine of the module's starting beside this one)
    before = children()
    with pytest.raises(ConfigError, match=named):
        MMEngine(str(family_checkpoint(model)), max_model_len=128, **{"enable_expert_parallel": True, **options})
    assert children() <= before


def test_the_flag_is_on_every_command_with_tensor_parallel_size():
    from mmengine.cli import build_parser
    from mmengine.entrypoints.engine_flags import engine_options

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "p", "--tensor-parallel-size", "2",
                                      "--enable-expert-parallel"])
    assert engine_options(args)["enable_expert_parallel"] is True
    assert build_parser().parse_args(["budget", "--model", "m", "--enable-expert-parallel"]).enable_expert_parallel


def test_budget_counts_a_ranks_experts(vl_moe, capsys):
    from mmengine.cli import main

    path, _, ep = vl_moe
    printed = {}
    for flags in ([], ["--enable-expert-parallel"]):
        assert main(["budget", "--model", str(path), "--tensor-parallel-size", "2", *flags]) in (0, None)
        printed[bool(flags)] = capsys.readouterr().out
    text = printed[True]
    per_rank, whole = map(int, re.search(r"of which routed experts\s+\d+\s+bytes: (\d+) of (\d+) parameters", text).groups())
    assert per_rank * 2 == whole and "4 of 8 experts a MoE layer, each whole" in text
    assert "all 8 experts a MoE layer, each 1/2 of its intermediate rows" in printed[False]
    rank_weights = [int(re.search(r"weights per rank\s+(\d+)", out)[1]) for out in printed.values()]
    assert rank_weights[0] == rank_weights[1]  # as many parameters a rank either way
    held = ep.parallel.weight_bytes_per_rank
    assert held[0] == held[1] <= rank_weights[1]
    assert main(["budget", "--model", str(path), "--tensor-parallel-size", "3", "--enable-expert-parallel"]) == 2
    assert "num_experts=8 divisible by tensor_parallel_size=3" in capsys.readouterr().err
