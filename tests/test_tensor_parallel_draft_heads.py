"""Draft heads at tensor_parallel_size 2 (two gloo ranks, fp32): Qwen3.5 with its MTP head and Qwen3-VL with an EAGLE-3
head (its own embeddings and a draft vocabulary of its own) give TP 1's greedy tokens and those without speculation,
with a picture and a prefill chunked over steps, with async scheduling on and off; the ranks' drafts are TP 1's draft
for draft, so the draft, acceptance and per-position counts are equal (both heads' drafts are sometimes kept: the
Qwen3.5 checkpoint's output layer writes two tokens alone, the EAGLE-3 head's draft vocabulary is the target's output
tokens). With async scheduling on, steps are launched before the verify step in flight is read, each rank moving its
rows and restoring its Gated DeltaNet states on its own, and the prefix hits and every checkpoint's states on both
ranks are those of async scheduling off. A repeat is a prefix hit whose drafts are the first run's (the head's K/V
came back on both ranks). Rank 1 reads only its part of each head's split tensors; a head the ranks cannot split is
refused by name before any process starts. The two TP 2 engines start at once, in threads, beside their TP 1
references, and serve every test here."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import chat_formats
from helpers import RecordedSlices, record_draft_proposals, stop_recording_draft_proposals, tensor_parallel_pairs
from mmengine import MMEngine, SamplingParams
from mmengine.errors import ConfigError
from mmengine.testing import make_test_image
from mmengine.testing.eagle3 import build_eagle3_head
from mmengine.testing.mtp import tiny_qwen3_5_mtp_path

OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "block_size": 8, "max_num_batched_tokens": 32}
FAMILY = {"mtp": "qwen3_5", "eagle3": "qwen3_vl"}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PENALIZED = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=2.0)
PICTURES = [make_test_image(61, size=(64, 64))]


def _spec(method: str, head=None) -> dict:
    # no back-off: the heads' drafts are mostly rejected, and every step should verify them
    spec = {"method": method, "num_speculative_tokens": 2 if method == "mtp" else 3, "draft_backoff": False}
    return {**spec, "model": str(head)} if head is not None else spec




@pytest.fixture(scope="module")
def paths(family_checkpoint, tmp_path_factory) -> dict:
    """method -> checkpoint. Qwen3.5's is the tiny MTP checkpoint whose output layer writes two tokens alone, by the
    sign of one hidden unit: the target and its head (which reads the same layer) each pick one of the two, so about
    half the drafts are kept and verify steps keep runs of every length (the random head's drafts are otherwise all
    rejected), moving the rows launched ahead of them."""
    import shutil

    path = shutil.copytree(tiny_qwen3_5_mtp_path(), tmp_path_factory.mktemp("mtp") / "qwen3_5")
    tensors = load_file(str(path / "model.safetensors"))
    head = torch.zeros_like(tensors["lm_head.weight"])
    head[41, 0], head[274, 0] = 10.0, -10.0
    save_file({**tensors, "lm_head.weight": head}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return {"mtp": path, "eagle3": family_checkpoint("qwen3_vl")}


@pytest.fixture(scope="module")
def without_speculation(paths):
    """method -> the batch's greedy tokens at TP 1 without a draft head (and ("mtp", "penalized") -> with PENALIZED)."""
    found = {}
    for method, path in paths.items():
        plain = MMEngine(str(path), **OPTIONS)
        prompts, images = _batch(method, "Describe the picture.")
        found[method] = [o.token_ids for o in plain.generate(prompts, images=images, sampling_params=GREEDY, use_tqdm=False)]
        if method == "mtp":
            found["mtp", "penalized"] = [o.token_ids for o in plain.generate(prompts, images=images, sampling_params=PENALIZED,
                                                                            use_tqdm=False)]
        plain.shutdown()
    return found


@pytest.fixture(scope="module")
def eagle3_head(family_checkpoint, tmp_path_factory, without_speculation):
    """A random head whose draft vocabulary (d2t) maps onto the tokens the target emits for the batch, cycled, so that
    some of its drafts are kept (which of them it picks is its own computation)."""
    head = build_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head", family_checkpoint("qwen3_vl"), draft_vocab_size=200,
                             own_embeddings=True)
    emitted = torch.as_tensor([t for tokens in without_speculation["eagle3"] for t in tokens])
    tensors = load_file(str(head / "model.safetensors"))
    targets = emitted[torch.arange(200) % len(emitted)]
    save_file({**tensors, "d2t": targets - torch.arange(200)}, str(head / "model.safetensors"), metadata={"format": "pt"})
    return head


