"""Speculative decoding with Qwen3.5's own multi-token-prediction head (method "mtp"): the head computes
what a reference built from transformers' own decoder layer computes, its K/V follows the request through
chunked prefill and prefix hits, and verifying its drafts never changes a token (whatever they are: the
tiny checkpoints' heads are random, so nearly all are rejected)."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file

from books import assert_books_consistent
from helpers import record_draft_proposals, stop_recording_draft_proposals
from mmengine import MMEngine, SamplingParams
from mmengine.config import EngineConfig
from mmengine.errors import ConfigError
from mmengine.testing import make_test_image
from mmengine.testing.mtp import mtp_layer_class, tiny_qwen3_5_mtp_path
from mmengine.testing.qwen_vl import qwen_vl_prompt

K = 2
# no back-off: the random heads' drafts are all rejected, and every step should verify them
MTP = {"method": "mtp", "num_speculative_tokens": K, "draft_backoff": False}
OPTIONS = dict(device="cpu", dtype="float32", max_model_len=256, block_size=8)
PICTURES = [make_test_image(41, size=(64, 64)), make_test_image(42, size=(48, 96))]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_path():
    return tiny_qwen3_5_mtp_path()


@pytest.fixture(scope="module")
def engines(mtp_path):
    """(the engine without speculation: the reference, one drafting with the head), built once."""
    return MMEngine(str(mtp_path), **OPTIONS), MMEngine(str(mtp_path), speculative_config=MTP, **OPTIONS)


# -- the config ----------------------------------------------------------------------------------------

def test_mtp_config_is_checked_by_name(family_checkpoint):
    assert EngineConfig("model", speculative_config=MTP).spec_config.method == "mtp"
    with pytest.raises(ConfigError, match="prompt_lookup_max"):
        EngineConfig("model", speculative_config={**MTP, "prompt_lookup_max": 3})
    for family in ("qwen3_5", "llava"):  # a checkpoint without mtp.* tensors; a family that has no head
        with pytest.raises(ConfigError, match=r"speculative_config\['method'\]='mtp'"):
            MMEngine(str(family_checkpoint(family)), speculative_config=MTP, **OPTIONS)


# -- the head ------------------------------------------------------------------------------------------

def _reference_drafts(path, prompt_ids: list[int], first_token: int, k: int) -> list[int]:
    """The head's greedy chain, computed with transformers' classes: its decoder layer loaded with the
    checkpoint's `mtp.layers.0`, over rows (embedding of token j+1, target's final hidden state at j)."""
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5TextRotaryEmbedding

    target = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    config = target.config.text_config
    tensors = load_file(str(path / "mtp.safetensors"))
    layer = mtp_layer_class(config)(config, config.layer_types.index("full_attention")).eval()
    layer.load_state_dict({n.removeprefix("mtp.layers.0."): t for n, t in tensors.items() if n.startswith("mtp.layers.0.")})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3_5RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].weight.data.copy_(tensors[f"mtp.{name}.weight"])
    fc = torch.nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
    fc.weight.data.copy_(tensors["mtp.fc.weight"])
    rotary = Qwen3_5TextRotaryEmbedding(config)
    embed = target.model.language_model.embed_tokens
    with torch.no_grad():
        hidden = target.model(input_ids=torch.tensor([prompt_ids])).last_hidden_state[0]  # after the final norm
        tokens, drafts = prompt_ids[1:] + [first_token], []
        for _ in range(k):
            n = len(tokens)
            x = fc(torch.cat([norms["pre_fc_norm_embedding"](embed(torch.tensor(tokens))), norms["pre_fc_norm_hidden"](hidden)], -1))
            positions = torch.arange(n).view(1, 1, n).expand(3, 1, n)
            mask = torch.full((n, n), torch.finfo(torch.float32).min).triu(1).view(1, 1, n, n)
            out = norms["norm"](layer(x[None], position_embeddings=rotary(x[None], positions), attention_mask=mask)[0])
            drafts.append(int(target.lm_head(out[-1]).argmax()))
            tokens, hidden = tokens + [drafts[-1]], torch.cat([hidden, out[-1:]])  # the head's output stands for h
    return drafts


def test_the_heads_drafts_are_the_reference_heads(mtp_path):
    """The first proposal after the prefill: both drafts of the chain, with and without chunked prefill."""
    prompt = qwen_vl_prompt("Tell me a story about a cat who sails.")
    for chunk in (None, 8):
        engine = MMEngine(str(mtp_path), speculative_config=MTP, **OPTIONS,
                          **({"max_num_batched_tokens": chunk, "max_num_seqs": 2} if chunk else {}))
        proposals = record_draft_proposals(engine)
        out = engine.generate([prompt], sampling_params=_greedy(4), use_tqdm=False)[0]
        first = next(p for p in proposals if p)
        drafts = next(iter(first.values()))
        assert drafts == _reference_drafts(mtp_path, out.prompt_token_ids, out.token_ids[0], K), chunk
        engine.shutdown()


def test_the_heads_kv_comes_back_with_prefix_hits(engines):
    """A repeated prompt computes at most one block, and the head drafts exactly as the first time: its K/V
    of the cached blocks came back with them."""
    _, speculating = engines
    prompt, images = qwen_vl_prompt("Describe this picture in detail.", 1), [PICTURES[:1]]
    runs = []
    for _ in range(2):
        proposals = record_draft_proposals(speculating)
        before = speculating.stats()["prefill_tokens_computed"]
        out = speculating.generate([prompt], images=images, sampling_params=_greedy(8), use_tqdm=False)[0]
        runs.append(([list(p.values()) for p in proposals if p], speculating.stats()["prefill_tokens_computed"] - before, out))
        stop_recording_draft_proposals(speculating)
    (first, computed_first, out_first), (second, computed_second, out_second) = runs
    assert out_second.token_ids == out_first.token_ids and out_second.num_cached_tokens > 0
    assert computed_second <= OPTIONS["block_size"] < computed_first
    assert second == first and len(first) >= 4


# -- exactness ---------------------------------------------------------------------------------------

def test_mtp_drafts_keep_greedy_tokens(engines):
    """Text and pictures in one batch, with the head's drafts verified every step."""
    reference, speculating = engines
    prompts = [qwen_vl_prompt("Say it again and again.", 0), qwen_vl_prompt("What is here?", 1),
               qwen_vl_prompt("Compare them all.", 2)]
    images = [None, PICTURES[:1], PICTURES[:2]]
    expected = reference.generate(prompts, images=images, sampling_params=_greedy(16), use_tqdm=False)
    before = speculating.stats()
    outs = speculating.generate(prompts, images=images, sampling_params=_greedy(16), use_tqdm=False)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    after = speculating.stats()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    assert drafted > 0 and after["spec_drafted_position_1"] > before["spec_drafted_position_1"]  # chains of K
    assert after["spec_accepted_tokens"] - before["spec_accepted_tokens"] <= drafted
    assert_books_consistent(speculating)


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_mtp_under_chunked_prefill_and_preemption(mtp_path, engines, async_scheduling):
    """Small chunks and too few KV blocks for the batch: requests are preempted and recomputed, the head's
    blocks taken ahead go with them, and the tokens stay the reference's. With async scheduling some steps are
    launched before the one in flight is read (its rows follow the head's drafts on the device)."""
    reference, _ = engines
    prompts = [qwen_vl_prompt(f"Story number {i} about the sea.", i % 2) for i in range(4)]
    images = [PICTURES[:1] if i % 2 else None for i in range(4)]
    expected = reference.generate(prompts, images=images, sampling_params=_greedy(24), use_tqdm=False)
    engine = MMEngine(str(mtp_path), speculative_config={**MTP, "num_speculative_tokens": 3},
                      **{**OPTIONS, "block_size": 4}, max_num_batched_tokens=16, num_kv_blocks=28, enable_prefix_grouping=False,
                      async_scheduling=async_scheduling)
    outs = engine.generate(prompts, images=images, sampling_params=_greedy(24), use_tqdm=False)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_draft_tokens"] > 0
    assert engine.steps.async_scheduling == (async_scheduling == "on")
    assert (stats["steps_launched_ahead"] > 0) == (async_scheduling == "on")
    assert_books_consistent(engine)
    engine.shutdown()


