"""Speculative decoding with an EAGLE-3 draft head (method "eagle3"): the head computes what a reference
built from transformers' Llama pieces computes from the target's layer inputs, its K/V follows the request
through chunked prefill and prefix hits, verifying its drafts never changes a token (on LLaVA, Qwen2.5-VL and
Qwen3-VL, with pictures), and a head that does not fit the target is refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from books import assert_books_consistent
from helpers import record_draft_proposals, stop_recording_draft_proposals
from chat_formats import user_turn
from mmengine import MMEngine, SamplingParams
from mmengine.config import EngineConfig
from mmengine.errors import ConfigError
from mmengine.testing import make_test_image
from mmengine.testing.eagle3 import build_eagle3_head

K = 3
OPTIONS = dict(device="cpu", dtype="float32", max_model_len=256, block_size=8)
PICTURES = [make_test_image(51, size=(64, 64)), make_test_image(52, size=(48, 96))]
# each family's head differs: a draft vocabulary of its own (d2t), its own embeddings
HEADS = {"llava": dict(draft_vocab_size=120), "qwen2_5_vl": dict(), "qwen3_vl": dict(draft_vocab_size=200, own_embeddings=True)}


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _eagle3(head) -> dict:
    # no back-off: the random heads' drafts are all rejected, and every step should verify them
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": K, "draft_backoff": False}


@pytest.fixture(scope="module")
def heads(family_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    return {family: build_eagle3_head(root / family, family_checkpoint(family), **kwargs) for family, kwargs in HEADS.items()}


# -- the config ----------------------------------------------------------------------------------------

def test_heads_that_do_not_fit_are_refused_by_name(family_checkpoint, heads, tmp_path):
    with pytest.raises(ConfigError, match=r"speculative_config\['model'\]"):
        EngineConfig("model", speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    llava = str(family_checkpoint("llava"))
    with pytest.raises(ConfigError, match=r"speculative_config\['model'\].*no EAGLE-3 head"):
        MMEngine(llava, speculative_config=_eagle3(tmp_path), **OPTIONS)
    with pytest.raises(ConfigError, match=r"speculative_config\['model'\].*vocabulary"):  # Qwen's head on LLaVA
        MMEngine(llava, speculative_config=_eagle3(heads["qwen2_5_vl"]), **OPTIONS)
    with pytest.raises(ConfigError, match=r"speculative_config\['method'\]='eagle3'.*another decoder"):
        MMEngine(str(family_checkpoint("qwen3_5")), speculative_config=_eagle3(heads["qwen2_5_vl"]), **OPTIONS)
    wrong_layers = build_eagle3_head(tmp_path / "wrong", llava, aux_layer_ids=(0, 1, 7))
    with pytest.raises(ConfigError, match="eagle_aux_hidden_state_layer_ids"):
        MMEngine(llava, speculative_config=_eagle3(wrong_layers), **OPTIONS)


# -- the head ------------------------------------------------------------------------------------------

def _target(family: str, path):
    from transformers import LlavaForConditionalGeneration, Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    cls = {"llava": LlavaForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
           "qwen3_vl": Qwen3VLForConditionalGeneration}[family]
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def _reference_drafts(family: str, target_path, head_path, prompt_ids: list[int], first_token: int, k: int) -> list[int]:
    """The head's greedy chain from transformers' pieces: the target's residual stream before three layers
    (pre-hooks on its decoder layers), fc, and one Llama layer whose q/k/v read [embedding, hidden]."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

    target = _target(family, target_path)
    config = AutoConfig.from_pretrained(head_path)
    w = load_file(str(head_path / "model.safetensors"))
    layers = target.model.language_model.layers
    ids = config.eagle_config["eagle_aux_hidden_state_layer_ids"]
    captured = {}
    hooks = [layers[i].register_forward_pre_hook(
        lambda module, args, kwargs, i=i: captured.__setitem__(i, (args[0] if args else kwargs["hidden_states"])[0]), with_kwargs=True)
        for i in set(ids)]
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim

    def norm(name: str, x: torch.Tensor) -> torch.Tensor:
        layer = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        layer.weight.data.copy_(w[f"{name}.weight"])
        return layer(x)

    def embed(tokens: list[int]) -> torch.Tensor:
        table = w.get("embed_tokens.weight", target.model.language_model.embed_tokens.weight)
        return table[torch.tensor(tokens)]

    with torch.no_grad():
        target(input_ids=torch.tensor([prompt_ids]))
        for hook in hooks:
            hook.remove()
        hidden = torch.cat([captured[i] for i in ids], dim=-1) @ w["fc.weight"].T
        tokens, drafts = prompt_ids[1:] + [first_token], []
        for _ in range(k):
            n = len(tokens)
            x = torch.cat([norm("midlayer.input_layernorm", embed(tokens)), norm("midlayer.hidden_norm", hidden)], -1)
            q, kk, v = (x @ w[f"midlayer.self_attn.{p}_proj.weight"].T for p in "qkv")
            q, kk, v = q.view(n, heads, dim).transpose(0, 1), kk.view(n, kv, dim).transpose(0, 1), v.view(n, kv, dim).transpose(0, 1)
            cos, sin = LlamaRotaryEmbedding(config)(x[None], torch.arange(n)[None])
            q, kk = apply_rotary_pos_emb(q[None], kk[None], cos, sin)
            kk, v = kk[0].repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
            attn = torch.nn.functional.scaled_dot_product_attention(q[0], kk, v, is_causal=True)
            stream = hidden + attn.transpose(0, 1).reshape(n, -1) @ w["midlayer.self_attn.o_proj.weight"].T
            y = norm("midlayer.post_attention_layernorm", stream)
            stream = stream + (torch.nn.functional.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T)) \
                @ w["midlayer.mlp.down_proj.weight"].T
            draft = int((norm("norm", stream[-1]) @ w["lm_head.weight"].T).argmax())
            drafts.append(draft + int(w["d2t"][draft]) if "d2t" in w else draft)
            tokens, hidden = tokens + [drafts[-1]], torch.cat([hidden, stream[-1:]])  # chained: the stream before the norm
    return drafts


