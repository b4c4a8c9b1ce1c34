"""Data-parallel serving on a local Ray cluster (CPU, tiny checkpoint): 2 engine replicas behind the
cache-aware router. A multi-turn chat about one picture is answered every turn by the replica that
encoded it (as the per-replica metrics show), a picture whose key hashes to the other replica is
encoded there, answers equal offline greedy chat, and streaming, auth and /metrics pass through."""

from __future__ import annotations

import ast
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from helpers import wait_until
from serve_helpers import API_KEY, MODEL_NAME, data_url, image_part, parse_metrics

from mmengine import MMEngine, SamplingParams
from mmengine.entrypoints.api_server import ServerSettings
from mmengine.ray.routing import Router, chat_request_key
from mmengine.testing import make_test_image

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
serve = pytest.importorskip("ray.serve", reason="the ray extra is not installed")

ENGINE_OPTIONS = {"max_model_len": 512}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
NUM_REPLICAS = 2
MAX_ONGOING = 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def base_url(ray_cluster, checkpoint_dir):
    from mmengine.ray.serve import build_app

    path = str(checkpoint_dir())
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_app(path, NUM_REPLICAS, ENGINE_OPTIONS, settings=ServerSettings(MODEL_NAME, api_key=API_KEY),
                        max_ongoing_requests=MAX_ONGOING, num_cpus_per_replica=0.5, encoder_store_bytes=1 << 24)
        serve.run(app, name="mmengine", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def offline(checkpoint_dir):
    return MMEngine(str(checkpoint_dir()), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as client:
        yield client


def _metrics(base_url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(base_url + "/metrics", timeout=60).text)


def _per_replica(metrics: dict[str, float], name: str) -> list[float]:
    return [metrics.get(f'{name}{{replica="{replica}"}}', 0.0) for replica in range(NUM_REPLICAS)]


def _user(url: str, question: str) -> dict:
    return {"role": "user", "content": [image_part(url), {"type": "text", "text": question}]}


def _offline_user(question: str) -> dict:
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}


def _replica_of(url: str) -> int:
    return Router(NUM_REPLICAS, MAX_ONGOING).route(chat_request_key([_user(url, "")]), [0] * NUM_REPLICAS).replica


def test_a_multi_turn_chat_stays_on_the_replica_that_encoded_its_picture(base_url, client, offline):
    image = make_test_image(301)
    url = data_url(image)
    home = _replica_of(url)
    questions = ["What is this?", "And its colours?", "Anything else?"]
    messages, offline_turns = [], []
    # counts are taken relative to the start: other tests of this module may have run first (any order)
    start = _metrics(base_url)
    runs_before = _per_replica(start, "mmengine_encoder_runs_total")
    finished_before = _per_replica(start, "mmengine_requests_finished_total")
    affinity = f'mmengine_router_requests_total{{replica="{home}",route="affinity"}}'
    routed_before = start.get(affinity, 0.0)
    for turn, question in enumerate(questions):
        messages.append(_user(url, question) if turn == 0 else {"role": "user", "content": question})
        offline_turns.append(_offline_user(question) if turn == 0 else {"role": "user", "content": question})
        answer = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0)
        (expected,) = offline.chat(offline_turns, images=[image], sampling_params=SamplingParams(max_tokens=6, temperature=0),
                                   use_tqdm=False)
        text = answer.choices[0].message.content
        assert text == expected.text  # as one engine answers it (greedy)
        if turn > 0:
            assert answer.usage.prompt_tokens_details.cached_tokens > 0  # the earlier turns' KV blocks, on this replica
        metrics = _metrics(base_url)
        encoder_runs = [now - before for now, before in zip(_per_replica(metrics, "mmengine_encoder_runs_total"), runs_before)]
        finished = [now - before for now, before in zip(_per_replica(metrics, "mmengine_requests_finished_total"), finished_before)]
        assert encoder_runs[home] == 1 and encoder_runs[1 - home] == 0, encoder_runs  # once, on its replica, over all turns
        assert finished[home] == turn + 1 and finished[1 - home] == 0, finished
        messages.append({"role": "assistant", "content": text})
        offline_turns.append({"role": "assistant", "content": text})
    assert metrics[affinity] - routed_before == len(questions)