def test_mtp_on_the_moe_family():
    path = str(tiny_qwen3_5_mtp_path("qwen3_5_moe"))
    prompts = [qwen_vl_prompt("What is here?", 1), qwen_vl_prompt("Count to ten.")]
    images = [PICTURES[1:], None]
    reference = MMEngine(path, **OPTIONS)
    expected = reference.generate(prompts, images=images, sampling_params=_greedy(10), use_tqdm=False)
    reference.shutdown()
    engine = MMEngine(path, speculative_config=MTP, **OPTIONS)
    outs = engine.generate(prompts, images=images, sampling_params=_greedy(10), use_tqdm=False)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert engine.stats()["spec_draft_tokens"] > 0
    engine.shutdown()


def test_the_budget_counts_the_heads_weights_and_kv(mtp_path, capsys):
    from mmengine.cli import main

    def budget(*extra: str) -> str:
        main(["budget", "--model", str(mtp_path), "--device", "cpu", "--max-num-seqs", "4", *extra])
        return capsys.readouterr().out

    plain, drafting = budget(), budget("--speculative-config", "method=mtp,num_speculative_tokens=2")
    head = sum(t.numel() for t in load_file(str(mtp_path / "mtp.safetensors")).values()) * 4
    assert re.search(rf"not loaded: MTP head \(mtp\.\*\) +{head} +bytes", plain)
    assert re.search(rf"of which the MTP head \(mtp\.\*\) +{head} +bytes", drafting)
    # the head's attention layer joins the decoder's one in every block
    assert "2 x (1 attention layers x 2 KV heads x 16)" in plain
    assert "2 x (2 attention layers x 2 KV heads x 16) x 4 B; 1 of the layers the MTP head's" in drafting
    assert "draft states" in drafting


