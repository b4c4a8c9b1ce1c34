"""Data-parallel serving on Ray Serve: N engine replicas behind one OpenAI-compatible endpoint, with
cache-aware routing.

    from ray import serve
    from mmengine.ray.serve import build_app
    serve.run(build_app("path/to/checkpoint", num_replicas=4, engine_options={"max_model_len": 4096}))

- Each engine replica is its own single-replica deployment (`mmengine-engine-<i>`, so the router can
  name it) holding one AsyncMMEngine over one MMEngine, with one GPU (or a CPU slot). It runs the
  single-engine server's FastAPI app unchanged (protocol checks, auth, errors, streaming, client
  disconnects, /metrics), driven over ASGI with the request forwarded by the ingress.
- The ingress deployment parses each generation request with the server's protocol models, computes
  its routing key (mmengine.ray.routing) and forwards it to the replica the Router picks; the answer
  (whole or a server-sent event stream) is relayed as the replica sends it. A body it cannot parse
  is forwarded as it is, so the replica answers it with the single server's own error.
- `/metrics` merges every replica's metrics: summed, and per replica under a `replica` label, plus
  the router's own counts (`mmengine_router_requests_total{replica, route}`).
"""


import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve
from ray.serve.handle import DeploymentHandle

from mmengine.errors import ConfigError
from mmengine.ray.metrics_merge import merge_replica_metrics
from mmengine.ray.routing import Router, chat_request_key, completion_request_key, with_adapter
from mmengine.utils.heap import freeze_startup_heap

if TYPE_CHECKING:  # the engine replicas import the server (and the engine); the router, in this module too, does not
    from mmengine.entrypoints.api_server import ServerSettings

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT_PREFIX = "mmengine-engine-"
DEFAULT_MAX_ONGOING_REQUESTS = 32  # per replica, before the router sends a key's requests elsewhere
_DISCONNECT_GRACE_S = 5.0
# How often a stopping replica checks whether its requests in flight are done. Serve's default, 2 s, is slept at least
# once by each replica, and the router stops before the engines: serve.shutdown (Ctrl-C) and redeploys took ~4 s more
# than the drain itself. What the drain waits for (every request in flight, graceful_shutdown_timeout_s) is unchanged.
_DRAIN_POLL_S = 0.1

AsgiMessage = dict[str, Any]


