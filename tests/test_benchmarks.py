"""benchmarks/latency.py runs end to end at tiny settings and reports every field; its helpers
(build-if-missing, the read floor's byte count, the busy-time union) do what they claim."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import load_benchmark
from mmengine import MMEngine
from mmengine.testing import TinyLlavaSpec


@pytest.fixture(scope="module")
def latency():
    return load_benchmark("latency")


def test_step_breakdown_times_each_phase_in_both_scheduling_modes(checkpoint_dir, tmp_path):
    module = load_benchmark("step_breakdown")
    output = tmp_path / "step_breakdown.json"
    result = module.main([
        "--model", str(checkpoint_dir()), "--batch-sizes", "1,3", "--prompt-tokens", "16", "--decode-steps", "3",
        "--image-requests", "6", "--unique-images", "2", "--output-len", "3", "--max-model-len", "256",
        "--output", str(output),
    ])
    assert json.loads(output.read_text()) == json.loads(json.dumps(result, default=str))
    assert list(result["modes"]) == ["off", "on"]
    for mode, rows in result["modes"].items():
        assert list(rows) == ["decode bs 1", "decode bs 3", "images"]
        for name, row in rows.items():
            phases = row["phases_ms_per_step"]
            assert set(phases) == set(module.PHASES) and row["step_ms"] > 0
            assert phases["schedule"] > 0 and phases["prepare"] > 0 and phases["detokenize"] > 0
            # synchronous steps update after the step; async ones book before and resolve after
            assert (phases["update"] > 0) == (mode == "off") and (phases["book"] > 0) == (mode == "on")
        images = rows["images"]
        assert images["requests"] == 6 and images["output_tokens"] == 18 and images["encoder_runs"] == 2
        assert images["phases_ms_per_step"]["encode"] > 0 and images["phases_ms_per_step"]["preprocess"] > 0
        assert rows["decode bs 1"]["phases_ms_per_step"]["encode"] < images["phases_ms_per_step"]["encode"]


def test_latency_benchmark_reports_every_field(latency, checkpoint_dir, tmp_path):
    output = tmp_path / "latency.json"
    # the GPU suite's tiny latency options: the "decode_and_ttft" part's dry command is this one
    result = latency.main(["--model", str(checkpoint_dir()), *load_benchmark("gpu_suite")._TINY_LATENCY, "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(result, default=str))

    memory = result["memory"]
    assert memory["bandwidth_gbs"] > 0 and memory["bandwidth_source"].startswith("measured")
    assert 0 < memory["decode_weight_bytes"] < memory["weight_bytes_total"]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[result["dtype"]]
    assert memory["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * itemsize  # K and V, 2 layers, 2 KV heads, head_dim 16

    assert [row["batch_size"] for row in result["decode"]] == [1, 3]
    for row in result["decode"]:
        assert row["steps_timed"] == 3
        assert 0 < row["min_ms"] <= row["median_ms"] <= row["max_ms"]
        assert 0 < row["weight_floor_ms"] < row["floor_ms"] and row["kv_floor_ms"] > 0
        assert row["mean_context_tokens"] >= 16
        assert row["median_over_floor"] == pytest.approx(row["median_ms"] / row["floor_ms"])

    ttft = result["ttft"]
    cases = {name: ttft[name] for name in ("new_image", "same_request", "same_image_new_question")}
    assert set(ttft) == {*cases, "transformers_new_image", "new_image_over_transformers"}
    assert {name: case["encoder_runs"] for name, case in cases.items()} == {
        "new_image": 1, "same_request": 0, "same_image_new_question": 0,  # the caches were hit
    }
    assert all(case["median_ms"] > 0 and len(case["all_ms"]) == 1 for case in cases.values())
    assert ttft["new_image_over_transformers"] == pytest.approx(ttft["new_image"]["median_ms"] / ttft["transformers_new_image"]["median_ms"])

    busy = result["gpu_busy"]
    if result["device"].startswith("cuda"):
        assert busy["steps_profiled"] == 1 and busy["gpu_busy_share"] > 0 and busy["device_ops_per_step"] > 0
    else:
        assert "nothing runs asynchronously" in busy["skipped"]
    _read_as_the_gpu_suite_part(result, "_decode_reads")


# GPU suite parts whose dry command this file runs as it stands, in-process (test_gpu_suite.py's dry run leaves them out)
IN_PROCESS_PARTS = ["qwen2_5_vl_7b", "qwen3_vl_30b_a3b", "gemma4_dense", "shared_prefix", "tp"]


@pytest.mark.parametrize("part", IN_PROCESS_PARTS)
def test_gpu_suite_parts_run_their_dry_commands(part, tmp_path):
    """The GPU suite's latency parts on Qwen2.5-VL, Qwen3-VL-MoE and Gemma 4, its shared-prefix part and its
    tensor-parallel part (TP 2 on two gloo ranks beside TP 1): each
    part's own dry command (on its tiny stand-in, as the dry run builds it), run in-process and read as the part
    reads it, every figure a value."""
    from pathlib import Path

    suite = load_benchmark("gpu_suite")
    (chosen,) = [p for p in suite.PARTS if p.name == part]
    ctx = suite.Context(tmp_path, tmp_path / "checkpoints", dry_run=True)
    suite.ensure_checkpoints(chosen, ctx, tmp_path / f"{part}.log")
    script, *args = chosen.dry_args(ctx)
    result = load_benchmark(Path(script).stem).main(args)
    assert json.loads(ctx.output(part).read_text()) == json.loads(json.dumps(result, default=str))
    figures = _read_as_the_gpu_suite_part(result, chosen.read.__name__)
    assert all(value is not None for value in figures.values()), figures


def test_a_given_bandwidth_is_used(latency, checkpoint_dir, tmp_path):
    result = latency.main([
        "--model", str(checkpoint_dir()), "--batch-sizes", "2", "--prompt-tokens", "8", "--warmup-steps", "0",
        "--decode-steps", "1", "--ttft-repeats", "1", "--image-size", "40x40", "--profile-batch-size", "2",
        "--profile-steps", "1", "--max-model-len", "256", "--bandwidth-gbs", "1000", "--output", str(tmp_path / "l.json"),
    ])
    assert result["memory"]["bandwidth_gbs"] == 1000 and result["memory"]["bandwidth_source"] == "--bandwidth-gbs"
    (row,) = result["decode"]
    assert row["weight_floor_ms"] == pytest.approx(result["memory"]["decode_weight_bytes"] / 1e12 * 1e3)


def test_ensure_checkpoint_builds_once_and_never_trusts_a_partial_build(latency, tmp_path, monkeypatch):
    spec = TinyLlavaSpec(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    target = tmp_path / "model"
    (tmp_path / "model.partial").mkdir()  # an interrupted earlier build
    (tmp_path / "model.partial" / "junk").write_text("x")
    path, seconds = latency.ensure_checkpoint(target, spec, "cpu", "bfloat16")
    assert path == target and seconds > 0 and not (tmp_path / "model.partial").exists()
    assert (target / "config.json").is_file() and not (target / "junk").exists()

    monkeypatch.setattr(latency, "build_llava_checkpoint", lambda *a, **k: pytest.fail("rebuilt an existing checkpoint"))
    assert latency.ensure_checkpoint(target, spec, "cpu", "bfloat16") == (target, 0.0)


@pytest.mark.parametrize("tied", [False, True])
def test_decode_weight_bytes_count_what_a_decode_step_reads(latency, checkpoint_dir, tied):
    spec = TinyLlavaSpec(text_model="qwen2", vision_model="siglip", tie_word_embeddings=True, seed=1) if tied else TinyLlavaSpec()
    model = MMEngine(str(checkpoint_dir(spec)), max_model_len=256, device="cpu").runner.model
    decoder = sum(p.numel() for n, p in model.language_model.named_parameters() if "embed_tokens" not in n)
    lm_head = model.lm_head.weight.numel()  # read in full even when it is the (tied) embedding
    assert latency.decode_weight_bytes(model) == 4 * (decoder + lm_head)


def test_busy_time_counts_overlaps_once(latency):
    assert latency.busy_union_us([]) == 0
    assert latency.busy_union_us([(0, 10), (20, 25)]) == 15
    assert latency.busy_union_us([(0, 10), (5, 12), (11, 13), (2, 3)]) == 13
    assert latency.busy_union_us([(30, 40), (0, 5), (4, 6)]) == 16



@pytest.mark.parametrize("args", [["--batch-sizes", "1,0"], ["--batch-sizes", "x"], ["--image-size", "640"], ["--image-size", "0x4"]])
def test_bad_options_are_clear_usage_errors(latency, args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        latency.parse_args(args)
    assert exit_info.value.code == 2 and "expected" in capsys.readouterr().err


@pytest.fixture(scope="module")
def shared_prefix():
    return load_benchmark("shared_prefix")


def test_shared_prefix_benchmark_runs_every_mode_on_the_same_workload(shared_prefix, checkpoint_dir, tmp_path, capsys):
    output = tmp_path / "shared_prefix.json"
    result = shared_prefix.main([
        "--model", str(checkpoint_dir()), "--groups", "3", "--degree", "3", "--shared-len", "40", "--unique-len", "8",
        "--output-len", "2", "--images", "1", "--num-kv-blocks", "10", "--block-size", "8", "--keep-outputs",
        "--output", str(output),
    ])
    assert json.loads(output.read_text()) == json.loads(json.dumps(result, default=str))
    modes = result["modes"]
    expected = ["arrival", "sorted", "grouped"] + (["grouped+cascade=on"] if shared_prefix.HAS_CASCADE else [])
    assert list(modes) == expected
    if not shared_prefix.HAS_CASCADE:
        assert "grouped+cascade skipped" in capsys.readouterr().out
    outputs = [row["outputs"] for row in modes.values()]
    assert all(o == outputs[0] for o in outputs) and len(outputs[0]) == 9  # same greedy tokens in every mode
    for row in modes.values():
        assert row["prefill_tokens_minimum"] == 3 * 40 + 9 * 8
        assert row["prefill_tokens_computed"] >= row["prefill_tokens_minimum"] and row["requests_per_s"] > 0
        # Too few steps to reach the profiled window: on CPU there is no device profile at all.
        assert row["decode_attention_ms_per_step"] is None
        assert ("fewer than" if torch.cuda.is_available() else "n/a") in row["note"]
    assert modes["grouped"]["shared_tokens_planned"] == 3 * 2 * 40 // 8 * 8
    assert modes["grouped"]["prefill_tokens_computed"] <= modes["arrival"]["prefill_tokens_computed"]
    assert modes["arrival"]["shared_tokens_planned"] == 0


@pytest.mark.parametrize("args", [["--modes", "fast"], ["--modes", ""], ["--groups", "0"], ["--unique-len", "-1"]])
def test_shared_prefix_bad_options_are_usage_errors(shared_prefix, args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        shared_prefix.parse_args(args)
    assert exit_info.value.code == 2 and "error" in capsys.readouterr().err


def test_throughput_benchmark_runs_both_engines_batched(checkpoint_dir, tmp_path):
    module = load_benchmark("throughput")
    output = tmp_path / "throughput.json"
    result = module.main([
        "--model", str(checkpoint_dir()), "--num-requests", "6", "--unique-images", "2", "--image-fraction", "0.5",
        "--image-size-max", "64", "--prompt-words", "6", "--output-len", "3", "--max-num-seqs", "4",
        "--max-model-len", "256", "--baseline-batch-size", "3", "--baseline-requests", "4", "--output", str(output),
    ])
    assert json.loads(output.read_text()) == json.loads(json.dumps(result, default=str))
    ours, base = result["mmengine"], result["transformers"]
    assert ours["requests"] == 6 and ours["output_tokens"] == 6 * 3
    assert 0 < ours["counts"]["encoder_runs"] <= 2  # each picture is encoded at most once
    # transformers ran the first 4 prompts as a batch of 3 and one of 1, each row to the full length
    assert base["requests"] == 4 and base["output_tokens"] == 4 * 3 and base["batch_size"] == 3
    assert result["speedup_requests_per_s"] == pytest.approx(ours["requests_per_s"] / base["requests_per_s"])
    _read_as_the_gpu_suite_part(result, "_images_reads")  # the "image_workload" part's dry command is this one


def test_lora_benchmark_runs_each_adapter_count_on_the_same_workload(checkpoint_dir, tmp_path):
    module = load_benchmark("lora")
    output = tmp_path / "lora.json"
    result = module.main(["--model", str(checkpoint_dir()), "--adapters", "0,1,3", "--ranks", "4,8", "--num-requests", "6",
                          "--unique-images", "2", "--output-len", "3", "--decode-batch-size", "3", "--decode-steps", "2",
                          "--max-model-len", "256", "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(result, default=str))
    runs = [(r["adapters"], r["rank"]) for r in result["runs"]]
    assert runs == [(0, 0), (1, 4), (3, 4), (1, 8), (3, 8)]
    for row in result["runs"]:
        assert row["requests_per_s"] > 0 and row["decode_step_ms"] > 0 and row["throughput_vs_no_lora"] > 0
    # one adapter shares prefixes as the base model does; three split requests about one picture apart
    prefill = [r["prefill_tokens_computed"] for r in result["runs"]]
    assert prefill[1] == prefill[3] == prefill[0] and prefill[2] == prefill[4] > prefill[0]
    assert [r["lora_slot_loads"] > 0 for r in result["runs"]] == [False, False, True, False, True]
    _read_as_the_gpu_suite_part(result, "_lora_reads")  # the "lora" part's dry command is this one


def test_beam_search_benchmark_reports_each_width(checkpoint_dir, tmp_path):
    module = load_benchmark("beam_search")
    output = tmp_path / "beam.json"
    result = module.main(["--model", str(checkpoint_dir()), "--widths", "1,3", "--num-prompts", "2", "--max-tokens", "3",
                          "--max-model-len", "256", "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(result, default=str))
    assert [row["width"] for row in result["widths"]] == [1, 3]
    for row in result["widths"]:
        assert row["beam_search"]["encoder_runs"] == 2  # one per picture, whatever the width
        assert row["beam_ms_per_prompt"] > 0 and row["independent_ms_per_prompt"] > 0


def _read_as_the_gpu_suite_part(result: dict, reads: str) -> dict[str, object]:
    """The GPU suite part's figures from this result (its dry run is left to these tests): every one read."""
    figures = getattr(load_benchmark("gpu_suite"), reads)(result)
    assert figures and all(name and unit for name, _, unit, _ in figures)
    return {name: value for name, value, _, _ in figures}