def test_a_picture_that_hashes_elsewhere_is_encoded_on_the_other_replica(base_url, client, offline):
    home = _replica_of(data_url(make_test_image(301)))
    seed = next(seed for seed in range(302, 400) if _replica_of(data_url(make_test_image(seed))) != home)
    image = make_test_image(seed)
    before = _per_replica(_metrics(base_url), "mmengine_encoder_runs_total")
    answer = client.chat.completions.create(model=MODEL_NAME, messages=[_user(data_url(image), "Describe it.")],
                                            max_tokens=6, temperature=0)
    after = _per_replica(_metrics(base_url), "mmengine_encoder_runs_total")
    assert after[1 - home] == before[1 - home] + 1 and after[home] == before[home]
    (expected,) = offline.chat([_offline_user("Describe it.")], images=[image],
                               sampling_params=SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert answer.choices[0].message.content == expected.text


def _store_stats() -> dict[str, int]:
    (store,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("mmengine-encoder-store-")]
    return ray.get(ray.get_actor(store["name"], namespace=store["namespace"]).stats.remote())


def test_a_picture_routed_to_the_other_replica_is_fetched_from_the_encoder_store(base_url, client, offline):
    """A cache salt sends the same picture to the other replica (salts share no KV blocks, but the
    picture's embeddings are the same): it fetches them from the store instead of encoding."""
    image = make_test_image(330)
    url = data_url(image)
    home = _replica_of(url)
    salt = next(f"tenant-{i}" for i in range(100)
                if Router(NUM_REPLICAS, MAX_ONGOING).route(chat_request_key([_user(url, "")], cache_salt=f"tenant-{i}"),
                                                           [0] * NUM_REPLICAS).replica != home)
    published = _store_stats()["published"]
    client.chat.completions.create(model=MODEL_NAME, messages=[_user(url, "What is it?")], max_tokens=4, temperature=0)
    # publishing runs in the background: the replica says when its outputs so far are in the store
    from mmengine.ray.serve import ENGINE_DEPLOYMENT_PREFIX

    engine = serve.get_deployment_handle(f"{ENGINE_DEPLOYMENT_PREFIX}{home}", app_name="mmengine")
    assert engine.flush_encoder_store.remote().result() and _store_stats()["published"] == published + 1
    before = _metrics(base_url)
    answer = client.chat.completions.create(model=MODEL_NAME, messages=[_user(url, "What is it?")], max_tokens=4,
                                            temperature=0, extra_body={"cache_salt": salt})
    after = _metrics(base_url)
    runs = [a - b for a, b in zip(_per_replica(after, "mmengine_encoder_runs_total"), _per_replica(before, "mmengine_encoder_runs_total"))]
    hits = [a - b for a, b in zip(_per_replica(after, "mmengine_encoder_host_hits_total"),
                                  _per_replica(before, "mmengine_encoder_host_hits_total"))]
    assert runs == [0, 0] and hits[1 - home] == 1
    (expected,) = offline.chat([_offline_user("What is it?")], images=[image],
                               sampling_params=SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert answer.choices[0].message.content == expected.text


def test_streams_pass_through_the_router(base_url, client):
    request = dict(model=MODEL_NAME, messages=[_user(data_url(make_test_image(310)), "Tell me more.")], max_tokens=10,
                   temperature=0)
    # Salts of their own: each request prefills its whole prompt alone. A prefix hit would compute the last
    # block in a matmul of another shape, and the tiny random model's near-tied logits can then flip a token.
    whole = client.chat.completions.create(**request, extra_body={"cache_salt": "whole"})
    with httpx.stream("POST", base_url + "/v1/chat/completions", json={**request, "stream": True, "cache_salt": "streamed"},
                      headers=HEADERS, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    pieces = [event["choices"][0]["delta"].get("content", "") for event in events]
    # How the tokens group into deltas follows the reader's pace (a late reader gets what came meanwhile as one
    # delta; it failed once under load as one blob), so it is not asserted here: that the router passes the stream
    # on as it comes, not buffered to the end, is the next test's (its client leaves after 3 events, mid-answer).
    assert "".join(pieces) == whole.choices[0].message.content
    assert {event["id"] for event in events} == {events[0]["id"]}
    assert events[-1]["choices"][0]["finish_reason"] == whole.choices[0].finish_reason


def test_a_client_that_leaves_mid_stream_frees_the_replica(base_url):
    body = {"model": MODEL_NAME, "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True,
            "messages": [_user(data_url(make_test_image(320)), "A long story, please.")]}
    before = _metrics(base_url)
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, headers=HEADERS, timeout=120) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # closes the connection mid-stream
    deadline = time.monotonic() + 60
    while True:  # the abort crosses the proxy, the router and the replica's app (bounded wait)
        after = _metrics(base_url)
        idle = after["mmengine_requests_in_flight"] == 0 and after["mmengine_requests_running"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert idle and _per_replica(after, "mmengine_router_requests_in_flight") == [0] * NUM_REPLICAS
    assert after["mmengine_kv_blocks_free"] == after["mmengine_kv_blocks_total"]
    assert after["mmengine_client_disconnects_total"] == before["mmengine_client_disconnects_total"] + 1
    assert after["mmengine_generation_tokens_total"] - before["mmengine_generation_tokens_total"] < 300


def test_models_health_auth_and_merged_metrics(base_url):
    models = httpx.get(base_url + "/v1/models", headers=HEADERS, timeout=60).json()
    assert [card["id"] for card in models["data"]] == [MODEL_NAME]
    assert httpx.get(base_url + "/health", timeout=60).status_code == 200
    refused = httpx.post(base_url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": []}, timeout=60)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    bad = httpx.post(base_url + "/v1/chat/completions", content=b"{not json", headers=HEADERS, timeout=60)
    assert bad.status_code in (400, 422)  # answered by a replica, as the single server answers it
    metrics = _metrics(base_url)
    for name in ("mmengine_encoder_runs_total", "mmengine_kv_blocks_total", "mmengine_prompt_tokens_total"):
        assert metrics[name] == sum(_per_replica(metrics, name)), name
    assert all(value > 0 for value in _per_replica(metrics, "mmengine_kv_blocks_total"))
    assert metrics["mmengine_engine_healthy"] == NUM_REPLICAS
    assert _per_replica(metrics, "mmengine_router_requests_in_flight") == [0] * NUM_REPLICAS  # every answer released


def _in_replica(deployment: str, probe: Callable[[], Any]) -> Any:
    """What `probe` returns when run in the live process of `deployment`'s one replica (Ray's __ray_call__ on its
    actor): the test reads the process that serves, without a method of the deployment's own for it."""
    (actor,) = [actor for actor in ray.util.list_named_actors(all_namespaces=True) if f"#{deployment}#" in actor["name"]]
    return ray.get(ray.get_actor(actor["name"], namespace=actor["namespace"]).__ray_call__.remote(lambda _: probe()))


def test_every_replica_froze_its_start_up_heap_before_serving(base_url):
    """Each engine replica and the router froze what their start-up built out of the garbage collector's full
    passes (utils/heap.py), as the one-process server and each front end do: unfrozen, a full pass over a tiny
    model's server walked ~450k objects, 250 ms with the GIL held, every few hundred requests."""
    from mmengine.ray.serve import ENGINE_DEPLOYMENT_PREFIX

    names = [f"{ENGINE_DEPLOYMENT_PREFIX}{replica}" for replica in range(NUM_REPLICAS)] + ["mmengine-router"]
    frozen = {name: _in_replica(name, lambda: __import__("gc").get_freeze_count()) for name in names}
    # an engine replica froze ~533k objects (torch, transformers, the model, the app), the router ~164k (fastapi,
    # Ray Serve's replica). One that never froze answers 0: Ray Serve's own start-up freeze is off in the tests'
    # cluster (helpers.LocalRay), so this is mmengine's.
    assert all(count > 10_000 for count in frozen.values()), frozen


def test_a_stopping_replica_checks_its_requests_in_flight_in_short_polls(base_url):
    """Each deployment's drain on stopping (serve.shutdown, a redeploy) checks for requests in flight every
    graceful_shutdown_wait_loop_s: Serve's 2 s default is slept at least once by each replica, router first, then the
    engines (~4 s more than the drain needs, on every Ctrl-C of `mmengine serve --data-parallel-size`)."""
    from ray.serve.context import _get_global_client

    from mmengine.ray.serve import ENGINE_DEPLOYMENT_PREFIX

    deployments = _get_global_client().get_serve_details()["applications"]["mmengine"]["deployments"]
    polls = {name: details["deployment_config"]["graceful_shutdown_wait_loop_s"] for name, details in deployments.items()}
    assert set(polls) == {f"{ENGINE_DEPLOYMENT_PREFIX}{replica}" for replica in range(NUM_REPLICAS)} | {"mmengine-router"}
    assert all(poll <= 0.25 for poll in polls.values()), polls


def test_the_serve_command_with_data_parallel_size_builds_the_ray_app(checkpoint_dir, monkeypatch, capsys):
    """`mmengine serve --data-parallel-size 3` hands its options to build_app and runs the app on Ray
    Serve (intercepted here: the app itself is served by the fixture above); it loads no engine itself."""
    from mmengine.cli import main

    calls = {}
    monkeypatch.setattr("mmengine.ray.serve.build_app", lambda *args, **kwargs: calls.update(build=(args, kwargs)) or "app")
    monkeypatch.setattr("mmengine.ray.serve.run_app", lambda app, host, port: calls.update(run=(app, host, port)))
    monkeypatch.setattr("mmengine.engine.async_engine.AsyncMMEngine.from_model",
                        lambda *args, **kwargs: pytest.fail("a data-parallel serve loads no engine in the driver"))
    path = str(checkpoint_dir())
    assert main(["serve", "--model", path, "--data-parallel-size", "3", "--max-ongoing-requests-per-replica", "5",
                 "--max-model-len", "128", "--served-model-name", "tiny", "--port", "8124", "--encoder-store-bytes", "4096"]) == 0
    (model, num_replicas, options), kwargs = calls["build"]
    assert (model, num_replicas, options) == (path, 3, {"max_model_len": 128})
    assert kwargs["max_ongoing_requests"] == 5 and kwargs["settings"].served_model_name == "tiny"
    assert kwargs["encoder_store_bytes"] == 4096
    assert calls["run"] == ("app", "127.0.0.1", 8124)
    assert main(["serve", "--model", path, "--data-parallel-size", "0"]) == 2
    assert "--data-parallel-size must be >= 1" in capsys.readouterr().err


def _modules_imported_by(argv: list[str]) -> tuple[str, list[str]]:
    import subprocess
    import sys

    probe = (f"import sys\nfrom mmengine.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
             "print(sorted(name for name in ('torch', 'ray') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    *help_lines, imported = result.stdout.strip().splitlines()
    return "\n".join(help_lines), ast.literal_eval(imported)


def test_help_stays_light():
    assert _modules_imported_by(["--help"])[1] == []  # neither torch nor ray
    text, imported = _modules_imported_by(["serve", "--help"])
    assert "--data-parallel-size" in text and "ray" not in imported


def test_the_router_keys_requests_without_importing_the_engine(base_url, client):
    """The router's process (the ingress deployment) loads mmengine.ray.serve and keys requests with the server's
    protocol models: neither pulls in torch, transformers or the model code, which only the engine replicas need.
    Read in the live router's process, after it has keyed and forwarded a chat (no interpreter of the test's own)."""
    from mmengine.ray.serve import _request_key

    assert _request_key("chat", b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}').startswith("prefix:")
    client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                   temperature=0)
    names = ("torch", "transformers", "mmengine.engine.mm_engine", "mmengine.ray.serve", "mmengine.entrypoints.protocol")
    imported = _in_replica("mmengine-router", lambda: sorted(name for name in names if name in __import__("sys").modules))
    # the router's own modules are there (the probe reads the process that keyed the chat); the engine's are not
    assert imported == ["mmengine.entrypoints.protocol", "mmengine.ray.serve"], imported


def test_deleting_the_app_ends_its_encoder_store(base_url):
    """The last test on the module's app: deleting it (as serve.shutdown and a redeploy do) ends the replicas' encoder
    store, a detached actor that outlives any one replica. Before the router ended it, it stayed on the cluster: a
    process left per app."""
    def stores() -> list[str]:
        return [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
                if actor["name"].startswith("mmengine-encoder-store-")]

    assert len(stores()) == 1  # the app's, which its replicas made (the module's earlier tests used it)
    serve.delete("mmengine")
    assert wait_until(lambda: stores() == [], 60)


@pytest.mark.parametrize(("engine_options", "gpus"), [
    ({"device": "cpu"}, 0),
    ({"device": "cuda"}, 1),
    ({"device": "cuda:0", "tensor_parallel_size": 2}, 2),  # the ranks it spawns see the replica's GPUs
    ({"device": "cuda", "tensor_parallel_size": 4, "distributed_executor_backend": "ray"}, 0),  # ranks with bundles of their own
    ({"device": "cpu", "tensor_parallel_size": 2}, 0),
])
def test_a_replica_takes_the_gpus_its_ranks_need_and_no_more(engine_options, gpus):
    from mmengine.ray.serve import _default_num_gpus

    assert _default_num_gpus(engine_options) == gpus