class EngineReplica:
    """One MMEngine behind the single-engine server's app; requests arrive as forwarded HTTP."""

    def __init__(self, model: str, engine_options: dict[str, Any], settings: "ServerSettings", replica: int,
                 max_queued_requests: int | None, num_preprocess_workers: int,
                 encoder_store: tuple[str, int] | None = None) -> None:
        """`encoder_store`: (the store actor's name, its bytes): the replicas share one, made by whichever asks first."""
        from mmengine.engine.async_engine import AsyncMMEngine
        from mmengine.entrypoints.api_server import build_app as build_server_app

        self.replica = replica
        self.async_engine = AsyncMMEngine.from_model(model, max_queued_requests=max_queued_requests,
                                                     num_preprocess_workers=num_preprocess_workers, **engine_options)
        if encoder_store is not None:
            from mmengine.ray.encoder_store import EncoderStoreClient, named_store

            self.store_client = EncoderStoreClient(named_store(*encoder_store), self.async_engine.engine)
        self.app = build_server_app(self.async_engine, settings)
        freeze_startup_heap()  # built, not yet serving: as the one-process server and each front end do

    def flush_encoder_store(self) -> bool:
        """Waits until this replica's encoder outputs so far are in the cluster store (True without one)."""
        client = getattr(self, "store_client", None)
        return client.flush() if client is not None else True

    async def forward(self, method: str, path: str, query_string: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> AsyncIterator[AsgiMessage]:
        """Runs one HTTP request through the app; yields its ASGI send messages (start, body chunks).
        Closing this stream early (the client went away) tells the app its client disconnected."""
        sent: asyncio.Queue[AsgiMessage | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        body_read = False

        async def receive() -> AsgiMessage:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: AsgiMessage) -> None:
            await sent.put(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query_string,
            "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        }
        app_task = asyncio.ensure_future(self.app(scope, receive, send))
        app_task.add_done_callback(lambda _: sent.put_nowait(None))
        try:
            while (message := await sent.get()) is not None:
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    break
            if app_task.done():
                app_task.result()  # an app failure surfaces as the handle's error
        finally:
            disconnected.set()
            if not app_task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(app_task), _DISCONNECT_GRACE_S)
                except BaseException:
                    app_task.cancel()

    async def forward_whole(self, method: str, path: str, query_string: bytes, headers: list[tuple[bytes, bytes]],
                            body: bytes) -> list[AsgiMessage]:
        return [message async for message in self.forward(method, path, query_string, headers, body)]

    def metrics_text(self) -> str:  # a plain method: Serve runs it off the event loop, so stats() blocks no one
        return self.app.state.server.metrics.render().decode()

    def check_health(self) -> None:
        """Serve's health probe: a dead engine loop marks the replica unhealthy (Serve restarts it)."""
        if self.async_engine.dead_error is not None:
            raise RuntimeError(f"the engine loop has failed: {self.async_engine.dead_error!r}")


def _request_key(kind: str, body: bytes, base_model: str | None = None) -> str:
    """The request's routing key, read with the server's protocol models. A body they reject gets a
    key all the same (the replica answers it with the single server's error). A request whose `model`
    is not the base model names a LoRA adapter, which is part of its key."""
    from pydantic import ValidationError

    from mmengine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest

    try:
        if kind == "chat":
            chat = ChatCompletionRequest.model_validate_json(body)
            key, model = chat_request_key(chat.messages, chat.mm_uuids, chat.cache_salt), chat.model
        else:
            completion = CompletionRequest.model_validate_json(body)
            prompt = completion.prompt if isinstance(completion.prompt, str) else json.dumps(completion.prompt)
            key, model = completion_request_key(prompt, completion.cache_salt), completion.model
    except (ValidationError, ValueError):
        return "invalid-body"
    return with_adapter(key, model if base_model is not None and model != base_model else None)


# Serve pickles the ingress app when the class below is decorated: everything its routes use is defined above.
ingress_app = FastAPI(title="mmengine", description="OpenAI-compatible multimodal server, data-parallel on Ray Serve")

_GENERATION_PATHS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


@serve.ingress(ingress_app)
class OpenAIRouter:
    """Routes each request to an engine replica by its cache key; merges the replicas' metrics."""

    def __init__(self, engines: list[DeploymentHandle], max_ongoing_requests: int, base_model: str | None = None,
                 encoder_store: str | None = None) -> None:
        """`encoder_store`: the name of the replicas' encoder store actor, ended with the app (see __del__)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

        self.encoder_store = encoder_store
        self.engines = engines
        self.base_model = base_model
        self.router = Router(len(engines), max_ongoing_requests)
        self.loads = [0] * len(engines)
        self._generate_latest = generate_latest
        self.registry = CollectorRegistry()
        self.routed = Counter("mmengine_router_requests", "generation requests routed, by replica and route "
                              "(affinity: the key's own replica; fallback: it was saturated)",
                              ["replica", "route"], registry=self.registry)
        self.in_flight = Gauge("mmengine_router_requests_in_flight", "requests the router has sent a replica and "
                               "not yet seen answered", ["replica"], registry=self.registry)
        for replica in range(len(engines)):
            self.in_flight.labels(str(replica)).set_function(lambda replica=replica: self.loads[replica])
        freeze_startup_heap()  # its event loop relays every request: no full pass over start-up's objects there

    def __del__(self) -> None:
        """Serve calls it as the app stops (serve.shutdown, serve.delete, a redeploy): the replicas' encoder store is a
        detached actor, so that it outlives any one replica; without this it would outlive the app too, a process
        left on the cluster per app. (A replica publishing to it while it drains only logs that it could not.)"""
        if self.encoder_store is not None:
            import ray

            try:
                ray.kill(ray.get_actor(self.encoder_store))
            except ValueError:  # no replica asked for it (never made), or it has ended already
                pass
            except Exception:  # noqa: BLE001 - e.g. the cluster is going down with the app
                logger.warning("could not end the encoder store %s", self.encoder_store, exc_info=True)

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        texts = await asyncio.gather(*(engine.metrics_text.remote() for engine in self.engines))
        body = merge_replica_metrics(texts) + self._generate_latest(self.registry).decode()
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @ingress_app.get("/health")
    async def health(self, request: Request) -> Response:
        """Healthy when every replica is: the first unhealthy replica's answer otherwise."""
        answers = await asyncio.gather(*(self._whole(replica, request) for replica in range(len(self.engines))))
        unhealthy = [answer for answer in answers if answer.status_code != 200]
        return unhealthy[0] if unhealthy else answers[0]

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def proxy(self, path: str, request: Request) -> Response:
        body = await request.body()
        kind = _GENERATION_PATHS.get(request.url.path)
        if kind is None:  # /v1/models, unknown routes: any replica answers as the single server does
            return await self._whole(0, request, body)
        key = await asyncio.to_thread(_request_key, kind, body, self.base_model)  # parsing and hashing: off the event loop
        route = self.router.route(key, self.loads)
        self.routed.labels(str(route.replica), route.reason).inc()
        return await self._forward(route.replica, request, body)

    async def _whole(self, replica: int, request: Request, body: bytes = b"") -> Response:
        """A replica's whole answer to a short request (not counted as load)."""
        start, *rest = await self.engines[replica].forward_whole.remote(
            request.method, request.url.path, request.url.query.encode(), list(request.headers.raw), body)
        response = Response(b"".join(message.get("body", b"") for message in rest), status_code=start["status"])
        response.raw_headers = list(start.get("headers", []))
        return response

    async def _forward(self, replica: int, request: Request, body: bytes) -> Response:
        """Relays a generation request's answer as the replica sends it, counting it as the replica's load."""
        self.loads[replica] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.loads[replica] -= 1

        handle = self.engines[replica].options(stream=True)
        messages = handle.forward.remote(request.method, request.url.path, request.url.query.encode(),
                                         list(request.headers.raw), body)
        try:
            start = await messages.__anext__()
        except BaseException:
            release()
            messages.cancel()
            raise

        async def chunks() -> AsyncIterator[bytes]:
            finished = False
            try:
                async for message in messages:
                    if message["type"] == "http.response.body":
                        if message.get("body"):
                            yield message["body"]
                        if not message.get("more_body", False):
                            finished = True
                            return
            finally:
                release()
                if not finished:  # the client went away: the replica's app sees the disconnect
                    messages.cancel()

        response = StreamingResponse(chunks(), status_code=start["status"])
        response.raw_headers = [(name, value) for name, value in start.get("headers", [])
                                if name.lower() != b"content-length"]
        return response


def build_app(
    model: str,
    num_replicas: int,
    engine_options: dict[str, Any] | None = None,
    *,
    served_model_name: str | None = None,
    settings: "ServerSettings | None" = None,
    max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS,
    max_queued_requests: int | None = None,
    num_preprocess_workers: int = 2,
    num_gpus_per_replica: float | None = None,
    num_cpus_per_replica: float | None = None,
    encoder_store_bytes: int = 0,
) -> serve.Application:
    """The Serve application: `num_replicas` engine replicas of `model` behind a cache-aware router.

    `settings` are the single server's (served model name, API key, chat template, media policy);
    by default the model is served under `served_model_name` or its path. Each replica takes
    `num_gpus_per_replica` GPUs (default: its `tensor_parallel_size` when the engine's device is CUDA, or is
    "auto" and the Ray cluster has that many GPUs, else 0; and 0 when its ranks are Ray actors of their own,
    `distributed_executor_backend="ray"`) and `num_cpus_per_replica` CPUs (default: 1 without a GPU, else 0).
    `max_ongoing_requests` is the queue bound past which the router falls back to the least-loaded
    replica. `encoder_store_bytes` > 0 shares encoder outputs among the replicas through a cluster-wide
    store (mmengine.ray.encoder_store), for requests the router sends away from the replica that
    encoded their pictures (fallback, other salts) and for restarted replicas.
    """
    if not isinstance(num_replicas, int) or isinstance(num_replicas, bool) or num_replicas < 1:
        raise ConfigError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    Router(num_replicas, max_ongoing_requests)  # checks max_ongoing_requests
    engine_options = dict(engine_options or {})
    store = None
    if encoder_store_bytes:
        if engine_options.get("encoder_cache_host_bytes") == 0:
            raise ConfigError("encoder_store_bytes needs the replicas' encoder host tier: encoder_cache_host_bytes must not be 0")
        engine_options.setdefault("encoder_cache_host_bytes", encoder_store_bytes)
        import uuid

        store = (f"mmengine-encoder-store-{uuid.uuid4().hex[:12]}", encoder_store_bytes)
    if settings is None:
        from mmengine.entrypoints.api_server import ServerSettings

        settings = ServerSettings(served_model_name=served_model_name or model)
    num_gpus = _default_num_gpus(engine_options) if num_gpus_per_replica is None else num_gpus_per_replica
    num_cpus = (0 if num_gpus else 1) if num_cpus_per_replica is None else num_cpus_per_replica
    engine_deployment = serve.deployment(EngineReplica).options(
        num_replicas=1, ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        graceful_shutdown_wait_loop_s=_DRAIN_POLL_S,
        # the router bounds what it sends; this only keeps Serve from queueing in front of the engine
        max_ongoing_requests=max(max_ongoing_requests * 4, 64),
    )
    engines = [
        engine_deployment.options(name=f"{ENGINE_DEPLOYMENT_PREFIX}{replica}").bind(
            model, engine_options, settings, replica, max_queued_requests, num_preprocess_workers, store)
        for replica in range(num_replicas)
    ]
    ingress = serve.deployment(OpenAIRouter).options(
        name="mmengine-router", num_replicas=1, ray_actor_options={"num_cpus": 0}, graceful_shutdown_wait_loop_s=_DRAIN_POLL_S,
        max_ongoing_requests=max(max_ongoing_requests * num_replicas * 4, 256),
    )
    return ingress.bind(engines, max_ongoing_requests, settings.served_model_name, store[0] if store else None)


def _default_num_gpus(engine_options: dict[str, Any]) -> int:
    """The GPUs a replica's own actor takes: its engine's ranks when they are processes it spawns (they see the
    actor's GPUs), none when they are Ray actors with GPU bundles of their own, else one on CUDA."""
    device = engine_options.get("device", "auto")
    tensor_parallel_size = engine_options.get("tensor_parallel_size", 1)
    if tensor_parallel_size > 1 and engine_options.get("distributed_executor_backend", "mp") == "ray":
        return 0
    if device == "cpu":
        return 0
    if device.startswith("cuda"):
        return tensor_parallel_size
    import ray

    if not ray.is_initialized():
        ray.init()  # as serve.run would: the cluster named by RAY_ADDRESS, else a local one
    return tensor_parallel_size if ray.cluster_resources().get("GPU", 0) >= tensor_parallel_size else 0


def run_app(app: serve.Application, host: str, port: int) -> None:
    """Runs `app` on Ray Serve at http://host:port until interrupted (connects to the Ray cluster named
    by RAY_ADDRESS, else starts a local one)."""
    import time

    import ray

    if not ray.is_initialized():
        ray.init()
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name="mmengine", route_prefix="/")
    logger.info("serving on http://%s:%d (Ray Serve); Ctrl-C stops", host, port)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