def test_tiered_cache_benchmark_encodes_each_picture_once_with_the_host_tier(checkpoint_dir, tmp_path):
    module = load_benchmark("tiered_cache")
    result = module.main(["--model", str(checkpoint_dir()), "--device", "cpu", "--working-set", "1.5", "--rounds", "2",
                          "--image-size", "48", "--max-model-len", "256", "--timing-repeats", "1", "--num-kv-blocks", "8",
                          "--max-num-batched-tokens", "64", "--document-words", "24",
                          "--output", str(tmp_path / "tiered.json")])
    pictures, off, on, both = result["pictures"], result["tiers_off"], result["encoder_tier"], result["both_tiers"]
    assert pictures > result["device_tier_pictures"]
    assert off["encoder_runs"] > pictures and off["encoder_host_hits"] == 0  # the evicted ones are encoded again
    assert on["encoder_runs"] == pictures and on["encoder_runs"] + on["encoder_host_hits"] == off["encoder_runs"]
    assert on["prefill_tokens_computed"] == off["prefill_tokens_computed"] and on["kv_host_hits"] == 0
    assert both["encoder_runs"] == pictures and both["kv_host_hits"] > 0
    assert both["prefill_tokens_computed"] < off["prefill_tokens_computed"]  # the documents' blocks came back
    assert result["per_picture"]["embedding_bytes"] > 0 and result["per_picture"]["encode_ms"] > 0
    _read_as_the_gpu_suite_part(result, "_tiers_reads")  # the "tiers" part's dry command is this one