@pytest.fixture(scope="module")
def engines(paths, eagle3_head):
    """method -> (checkpoint, TP 1 engine, TP 2 engine), both drafting with the head."""
    specs = {"mtp": _spec("mtp"), "eagle3": _spec("eagle3", eagle3_head)}
    with tensor_parallel_pairs(paths, {m: {"speculative_config": s} for m, s in specs.items()}, **OPTIONS) as pairs:
        yield pairs


def _batch(method: str, text: str) -> tuple[list[str], list]:
    family = FAMILY[method]
    # (24 tokens: the first chained draft after its prefill is written into a block the prompt does not have)
    return [chat_formats.user_turn(family, text, 1), chat_formats.user_turn(family, "Count to nine.", 0)], [PICTURES, None]


def _run(engine, prompts, images):
    """(outputs, every proposal after a prefill, the stats' change)."""
    proposals = record_draft_proposals(engine)
    before = engine.stats()
    outs = engine.generate(prompts, images=images, sampling_params=GREEDY, use_tqdm=False)
    after = engine.stats()
    stop_recording_draft_proposals(engine)
    return outs, [p for p in proposals if p], {k: after[k] - before[k] for k in after if isinstance(after[k], int)}


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_tp2_drafts_what_tp1_drafts_and_keeps_the_greedy_tokens(engines, without_speculation, method, async_scheduling):
    """With async scheduling on, TP 2 launches the decodes' steps before the verify step in flight is read, as TP 1 does:
    each rank moves its rows by the drafts kept (and restores its own Gated DeltaNet states); the tokens and the drafts
    kept are those of async scheduling off, and every count (drafts, steps, steps launched ahead) is TP 1's."""
    _, one, two = engines[method]
    prompts, images = _batch(method, "Describe the picture.")

    def cold(engine):  # (every run from empty caches: the steps do not depend on the tests before)
        engine.reset_encoder_cache()
        engine.reset_prefix_cache()
        return _run(engine, prompts, images)
    if async_scheduling == "on":  # the reference: TP 1 with async scheduling off
        one.steps.async_scheduling = False
        _, _, counts_off = cold(one)
    # (a flag of the driver's step loop alone: one start serves both)
    one.steps.async_scheduling = two.steps.async_scheduling = async_scheduling == "on"
    outs_one, drafts_one, counts_one = cold(one)
    outs_two, drafts_two, counts_two = cold(two)
    assert [o.token_ids for o in outs_two] == [o.token_ids for o in outs_one] == without_speculation[method]
    assert len(outs_two[0].prompt_token_ids) > OPTIONS["max_num_batched_tokens"]  # its prefill took several steps
    assert [sorted(p.values()) for p in drafts_two] == [sorted(p.values()) for p in drafts_one]
    counted = [k for k in counts_two if k.startswith("spec_")] + ["decode_steps", "steps_launched_ahead"]
    assert {k: counts_two[k] for k in counted} == {k: counts_one[k] for k in counted}
    assert counts_two["spec_drafted_position_1"] > 0  # chains of at least 2
    assert counts_two["spec_accepted_tokens"] > 0 and counts_two["spec_accepted_position_0"] > 0
    if async_scheduling == "off":
        assert drafts_two and counts_two["steps_launched_ahead"] == 0
    else:  # launched ahead, a row may verify a draft more near max_tokens, and a step may be launched for requests that
        # end in the run before it (TP 1's too, as the counts above say): the drafts kept do not change
        assert counts_two["steps_launched_ahead"] > 0
        assert counts_two["spec_accepted_tokens"] == counts_off["spec_accepted_tokens"]


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_a_repeat_is_a_prefix_hit_and_drafts_as_the_first_run(engines, method):
    """The head's K/V of the cached blocks came back with them on both ranks: the drafts are the first run's."""
    _, _, two = engines[method]
    two.steps.async_scheduling = False  # (every proposal goes through the step loop)
    prompt = chat_formats.user_turn(FAMILY[method], "What colour is it?", 1)
    runs = [_run(two, [prompt], [[make_test_image(62, size=(48, 64))]]) for _ in range(2)]
    (first, drafts_first, counts_first), (again, drafts_again, counts_again) = runs
    assert again[0].token_ids == first[0].token_ids and again[0].num_cached_tokens > 0
    assert counts_again["prefill_tokens_computed"] <= OPTIONS["block_size"] < counts_first["prefill_tokens_computed"]
    assert [list(p.values()) for p in drafts_again] == [list(p.values()) for p in drafts_first] and len(drafts_first) >= 3