@pytest.mark.parametrize("family", ["llava", "qwen3_vl"])
def test_the_heads_drafts_are_the_reference_heads(family, family_checkpoint, heads):
    """The first proposal after the prefill, all K drafts of the chain, with and without chunked prefill."""
    path = family_checkpoint(family)
    prompt = user_turn(family, "Tell me a story about a cat who sails the sea.")
    for chunk in (None, 8):
        engine = MMEngine(str(path), speculative_config=_eagle3(heads[family]), **OPTIONS,
                          **({"max_num_batched_tokens": chunk, "max_num_seqs": 2} if chunk else {}))
        proposals = record_draft_proposals(engine)
        out = engine.generate([prompt], sampling_params=_greedy(K + 2), use_tqdm=False)[0]
        drafts = next(iter(next(p for p in proposals if p).values()))
        assert drafts == _reference_drafts(family, path, heads[family], out.prompt_token_ids, out.token_ids[0], K), chunk
        engine.shutdown()


# -- exactness ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", list(HEADS))
def test_eagle3_drafts_keep_greedy_tokens_and_the_heads_kv_comes_back_with_prefix_hits(family, family_checkpoint, heads):
    """Text and pictures in one batch; then a repeat of the pictured prompt computes at most one block and
    drafts exactly as the first time (the head's K/V came back with the cached blocks)."""
    path = str(family_checkpoint(family))
    prompts = [user_turn(family, "Say it again and again.", 0), user_turn(family, "What is here?", 1),
               user_turn(family, "Compare them all.", 2)]
    images = [None, PICTURES[:1], PICTURES[:2]]
    reference = MMEngine(path, **OPTIONS)
    expected = reference.generate(prompts, images=images, sampling_params=_greedy(12), use_tqdm=False)
    reference.shutdown()
    engine = MMEngine(path, speculative_config=_eagle3(heads[family]), **OPTIONS)
    outs = engine.generate(prompts, images=images, sampling_params=_greedy(12), use_tqdm=False)
    assert [o.token_ids for o in outs] == [e.token_ids for e in expected]
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_drafted_position_2"] > 0  # chains of K
    runs = []
    for _ in range(2):
        proposals = record_draft_proposals(engine)
        before = engine.stats()["prefill_tokens_computed"]
        out = engine.generate(prompts[1:2], images=images[1:2], sampling_params=_greedy(8), use_tqdm=False)[0]
        runs.append(([list(p.values()) for p in proposals if p], engine.stats()["prefill_tokens_computed"] - before, out))
        stop_recording_draft_proposals(engine)
    assert runs[1][0] == runs[0][0] and len(runs[0][0]) >= 3
    assert runs[1][1] <= OPTIONS["block_size"] and runs[1][2].token_ids == expected[1].token_ids[:8]
    assert_books_consistent(engine)
    engine.shutdown()


def test_the_budget_counts_the_heads_weights_and_kv(family_checkpoint, heads, capsys):
    from mmengine.cli import main

    main(["budget", "--model", str(family_checkpoint("llava")), "--device", "cpu", "--max-num-seqs", "4",
          "--speculative-config", f'{{"method": "eagle3", "model": "{heads["llava"]}", "num_speculative_tokens": 3}}'])
    out = capsys.readouterr().out
    parameters = sum(t.numel() for t in load_file(str(heads["llava"] / "model.safetensors")).values())
    assert f"{parameters} parameters ({heads['llava']})" in out
    assert "1 of them the EAGLE-3 head's" in out


def test_every_family_on_the_llama_like_decoder_keeps_its_tokens(family_checkpoint, tmp_path):
    """The other families an EAGLE-3 head may draft for: a pictured prompt's greedy tokens are unchanged."""
    for family in ("qwen2_vl", "qwen3_vl_moe", "internvl", "mistral3", "smolvlm", "llava_onevision"):
        path = str(family_checkpoint(family))
        head = build_eagle3_head(tmp_path / family, path, draft_vocab_size=150)
        prompt, images = user_turn(family, "What is here?", 1), [PICTURES[:1]]
        reference = MMEngine(path, **{**OPTIONS, "max_model_len": 512})
        (expected,) = reference.generate([prompt], images=images, sampling_params=_greedy(6), use_tqdm=False)
        reference.shutdown()
        engine = MMEngine(path, speculative_config=_eagle3(head), **{**OPTIONS, "max_model_len": 512})
        (out,) = engine.generate([prompt], images=images, sampling_params=_greedy(6), use_tqdm=False)
        assert out.token_ids == expected.token_ids, family
        assert engine.stats()["spec_draft_tokens"] > 0, family
        engine.shutdown()