def test_grammar_engines_benchmark_times_llguidance_on_every_schema(tmp_path):
    module = load_benchmark("grammar_engines")
    result = module.main(["--vocab", "2000", "--steps", "4", "--corpus-bytes", "300000", "--output", str(tmp_path / "g.json")])
    numbers = result["engines"]["llguidance"]
    assert result["schemas"] == 20 and result["vocab"] == 2000
    assert numbers["compile_ms"]["median"] > 0 and numbers["mask_us"]["steps"] >= 20  # at least one mask per schema


def test_encoder_cache_benchmark_video_scenario_encodes_each_patch_once(family_checkpoint, tmp_path):
    module = load_benchmark("encoder_cache")
    output = tmp_path / "encoder_cache.json"
    result = module.main(["--scenarios", "video", "--video-model", str(family_checkpoint("qwen2_5_vl")), "--device", "cpu",
                          "--dtype", "float32", "--num-requests", "3", "--num-clips", "2", "--clip-seconds", "3",
                          "--output-len", "2", "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(result, default=str))
    video = result["video"]
    assert video["requests"] == 6 and video["patches_per_clip"] == 3  # 6 frames a clip, 2 frames a patch
    assert video["mmengine"]["encoder_runs"] == 2 * 3  # each clip's patches once, for its three questions
    assert video["transformers"]["encoder_runs"] == 6 * 3
    assert video["ttft_first_s"] > 0 and video["ttft_second_s"] > 0
    reads = _read_as_the_gpu_suite_part(result, "_video_reads")  # the "video" part's dry command is this one
    assert reads["encoder runs per temporal patch"] == 1.0


def test_hybrid_prefix_benchmark_counts_what_checkpoints_save(family_checkpoint, tmp_path):
    hybrid = load_benchmark("hybrid_prefix")
    output = tmp_path / "hybrid.json"
    result = hybrid.main(["--model", str(family_checkpoint("qwen3_5")), "--device", "cpu", "--dtype", "float32", "--turns", "3",
                          "--output-len", "5", "--requests", "4", "--system-len", "40", "--tail-len", "6",
                          "--picture-size", "64", "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(result, default=str))
    runs = result["runs"]
    assert runs["system / prefix caching off"]["prefill_tokens_computed"] == 4 * 46  # everything, every time
    assert runs["system / prefix caching on"]["prefill_tokens_computed"] <= 2 * 46 + 2 * (46 - 32)  # the 3rd on: its tail
    chat_on, chat_off = runs["chat / prefix caching on"], runs["chat / prefix caching off"]
    assert chat_on["state_checkpoint_hits"] == 2 and chat_off["state_checkpoint_hits"] == 0
    _read_as_the_gpu_suite_part(result, "_hybrid_reads")  # the "qwen3_5_9b" part's dry command is this one
    assert chat_on["prefill_tokens_computed"] < chat_off["prefill_tokens_computed"]
    assert chat_on["encoder_runs"] == 1 and chat_on["state_checkpoint_bytes"] > 0


def test_window_pool_benchmark_fits_more_cached_prefixes_in_the_same_bytes(family_checkpoint, tmp_path):
    """Same KV bytes: with every layer keeping every token, 6 prompts of 48 tokens (4 blocks of 16 each with
    the token generated) overflow 16 blocks and the second pass finds none cached; with the window pool,
    the full pool holds every prompt and the window pool each one's end, and the second pass computes one
    token a prompt."""
    window_pool = load_benchmark("window_pool")
    output = tmp_path / "window_pool.json"
    result = window_pool.main(["--model", str(family_checkpoint("gemma4")), "--device", "cpu", "--dtype", "float32",
                               "--kv-blocks", "16", "--prefixes", "6", "--prompt-len", "48", "--max-model-len", "256",
                               "--max-num-batched-tokens", "80", "--ratios", "0.5", "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(result, default=str))
    every, windowed = result["modes"]["every layer"], result["modes"]["window pool 0.5"]
    # 16 blocks of 16384 bytes: 25 of 4096 (the global layer) and 13 of 12288 (the three sliding layers)
    assert windowed["kv_bytes"] == every["kv_bytes"] == 16 * 16384
    assert (windowed["full_blocks"], windowed["window_blocks"]) == (25, 13)
    assert windowed["kv_bytes_per_context_token"] < every["kv_bytes_per_context_token"] * 0.7
    assert every["second_pass"]["prompts_hit"] == 0
    assert windowed["second_pass"] == {"prefill_tokens_computed": 6, "prompts_hit": 6}
    assert windowed["window_blocks_freed"] > 0
    # the GPU suite's part reads it so (its dry run is this command)
    reads = _read_as_the_gpu_suite_part(result, "_window_pool_reads")
    assert reads["KV bytes per token of context, window pool 0.5 / every layer"] <= 0.8
    assert reads["prompts cached on the second pass, window pool 0.5"] == 6


def test_preprocess_benchmark_times_both_paths_and_checks_their_pixels(tmp_path, monkeypatch):
    """benchmarks/preprocess.py on one photo of each size: every row has both paths' times, and a fast path
    whose pixels differed from transformers' would fail the run, not be timed."""
    from mmengine.testing.qwen_vl import tiny_qwen_vl_path, tiny_spec

    module = load_benchmark("preprocess")
    output = tmp_path / "preprocess.json"
    encoder = tiny_qwen_vl_path(tiny_spec("qwen2_5_vl"))  # the GPU suite's dry stand-in for Qwen2.5-VL-7B
    result = module.main(["--families", "llava", "--photos", "1", "--repeats", "1", "--sizes", "320x240,640x480", "--workers", "1",
                          "--encoder-model", str(encoder), "--device", "cpu", "--output", str(output)])
    assert json.loads(output.read_text()) == json.loads(json.dumps(result))
    assert result["pool"]["workers"][1]["photos_per_s"] > 0  # a pool of one worker, timed
    assert set(result["pool"]["engine"]) == {0, 1} and all(row["seconds"] > 0 for row in result["pool"]["engine"].values())
    for row in result["pool"]["engine"].values():  # the wall time split: the tower's encodes, the other step time, idle
        assert row["photos_encoded"] == 1 and row["encode_s"] > 0 and row["tower_ms_per_photo"] > 0
        assert abs(row["encode_s"] + row["other_step_s"] + row["idle_s"] - row["seconds"]) < 0.01
    engine_rows = result["pool"]["engine"]
    assert engine_rows[0]["workers_cpu_s"] == 0 <= engine_rows[1]["workers_cpu_s"]  # (one small picture: under a clock tick)
    assert all(row["engine_process_cpu_s"] > 0 and row["cpu_bound_of_transformers_processor"] > 0 for row in engine_rows.values())
    (family,) = result["families"]
    for row in result["families"][family].values():
        assert row["fast_path"] == "CLIPImageProcessorPil"
        assert row["mmengine"]["ms_per_photo"] > 0 and row["transformers"]["ms_per_photo"] > 0
    assert result["encoder"]["photos_per_s"] > 0 and result["encoder"]["embeddings_per_photo"] > 0
    assert result["encoder"]["photos_per_s_transformers_attention"] > 0  # the tower timed with per-window attention too
    _read_as_the_gpu_suite_part(result, "_preprocess_reads")  # the "preprocess" part's dry command is this one
    from mmengine.multimodal import fast_image_processor

    monkeypatch.setattr(fast_image_processor.PixelTable, "lookup",
                        lambda self, pixels, out, channel_axis: out.fill(0))  # a broken fast path
    with pytest.raises(AssertionError, match="pixels differ"):
        module.main(["--photos", "1", "--repeats", "1", "--sizes", "320x240", "--families", "llava", "--workers", "",
                     "--output", str(output)])


def test_speculative_benchmark_gives_the_same_answers_in_fewer_steps_at_full_acceptance(tmp_path):
    """benchmarks/spec_decode.py: the three modes on one workload; greedy answers equal, every oracle draft
    kept, so its decode steps are a quarter of the plain run's (3 drafts + 1 token a step)."""
    bench = load_benchmark("spec_decode")
    result = bench.main(["--family", "llava", "--num-prompts", "2", "--output-len", "9", "--passage-len", "6",
                         "--output", str(tmp_path / "spec.json")])
    runs = result["runs"]
    assert result["answers_equal"] and json.loads((tmp_path / "spec.json").read_text())["runs"].keys() == runs.keys()
    assert runs["oracle"]["acceptance"] == 1.0 and runs["oracle"]["decode_steps"] == 2  # 8 decode tokens, 4 a step
    assert runs["off"]["decode_steps"] == 8 and runs["off"]["draft_tokens"] == 0
    figures = _read_as_the_gpu_suite_part(result, "_speculative_reads")  # the "speculative" part reads this
    assert figures["every draft right: decode steps / without"] == 0.25