def _checkpoints(engine) -> dict:
    """Each cached checkpoint's states on every rank, by the hash of the block it ends."""
    slots = engine.scheduler.states.checkpoint_slots()
    ranks = engine.runner.executor.call("recurrent_states", list(slots.values()))
    return {block_hash: [states[i] for states in ranks] for i, block_hash in enumerate(slots)}


def test_mtp_prefix_hits_and_checkpoints_launched_ahead_are_those_of_async_off(engines):
    """Qwen3.5 (hybrid) at TP 2, a repeated pictured prompt and then a chat's next turn (its first turn, the answer,
    new tokens): launched ahead, each rank restores its own Gated DeltaNet states after the kept run and copies the
    checkpoints booked once the run is known, so the hits, the prefill tokens computed and every checkpoint's states
    on both ranks are those of async scheduling off."""
    _, _, two = engines["mtp"]
    prompt = chat_formats.user_turn("qwen3_5", "What colour is it?", 1)
    found, checkpoints = {}, {}
    for mode in ("off", "on"):
        two.steps.async_scheduling = mode == "on"
        two.reset_prefix_cache()
        before, seen = two.stats(), []
        for _ in range(2):
            computed = two.stats()["prefill_tokens_computed"]
            out = two.generate([prompt], images=[PICTURES], sampling_params=GREEDY, use_tqdm=False)[0]
            seen.append((out.token_ids, out.num_cached_tokens, two.stats()["prefill_tokens_computed"] - computed))
        chat = list(out.prompt_token_ids) + out.token_ids + [11] * 5
        computed = two.stats()["prefill_tokens_computed"]
        turn = two.generate([{"prompt_token_ids": chat}], images=[PICTURES], sampling_params=GREEDY, use_tqdm=False)[0]
        seen.append((turn.token_ids, turn.num_cached_tokens, two.stats()["prefill_tokens_computed"] - computed))
        after = two.stats()
        found[mode] = (seen, after["steps_launched_ahead"] - before["steps_launched_ahead"], after["decode_steps"] - before["decode_steps"])
        checkpoints[mode] = _checkpoints(two)
    (on, ahead, decode_steps), (off, _, decode_steps_off) = found["on"], found["off"]
    assert on == off and ahead > 0 and decode_steps == decode_steps_off
    assert on[1][1] > 0 and on[2][1] > len(out.prompt_token_ids)  # hits; the next turn's reach into the answer
    assert checkpoints["on"].keys() == checkpoints["off"].keys() and len(checkpoints["on"]) >= 3
    for block_hash, states in checkpoints["on"].items():
        for rank, state in enumerate(states):
            assert torch.allclose(state, checkpoints["off"][block_hash][rank], atol=1e-5, rtol=1e-5), rank


def test_penalized_rows_launched_ahead_at_tp2_give_the_tokens_without_speculation(engines, without_speculation):
    """Penalties with the MTP head, async scheduling on at TP 2: each rank counts a verify row's kept run into its
    penalties on its device, so the rows launched ahead of it are penalized as without speculation (and as TP 1's)."""
    _, one, two = engines["mtp"]
    prompts, images = _batch("mtp", "Describe the picture.")
    found = {}
    for engine, mode in ((one, False), (two, True)):
        engine.steps.async_scheduling = mode
        engine.reset_prefix_cache()
        before = engine.stats()
        outs = engine.generate(prompts, images=images, sampling_params=PENALIZED, use_tqdm=False)
        after = engine.stats()
        found[mode] = ([o.token_ids for o in outs], after["steps_launched_ahead"] - before["steps_launched_ahead"],
                       after["spec_accepted_tokens"] - before["spec_accepted_tokens"])
    (tokens_off, _, _), (tokens_on, ahead, accepted) = found[False], found[True]
    assert tokens_on == tokens_off == without_speculation["mtp", "penalized"]
    assert tokens_on != without_speculation["mtp"]  # (the penalties change the answer)
    assert ahead > 0 and accepted > 0


