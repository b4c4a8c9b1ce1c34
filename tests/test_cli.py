"""The `mmengine` command: demo and one-off generate."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mmengine.cli import main
from mmengine.testing import make_test_image


def test_demo_runs_and_reports(tmp_path, capsys):
    assert main(["demo", "--requests", "6", "--max-tokens", "3", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "6 requests" in out and "req/s" in out
    assert "\"requests_finished\": 7" in out  # 6 + the warm-up request


def test_demo_offers_every_family_with_a_tiny_checkpoint():
    from mmengine.cli import DEMO_FAMILIES, build_parser
    from mmengine.testing.families import _PATHS
    from mmengine.testing.qwen_vl import FAMILIES

    assert sorted(DEMO_FAMILIES) == sorted([*_PATHS, *FAMILIES])
    assert build_parser().parse_args(["demo", "--family", "qwen3_5_moe"]).family == "qwen3_5_moe"


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_5", "qwen3_5_moe"])
def test_demo_of_a_qwen_family_asks_about_a_clip(tmp_path, capsys, family):
    assert main(["demo", "--family", family, "--requests", "4", "--max-tokens", "2", "--cache-dir", str(tmp_path)]) == 0
    assert "4 questions about one 16-frame clip (8 temporal patches): 8 encoder runs" in capsys.readouterr().out


def test_generate_on_a_checkpoint(checkpoint_dir, tmp_path, capsys):
    image = tmp_path / "img.png"
    make_test_image(1).save(image)
    args = ["generate", "--model", str(checkpoint_dir()), "--max-tokens", "4", "--max-model-len", "256"]
    assert main([*args, "--prompt", "USER: <image>\nhi ASSISTANT:", "--image", str(image)]) == 0
    assert "finish_reason=" in capsys.readouterr().err
    assert main([*args, "--chat", "--prompt", "hi", "--image", str(image)]) == 0


def test_generate_with_a_video(family_checkpoint, tmp_path, capsys):
    from test_video import clip
    from test_video_inputs import encode_mp4

    video = tmp_path / "clip.mp4"
    video.write_bytes(encode_mp4(clip(8, 48, 64)))
    args = ["generate", "--model", str(family_checkpoint("qwen2_vl")), "--max-tokens", "3", "--max-model-len", "512",
            "--dtype", "float32", "--video", str(video), "--video-fps", "1"]
    assert main([*args, "--chat", "--prompt", "What happens?"]) == 0
    assert "tokens=3" in capsys.readouterr().err
    assert main([*args, "--prompt", "no marker"]) == 2
    assert "0 <|video_pad|> marker(s) but 1 video(s)" in capsys.readouterr().err


def test_bad_input_is_a_clean_error(checkpoint_dir, capsys):
    code = main(["generate", "--model", str(checkpoint_dir()), "--max-model-len", "256", "--prompt", "USER: <image> ASSISTANT:"])
    assert code == 2
    assert "1 <image> marker(s) but 0 image(s)" in capsys.readouterr().err


def test_console_entry_point_is_installed():
    result = subprocess.run([sys.executable, "-m", "mmengine.cli", "--help"], capture_output=True, text=True, check=True)
    assert "demo" in result.stdout and "generate" in result.stdout


def test_demo_and_generate_take_every_engine_option(checkpoint_dir, monkeypatch, capsys):
    """Their engine flags are generated from EngineConfig, as `serve`'s are; generate's --seed stays
    the request's sampling seed."""
    
    from mmengine.cli import build_parser
    from mmengine.config import EngineConfig

    for command, required in (("demo", []), ("generate", ["--model", "m", "--prompt", "p"])):
        parsed = vars(build_parser().parse_args([command, *required]))
        assert {f.name for _, f in EngineConfig.option_fields()} - {"seed"} <= set(parsed)
    seen = {}
    monkeypatch.setattr("mmengine.MMEngine.__init__", lambda self, model, **kwargs: seen.update(kwargs) or None)
    monkeypatch.setattr("mmengine.MMEngine.generate", lambda self, *a, sampling_params, **k: seen.update(seed=sampling_params.seed) or [
        type("Output", (), {"text": "", "finish_reason": "length", "token_ids": []})()])
    args = ["generate", "--model", str(checkpoint_dir()), "--prompt", "hi", "--seed", "7", "--temperature", "0.5",
            "--async-scheduling", "off", "--cascade-attention", "on", "--max-num-seqs", "3"]
    assert main(args) == 0
    assert seen == {"async_scheduling": "off", "cascade_attention": "on", "max_num_seqs": 3, "seed": 7}
    assert main(["demo", "--requests", "2", "--async-scheduling", "never"]) == 2
    assert "async_scheduling must be 'auto', 'on' or 'off'" in capsys.readouterr().err