def test_mtp_drafts_under_a_grammar_keep_the_json(engines):
    """The grammar cuts the head's drafts to those it allows and masks each verify row; the JSON is the one
    decoded without speculation."""
    from mmengine.sample.structured_output.params import StructuredOutputParams

    reference, speculating = engines
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}}, "required": ["name"]}
    params = SamplingParams(max_tokens=40, temperature=0, structured_output=StructuredOutputParams(json=schema))
    prompts, images = [qwen_vl_prompt("Name this.", 1), qwen_vl_prompt("Answer in JSON.")], [PICTURES[:1], None]
    expected = reference.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    outs = speculating.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
    for out, want in zip(outs, expected):
        assert (out.token_ids, out.text, out.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert_books_consistent(speculating)


def test_the_demo_drafts_with_the_tiny_qwen3_5s_head(capsys):
    from mmengine.cli import main

    assert main(["demo", "--family", "qwen3_5", "--requests", "3", "--max-tokens", "6", "--speculative-config",
                 '{"method": "mtp", "num_speculative_tokens": 2}']) == 0
    out = capsys.readouterr().out
    assert "-mtp1" in out and re.search(r'"spec_draft_tokens": [1-9]', out)


def test_an_fp8_checkpoints_head_loads_dequantized_and_keeps_the_tokens(mtp_path, tmp_path):
    """The published FP8 checkpoints quantize the head's projections too (block scales beside them)."""
    from safetensors import safe_open

    from mmengine.testing.quantize import quantize_checkpoint

    path, _ = quantize_checkpoint(mtp_path, tmp_path / "fp8", "fp8", reference=False)
    with safe_open(str(path / "mtp.safetensors"), "pt") as f:
        assert "mtp.layers.0.self_attn.q_proj.weight_scale_inv" in f.keys()
    prompts, images = [qwen_vl_prompt("What is here?", 1), qwen_vl_prompt("Count to ten.")], [PICTURES[:1], None]
    reference = MMEngine(str(path), **OPTIONS)
    expected = reference.generate(prompts, images=images, sampling_params=_greedy(10), use_tqdm=False)
    reference.shutdown()
    engine = MMEngine(str(path), speculative_config=MTP, **OPTIONS)
    outs = engine.generate(prompts, images=images, sampling_params=_greedy(10), use_tqdm=False)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    assert engine.stats()["spec_draft_tokens"] > 0
    engine.shutdown()