def test_mtp_steps_launched_ahead_keep_the_tokens_through_preemption(paths):
    """Too few blocks at TP 2, async scheduling on: requests preempted while rows are launched ahead of their verify
    steps compute their tokens again on the ranks, which must hold each kept run's tokens, not the placeholders
    they were sent first (the driver sends a placeholder's position again once it knows the token)."""
    from mmengine.testing.qwen_vl import qwen_vl_prompt

    prompts = [qwen_vl_prompt(f"Story number {i} about the sea.", i % 2) for i in range(3)]
    images = [PICTURES if i % 2 else None for i in range(3)]
    options = {**OPTIONS, "block_size": 4, "max_num_batched_tokens": 16, "num_kv_blocks": 22, "enable_prefix_grouping": False}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = MMEngine(str(paths["mtp"]), **options)
    expected = [o.token_ids for o in plain.generate(prompts, images=images, sampling_params=params, use_tqdm=False)]
    plain.shutdown()
    two = MMEngine(str(paths["mtp"]), tensor_parallel_size=2, speculative_config=_spec("mtp"), async_scheduling="on", **options)
    try:
        outs = two.generate(prompts, images=images, sampling_params=params, use_tqdm=False)
        stats = two.stats()
    finally:
        two.shutdown()
    assert [o.token_ids for o in outs] == expected
    assert stats["num_preemptions"] > 0 and stats["steps_launched_ahead"] > 0 and stats["spec_accepted_tokens"] > 0


# -- in this process: the reads of rank 1, the refusals -------------------------------------


def _rank(rank: int, method: str, path, head=None):
    """Rank `rank` of 2's family, as a worker builds it (nothing collective runs to build or load)."""
    from mmengine.config import EngineConfig
    from mmengine.distributed.process_group import TensorParallelGroup
    from mmengine.distributed.sharded_model import tensor_parallel_family
    from mmengine.engine.startup import build_input_parts
    from mmengine.spec.draft_head import enable_draft_head

    config = EngineConfig(str(path), max_model_len=256, speculative_config=_spec(method, head))
    family = build_input_parts(config).family
    enable_draft_head(config, family, path)
    return tensor_parallel_family(family, TensorParallelGroup(rank, 2, torch.device("cpu")))


