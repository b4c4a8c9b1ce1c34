"""`mmengine serve`: its arguments (server options, plus every EngineConfig field as a --kebab-case
flag generated from the dataclass) and the command itself."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmengine.entrypoints.engine_flags import add_engine_options, engine_options
from mmengine.errors import ConfigError
from mmengine.utils.process_exit import leave

_SERVE_EXTRA = 'pip install "mmengine-vlm[serve]"'
_RAY_EXTRA = 'pip install "mmengine-vlm[ray]"'


def build_serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmengine serve",
        description="Serve a local checkpoint over an OpenAI-compatible HTTP API "
        "(/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics).",
    )
    server = parser.add_argument_group("server options")
    server.add_argument("--model", required=True, help="path to a local Hugging Face checkpoint directory")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: --model as given)")
    server.add_argument("--chat-template", default=None, metavar="FILE", help="a Jinja chat template (default: the model's own)")
    server.add_argument("--api-key", default=os.environ.get("MMENGINE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $MMENGINE_API_KEY, else none)")
    server.add_argument("--max-queued-requests", type=int, default=None, metavar="N",
                        help="answer 503 (Retry-After) while N requests wait for their first token (default: no limit)")
    server.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                        help="allow file:// image URLs under DIR (default: none allowed)")
    server.add_argument("--allow-remote-media", action="store_true", help="fetch http(s) image URLs (default: refused)")
    server.add_argument("--preprocess-workers", type=int, default=2, metavar="N",
                        help="threads decoding and preprocessing images (default: 2)")
    server.add_argument("--max-admission-wait-ms", type=float, default=0.0, metavar="MS",
                        help="before each step, wait at most MS for requests still being prepared (template, pictures), "
                        "so one arriving during a step joins the next; this adds up to MS between the running requests' "
                        "tokens while one is prepared (default: 0, never wait)")
    server.add_argument("--api-server-count", type=int, default=1, metavar="N",
                        help="front-end processes (HTTP, media, chat templates, preprocessing) sharing the port and one "
                        "engine-core process (scheduler, caches, model); 1 (default) serves in this process. "
                        "--preprocess-workers and --mm-processor-workers count per front end; --max-queued-requests "
                        "is split among them")
    parallel = parser.add_argument_group("data parallelism (Ray Serve)")
    parallel.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                          help="engine replicas (one GPU each, else a CPU slot) behind a cache-aware router on Ray "
                          "Serve; 1 (default) serves one engine in this process")
    parallel.add_argument("--max-ongoing-requests-per-replica", type=int, default=32, metavar="N",
                          help="with --data-parallel-size > 1: a replica with N requests in flight is saturated, and "
                          "the router sends requests that prefer it to the least-loaded replica (default: 32)")
    parallel.add_argument("--encoder-store-bytes", type=int, default=0, metavar="N",
                          help="with --data-parallel-size > 1: share encoder outputs among the replicas through a "
                          "cluster-wide store of N bytes (default: 0, off)")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="let a chat request bring its own chat_template (rendered in transformers' sandboxed Jinja); "
                        "off by default: a request's chat_template is then a 400")
    server.add_argument("--enable-mm-embeds", action="store_true",
                        help="accept image_embeds content parts (base64 of torch.save(tensor)); off by default, as "
                        "they are untrusted tensors")
    server.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) to register at start; a request selects one by its "
                        "`model` field (needs --enable-lora)")
    server.add_argument("--enable-lora-runtime-updates", action="store_true",
                        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --enable-lora)")
    server.add_argument("--max-n", type=int, default=16, metavar="N",
                        help="the most samples a request may ask for per prompt (n, best_of; default: 16)")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    server.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no access-log line per request from uvicorn (at --log-level info or debug it logs one "
                        "per request, on each server process's event loop)")
    add_engine_options(parser)
    return parser


def run_serve(argv: Sequence[str], as_command: bool = False) -> None:
    """`mmengine serve ARGS`. `as_command`: this process is the command, so the one-process server ends it once
    it has stopped (exit code 0, or 1 when the engine died), without the interpreter's teardown."""
    args = build_serve_parser().parse_args(argv)
    for module in ("fastapi", "uvicorn", "prometheus_client"):
        if importlib.util.find_spec(module) is None:  # not imported here: with --api-server-count N, the front ends use them
            raise ConfigError(f"mmengine serve needs the serve extra ({module} is missing): {_SERVE_EXTRA}")
    from mmengine.entrypoints.server_settings import ServerSettings
    from mmengine.multimodal.media_urls import MediaPolicy

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535, got {args.port}")
    template = None
    if args.chat_template is not None:
        try:
            template = Path(args.chat_template).read_text()
        except OSError as err:
            raise ConfigError(f"--chat-template {args.chat_template}: cannot read it ({err.strerror or err})") from None
    media_dir = None
    if args.allowed_local_media_path is not None:
        media_dir = Path(args.allowed_local_media_path).resolve()
        if not media_dir.is_dir():
            raise ConfigError(f"--allowed-local-media-path {args.allowed_local_media_path} is not a directory")
    lora_modules = parse_lora_modules(args.lora_modules)
    if (lora_modules or args.enable_lora_runtime_updates) and not args.enable_lora:
        raise ConfigError("--lora-modules and --enable-lora-runtime-updates need --enable-lora")
    if args.data_parallel_size < 1:
        raise ConfigError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.api_server_count < 1:
        raise ConfigError(f"--api-server-count must be >= 1, got {args.api_server_count}")
    if args.api_server_count > 1:
        if args.data_parallel_size > 1:
            raise ConfigError("--api-server-count > 1 is not supported with --data-parallel-size > 1: each Ray replica "
                              "serves in one process")
        if args.enable_lora:
            raise ConfigError("--api-server-count > 1 does not serve LoRA adapters yet (the engine core runs in a "
                              "process of its own): use --api-server-count 1")
    if args.max_n < 1:
        raise ConfigError(f"--max-n must be >= 1, got {args.max_n}")
    if args.data_parallel_size > 1 and args.enable_lora_runtime_updates:
        raise ConfigError("--enable-lora-runtime-updates is not supported with --data-parallel-size > 1 (a load would "
                          "reach one replica): register adapters with --lora-modules")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = ServerSettings(
        served_model_name=args.served_model_name or args.model,
        api_key=args.api_key,
        chat_template=template,
        media=MediaPolicy(allowed_local_media_path=media_dir, allow_remote_media=args.allow_remote_media),
        lora_modules=lora_modules,
        lora_runtime_updates=args.enable_lora_runtime_updates,
        enable_mm_embeds=args.enable_mm_embeds,
        max_n=args.max_n,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    if args.data_parallel_size > 1:
        _run_data_parallel(args, settings)
        return
    if args.api_server_count > 1:
        from mmengine.entrypoints.server_processes import FrontEndSpec, run_server_processes

        spec = FrontEndSpec(args.model, engine_options(args), settings, max_queued_requests=args.max_queued_requests,
                            num_preprocess_workers=args.preprocess_workers, log_level=args.log_level,
                            access_log=not args.disable_uvicorn_access_log,
                            max_admission_wait_s=args.max_admission_wait_ms / 1000)
        exit_code = run_server_processes(spec, args.api_server_count, args.host, args.port)
        if exit_code:
            raise SystemExit(exit_code)
        return
    from mmengine.config import EngineConfig
    from mmengine.entrypoints.listening_socket import listening_socket

    EngineConfig.from_kwargs(args.model, **engine_options(args))  # a bad option is its own error, not the port's
    sock = listening_socket(args.host, args.port)  # before torch and the model load: a taken port fails at once
    from mmengine.engine.async_engine import AsyncMMEngine
    from mmengine.entrypoints.api_server import run_server

    async_engine = AsyncMMEngine.from_model(
        args.model,
        max_queued_requests=args.max_queued_requests,
        num_preprocess_workers=args.preprocess_workers,
        max_admission_wait_s=args.max_admission_wait_ms / 1000,
        **engine_options(args),
    )
    code = 0
    try:
        run_server(async_engine, settings, args.host, args.port, log_level=args.log_level,
                   access_log=not args.disable_uvicorn_access_log, sock=sock)
    except SystemExit as stop:  # the engine died: 1, after the drain
        if not as_command:
            raise
        code = stop.code if isinstance(stop.code, int) else 1
    if as_command:  # the app's shutdown has stopped the engine's processes and released its shared memory; the
        leave(code)  # interpreter's teardown only cost seconds and printed Triton's nanobind leak report (~30 lines)


def parse_lora_modules(items: Sequence[str]) -> dict[str, str]:
    """--lora-modules NAME=PATH ... as {name: path}; a malformed or repeated name is a ConfigError."""
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not (sep and name and path):
            raise ConfigError(f"--lora-modules expects NAME=PATH, got {item!r}")
        if name in modules:
            raise ConfigError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules


def _run_data_parallel(args: argparse.Namespace, settings: Any) -> None:
    try:
        __import__("ray.serve")
    except ImportError:
        raise ConfigError(f"--data-parallel-size needs Ray Serve (ray[serve] is missing): {_RAY_EXTRA}") from None
    from mmengine.ray.serve import build_app, run_app

    app = build_app(
        args.model, args.data_parallel_size, engine_options(args), settings=settings,
        max_ongoing_requests=args.max_ongoing_requests_per_replica, max_queued_requests=args.max_queued_requests,
        num_preprocess_workers=args.preprocess_workers, encoder_store_bytes=args.encoder_store_bytes,
    )
    run_app(app, args.host, args.port)
