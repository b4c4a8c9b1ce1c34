"""The `mmengine serve` command: engine flags generated from EngineConfig, clean errors, and the real
command serving requests in a subprocess."""

from __future__ import annotations

import socket

import httpx
import psutil
import pytest
from serve_helpers import running_server

from mmengine.cli import main
from mmengine.config import EngineConfig
from mmengine.engine.async_engine import AsyncMMEngine
from mmengine.errors import ConfigError
from mmengine.entrypoints.serve_cli import build_serve_parser, engine_options


def test_every_engine_config_field_is_a_flag():
    parser = build_serve_parser()
    flags = {option for action in parser._actions for option in action.option_strings}
    for _, field in EngineConfig.option_fields():
        assert "--" + field.name.replace("_", "-") in flags, field.name
    assert "--no-enable-prefix-caching" in flags and "--enforce-eager" in flags


def test_flags_become_typed_engine_options():
    args = build_serve_parser().parse_args([
        "--model", "m", "--max-num-seqs", "4", "--no-enable-prefix-caching", "--limit-mm-per-prompt", "image=2",
        "--gpu-memory-utilization", "0.5", "--max-model-len", "128", "--dtype", "float32", "--port", "9000",
    ])
    options = engine_options(args)
    assert options == {"max_num_seqs": 4, "enable_prefix_caching": False, "limit_mm_per_prompt": {"image": 2},
                       "gpu_memory_utilization": 0.5, "max_model_len": 128, "dtype": "float32"}
    config = EngineConfig.from_kwargs("m", **options)  # flags left out keep the dataclass defaults
    assert config.cache_config.block_size == EngineConfig(model="m").cache_config.block_size and config.scheduler_config.max_num_seqs == 4
    assert args.port == 9000 and args.served_model_name is None


def test_a_taken_port_is_a_clean_error_before_the_model_loads(checkpoint_dir, capsys, monkeypatch):
    """serve binds its port first (as vLLM does): a taken one fails at once, naming the address, without loading the
    model (the one-process server had loaded it, then uvicorn logged the error and exited 3) or starting a process
    (the multi-process launcher raised an OSError traceback)."""
    monkeypatch.setattr(AsyncMMEngine, "from_model", classmethod(lambda *_, **__: pytest.fail("the model was loaded")))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for flags in ([], ["--api-server-count", "2"]):
            assert main(["serve", "--model", str(checkpoint_dir()), "--port", str(port), *flags]) == 2
            assert f"cannot listen on 127.0.0.1:{port} (--host, --port): Address already in use" in capsys.readouterr().err
            assert not [child for child in psutil.Process().children() if "spawn_main" in " ".join(child.cmdline())]


def test_a_port_out_of_range_is_named():
    from mmengine.entrypoints.listening_socket import listening_socket

    for port in (-1, 65536):
        with pytest.raises(ConfigError, match=f"--port must be 0-65535 \\(0: any free port\\), got {port}"):
            listening_socket("127.0.0.1", port)


def test_bad_serve_options_are_clean_errors(checkpoint_dir, tmp_path, capsys):
    missing = tmp_path / "template.jinja"
    assert main(["serve", "--model", str(checkpoint_dir()), "--chat-template", str(missing)]) == 2
    assert f"--chat-template {missing}: cannot read it" in capsys.readouterr().err
    assert main(["serve", "--model", str(checkpoint_dir()), "--allowed-local-media-path", str(missing)]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["serve", "--model", str(checkpoint_dir()), "--max-num-seqs", "0", "--port", "1"]) == 2
    assert "max_num_seqs must be a positive int" in capsys.readouterr().err