def _checkpoint(path) -> dict[str, torch.Tensor]:
    return {name: tensor for file in sorted(path.glob("*.safetensors")) for name, tensor in load_file(str(file)).items()}


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_rank_1_reads_only_its_part_of_the_mtp_heads_split_tensors(monkeypatch, family):
    """(Qwen3.5-MoE's head at TP 2, with and without enable_expert_parallel, was checked by hand against TP 1's
    tokens and drafts; here its experts are read as the decoder's are.)"""
    path = tiny_qwen3_5_mtp_path(family)
    recorded = RecordedSlices(monkeypatch)
    ranked = _rank(1, "mtp", path)
    model = type(ranked).model_class(ranked.hf_config)
    model.load_weights(type("Weights", (), {"model_dir": str(path)})())
    tensors = _checkpoint(path)
    hidden = ranked.text_config.hidden_size
    assert recorded.reads["mtp.fc.weight"] == [(slice(hidden // 2, hidden),)]
    assert torch.equal(model.mtp.fc.weight, tensors["mtp.fc.weight"][hidden // 2:])
    mlp = model.mtp.layers[0].mlp
    name, down = ("mlp.down_proj", mlp.down_proj) if family == "qwen3_5" else ("mlp.shared_expert.down_proj", mlp.shared_expert.down_proj)
    whole = tensors[f"mtp.layers.0.{name}.weight"]  # row-parallel: rank 1's half of the columns
    half = whole.shape[1] // 2
    assert recorded.reads[f"mtp.layers.0.{name}.weight"] == [(slice(None), slice(half, 2 * half))]
    assert torch.equal(down.weight, whole[:, half:])
    replicated = ("norm", "mlp.gate.weight", "shared_expert_gate.weight")
    assert all(index is not Ellipsis for name, reads in recorded.reads.items()
               if name.startswith("mtp.") and not any(r in name for r in replicated) for index in reads)


def test_rank_1_reads_only_its_part_of_the_eagle3_heads_split_tensors(family_checkpoint, eagle3_head, monkeypatch):
    from transformers import AutoConfig

    from mmengine.distributed.process_group import TensorParallelGroup
    from mmengine.distributed.sharded_draft_heads import build_eagle3_head as build_split

    config = AutoConfig.from_pretrained(eagle3_head)
    recorded = RecordedSlices(monkeypatch)
    head = build_split(config, config.hidden_size, True, str(eagle3_head), TensorParallelGroup(1, 2, torch.device("cpu")),
                       torch.device("cpu"), torch.float32)
    tensors = _checkpoint(eagle3_head)
    hidden = config.hidden_size
    assert recorded.reads["fc.weight"] == [(slice(hidden // 2, hidden),)]
    assert torch.equal(head.fc.weight, tensors["fc.weight"][hidden // 2:])
    for name, table in (("lm_head.weight", head.lm_head), ("embed_tokens.weight", head.embed_tokens)):  # by vocabulary
        assert table.vocab_start > 0 and recorded.reads[name] == [(slice(table.vocab_start, table.vocab_end),)], name
        assert torch.equal(table.weight[: table.vocab_end - table.vocab_start], tensors[name][table.vocab_start:]), name
    assert torch.equal(head.d2t, tensors["d2t"])
    for name in ("midlayer.self_attn.q_proj.weight", "midlayer.mlp.gate_proj.weight"):
        rows = tensors[name].shape[0]
        assert recorded.reads[name] == [(slice(rows // 2, rows),)], name


def test_a_head_the_ranks_cannot_split_is_refused_by_name_before_any_process_starts(family_checkpoint, eagle3_head, tmp_path):
    import shutil

    import psutil

    odd = shutil.copytree(eagle3_head, tmp_path / "odd")
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 1}))
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match=rf"speculative_config\['model'\].*intermediate_size={config['intermediate_size'] + 1} "
                                          r"is not divisible by tensor_parallel_size=2"):
        MMEngine(str(family_checkpoint("qwen3_vl")), tensor_parallel_size=2, speculative_config=_spec("eagle3", odd), **OPTIONS)
    assert {child.pid for child in psutil.Process().children(recursive=True)} <= before


def test_a_rank_masks_each_position_of_a_constrained_verify_row_with_its_own_mask(family_checkpoint):
    """The driver sends a grammar's mask for each position of a verify row (after 0, 1, ... drafts); a rank
    (runner/worker.py at TP 1: no process) applies mask i at position i. (Before, every position took the first
    one: n-gram drafts under a JSON grammar at TP 2 ended the output wrongly once a draft was kept.)"""
    from mmengine.config import EngineConfig
    from mmengine.distributed.process_group import single_rank_group
    from mmengine.engine.startup import build_input_parts
    from mmengine.runner.step_plan import NewRequest, PlannedRow, StepPlan
    from mmengine.runner.worker import ModelWorker

    llava = family_checkpoint("llava")
    config = EngineConfig(str(llava), max_model_len=128, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    parts = build_input_parts(config)
    worker = ModelWorker(single_rank_group(), config=config, family=parts.family, model_dir=str(llava), dtype=torch.float32,
                         max_model_len=parts.max_model_len)
    worker.allocate_kv_cache(8)
    prompt = parts.input_processor.tokenizer("USER: Tell me a story about a cat. ASSISTANT:").input_ids
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = worker.execute_step(StepPlan(new_requests=[NewRequest("r", prompt, [], None, params)], block_tables={"r": [0, 1]},
                                         rows=[PlannedRow("r", 0, len(prompt), [], len(prompt), [], 0)])).tokens["r"]
    allowed = [7, 42, 13]  # position i's mask allows allowed[i] alone
    masks = torch.zeros(3, (parts.family.text_config.vocab_size + 31) // 32, dtype=torch.int32)
    for row, token in enumerate(allowed):
        masks[row, token // 32] = 1 << (token % 32)
    verify = PlannedRow("r", len(prompt), 3, [], len(prompt), first, 0, masks, draft_token_ids=[7, 9])
    assert worker.execute_step(StepPlan(rows=[verify], block_tables={"r": [0, 1]})).tokens == {"r": allowed}