def test_the_serve_command_wires_the_engine_and_the_server(checkpoint_dir, monkeypatch):
    """`main(["serve", ...])` in-process, up to uvicorn.run: the server it would run is started on a free
    loopback port instead (a subprocess would spend most of its time importing torch)."""
    served = {}

    def run_on_a_free_port(async_engine, settings, host, port, log_level, access_log, sock):
        served.update(host=host, port=port, log_level=log_level, access_log=access_log, engine=async_engine.engine,
                      bound=sock.getsockname())
        sock.close()
        with running_server(async_engine, settings) as server:
            auth = {"Authorization": "Bearer secret"}
            served["models"] = httpx.get(server.v1 + "/models", headers=auth).json()
            served["refused"] = httpx.get(server.v1 + "/models").status_code
            served["answer"] = httpx.post(server.v1 + "/completions", headers=auth, timeout=60, json={
                "model": "tiny", "prompt": "USER: hi ASSISTANT:", "max_tokens": 3, "ignore_eos": True}).json()
            served["max_queued_requests"] = async_engine.max_queued_requests
            served["max_admission_wait_s"] = async_engine.max_admission_wait_s

    monkeypatch.setattr("mmengine.entrypoints.api_server.run_server", run_on_a_free_port)
    assert main(["serve", "--model", str(checkpoint_dir()), "--port", "0", "--host", "127.0.0.2",
                 "--served-model-name", "tiny", "--api-key", "secret", "--max-queued-requests", "5",
                 "--max-model-len", "128", "--no-enable-prefix-caching", "--log-level", "warning",
                 "--max-admission-wait-ms", "5", "--disable-uvicorn-access-log"]) == 0
    assert (served["host"], served["port"], served["log_level"]) == ("127.0.0.2", 0, "warning")
    assert served["bound"][0] == "127.0.0.2" and served["bound"][1] > 0  # bound before the model loaded
    assert served["access_log"] is False
    config = served["engine"].config
    assert config.model_config.max_model_len == 128 and config.cache_config.enable_prefix_caching is False
    assert [m["id"] for m in served["models"]["data"]] == ["tiny"] and served["refused"] == 401
    assert served["answer"]["usage"]["completion_tokens"] == 3 and served["max_queued_requests"] == 5
    assert served["max_admission_wait_s"] == 0.005


def test_the_served_name_defaults_to_the_model_argument(checkpoint_dir, monkeypatch):
    names, waits, access_logs = [], [], []

    def record(async_engine, settings, *args, **kwargs):
        names.append(settings.served_model_name)
        waits.append(async_engine.max_admission_wait_s)
        access_logs.append(kwargs["access_log"])

    monkeypatch.setattr("mmengine.entrypoints.api_server.run_server", record)
    assert main(["serve", "--model", str(checkpoint_dir()), "--max-model-len", "128"]) == 0
    assert names == [str(checkpoint_dir())]
    assert waits == [0.0]  # steps never wait for requests being prepared unless asked: the wait delays running requests
    assert access_logs == [True]  # uvicorn's access log stays on unless --disable-uvicorn-access-log (as vLLM's)


def test_the_access_log_option_is_in_the_help(capsys):
    try:
        main(["serve", "--help"])
    except SystemExit:
        pass
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--disable-uvicorn-access-log no access-log line per request from uvicorn" in help_text


def test_api_server_count_is_wired_and_refuses_what_it_cannot_serve(checkpoint_dir, monkeypatch, capsys):
    """`--api-server-count 3` hands the launcher the engine options, the server settings and a per-front-end
    share of --max-queued-requests; a bad count and the combinations it cannot serve are refused by name."""
    launched = {}

    def launch(spec, count, host, port):
        launched.update(spec=spec, count=count, host=host, port=port)
        return 1  # as if a process died: `mmengine serve` exits non-zero

    monkeypatch.setattr("mmengine.entrypoints.server_processes.run_server_processes", launch)
    model = str(checkpoint_dir())
    try:
        main(["serve", "--model", model, "--api-server-count", "3", "--port", "8124", "--max-queued-requests", "8",
              "--served-model-name", "tiny", "--max-model-len", "128", "--mm-processor-workers", "1", "--log-level", "warning",
              "--max-admission-wait-ms", "20", "--disable-uvicorn-access-log"])
    except SystemExit as exit_:
        assert exit_.code == 1
    else:
        raise AssertionError("a launcher's non-zero exit code must end `mmengine serve` with it")
    spec = launched["spec"]
    assert (launched["count"], launched["port"], spec.model, spec.settings.served_model_name) == (3, 8124, model, "tiny")
    assert spec.engine_options["max_model_len"] == 128 and spec.engine_options["mm_processor_workers"] == 1
    assert spec.max_queued_requests == 8  # split among the front ends by the launcher (ceil(8 / 3) = 3 each)
    assert spec.max_admission_wait_s == 0.02 and spec.access_log is False  # each front end's uvicorn.Config
    for flags, message in ((["--api-server-count", "0"], "--api-server-count must be >= 1"),
                           (["--api-server-count", "2", "--enable-lora"], "does not serve LoRA adapters"),
                           (["--api-server-count", "2", "--data-parallel-size", "2"], "not supported with --data-parallel-size")):
        assert main(["serve", "--model", model, *flags]) == 2
        assert message in capsys.readouterr().err


def test_front_ends_share_the_queue_limit():
    from mmengine.entrypoints.server_processes import per_front_end_limit

    assert [per_front_end_limit(8, 3), per_front_end_limit(1, 4), per_front_end_limit(None, 2), per_front_end_limit(64, 2)] == [3, 1, None, 32]
