"""Cache-aware routing without Ray: the consistent hash ring (stable, balanced), the least-loaded
fallback past the queue bound, request keys (the first picture by content, else the leading turns),
and merging the replicas' /metrics."""

from __future__ import annotations

import collections

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import data_url, image_part, parse_metrics

from mmengine.errors import ConfigError
from mmengine.ray.metrics_merge import merge_replica_metrics
from mmengine.ray.routing import HashRing, Router, chat_request_key, completion_request_key
from mmengine.testing import make_test_image

KEYS = [f"image:{i:04d}" for i in range(4000)]


def test_the_ring_is_deterministic_and_balanced():
    ring = HashRing(4)
    owners = [ring.lookup(key) for key in KEYS]
    again = HashRing(4)  # built anew, as each process builds its own
    assert owners == [again.lookup(key) for key in KEYS]  # the same in every process
    counts = collections.Counter(owners)
    assert sorted(counts) == [0, 1, 2, 3]
    assert all(0.15 * len(KEYS) < count < 0.35 * len(KEYS) for count in counts.values()), counts


def test_adding_a_replica_moves_only_keys_to_it():
    before, after = HashRing(4), HashRing(5)
    moved = [key for key in KEYS if before.lookup(key) != after.lookup(key)]
    assert all(after.lookup(key) == 4 for key in moved)  # nothing is shuffled between the old replicas
    assert 0.1 * len(KEYS) < len(moved) < 0.3 * len(KEYS)  # about 1/5 of the keys


def test_the_preferred_replica_is_kept_until_it_is_saturated():
    router = Router(3, max_ongoing_requests=4)
    key = KEYS[0]
    home = router.ring.lookup(key)
    busy = [0, 0, 0]
    busy[home] = 3  # below the bound: affinity wins even though the others are idle
    assert router.route(key, busy).replica == home and router.route(key, busy).reason == "affinity"
    loads = [2, 2, 2]
    loads[home] = 4  # at the bound: the least loaded takes it
    others = [replica for replica in range(3) if replica != home]
    loads[others[1]] = 1
    route = router.route(key, loads)
    assert route.replica == others[1] and route.reason == "fallback"


def test_when_every_replica_is_saturated_the_least_loaded_one_answers():
    router = Router(3, max_ongoing_requests=2)
    key = KEYS[1]
    home = router.ring.lookup(key)
    loads = [5, 5, 5]
    assert router.route(key, loads).replica == home  # a tie keeps the key's own replica
    loads[(home + 1) % 3] = 3
    assert router.route(key, loads).replica == (home + 1) % 3


def test_hot_keys_spread_by_fallback_and_balance_holds_under_load():
    router = Router(4, max_ongoing_requests=2)
    loads = [0, 0, 0, 0]
    for _ in range(8):  # 8 concurrent requests of one key: 2 on its replica, then spread by load
        loads[router.route(KEYS[2], loads).replica] += 1
    assert loads == [2, 2, 2, 2]


def test_bad_router_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="num_replicas"):
        HashRing(0)
    with pytest.raises(ConfigError, match="max_ongoing_requests"):
        Router(2, max_ongoing_requests=0)
    with pytest.raises(ValueError, match="expected 2 loads"):
        Router(2, 1).route("k", [0])


def _chat(url: str | None, *turns: str) -> list[dict]:
    first = [{"type": "text", "text": turns[0]}] if url is None else [image_part(url), {"type": "text", "text": turns[0]}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": first}]
    for index, text in enumerate(turns[1:]):
        messages.append({"role": "assistant" if index % 2 == 0 else "user", "content": text})
    return messages


def test_a_chat_is_keyed_by_its_first_picture_by_content():
    picture, other = make_test_image(1), make_test_image(2)
    key = chat_request_key(_chat(data_url(picture), "What is it?"))
    assert key.startswith("image:")
    assert chat_request_key(_chat(data_url(picture), "What is it?", "A cat.", "Colour?")) == key  # later turns
    assert chat_request_key(_chat(data_url(picture), "A different question")) == key  # the picture decides
    assert chat_request_key(_chat(data_url(other), "What is it?")) != key
    assert chat_request_key(_chat(data_url(picture), "What is it?"), cache_salt="alice") != key  # salts share nothing
    assert chat_request_key(_chat(data_url(picture), "x"), mm_uuids=["pic-1"]) == chat_request_key(
        _chat(data_url(other), "y"), mm_uuids=["pic-1"])  # an mm_uuid stands for the picture, as in the engine


def test_a_chat_without_pictures_is_keyed_by_its_leading_turns():
    key = chat_request_key(_chat(None, "Tell me a story."))
    assert key.startswith("prefix:")
    assert chat_request_key(_chat(None, "Tell me a story.", "Once upon a time.", "Go on.")) == key
    assert chat_request_key(_chat(None, "Tell me a joke.")) != key
    assert chat_request_key(_chat("data:image/png;base64,!!!", "x")).startswith("image:")  # bad base64 still gets a key


def test_completions_are_keyed_by_their_leading_characters():
    shared = "SYSTEM: " + "You are a careful assistant. " * 30
    assert completion_request_key(shared + "Q1") == completion_request_key(shared + "Q2")
    assert completion_request_key("short one") != completion_request_key("short two")


def _replica_text(encoder_runs: int, free_blocks: int, latency: float) -> str:
    registry = CollectorRegistry()
    Counter("mmengine_encoder_runs", "runs", registry=registry).inc(encoder_runs)
    Gauge("mmengine_kv_blocks_free", "free", registry=registry).set(free_blocks)
    Histogram("mmengine_e2e_request_latency_seconds", "e2e", buckets=(0.5, 1.0), registry=registry).observe(latency)
    return generate_latest(registry).decode()


def test_replica_metrics_merge_into_sums_and_per_replica_samples():
    merged = merge_replica_metrics([_replica_text(1, 10, 0.2), _replica_text(0, 7, 0.8)])
    samples = parse_metrics(merged)
    assert samples["mmengine_encoder_runs_total"] == 1
    assert samples['mmengine_encoder_runs_total{replica="0"}'] == 1 and samples['mmengine_encoder_runs_total{replica="1"}'] == 0
    assert samples["mmengine_kv_blocks_free"] == 17 and samples['mmengine_kv_blocks_free{replica="1"}'] == 7
    assert samples['mmengine_e2e_request_latency_seconds_bucket{le="0.5"}'] == 1
    assert samples["mmengine_e2e_request_latency_seconds_count"] == 2
    assert samples['mmengine_e2e_request_latency_seconds_bucket{le="1.0",replica="1"}'] == 1
    assert "_created" not in merged
    assert merged.count("# TYPE mmengine_encoder_runs counter") == 1  # one family each
    families = {family.name: family for family in text_string_to_metric_families(merged)}  # valid exposition text
    assert families["mmengine_e2e_request_latency_seconds"].type == "histogram"


def test_a_picture_keys_alike_online_and_offline():
    """The router's key for a data: URL equals the offline placement key of the same encoded bytes."""
    import base64
    import io

    from mmengine.ray.keys import image_key
    from mmengine.ray.routing import image_url_key
    from mmengine.testing import make_test_image

    buffer = io.BytesIO()
    make_test_image(7).save(buffer, "PNG")
    data = buffer.getvalue()
    assert image_url_key("data:image/png;base64," + base64.b64encode(data).decode()) == image_key(data)


def test_an_adapter_is_part_of_the_routing_key():
    from mmengine.ray.routing import with_adapter

    pytest.importorskip("ray.serve", reason="the ray extra is not installed")
    from mmengine.ray.serve import _request_key

    assert with_adapter("image:abc", None) == "image:abc" and with_adapter(None, None) is None
    assert with_adapter("image:abc", "ocr") == "lora:ocr|image:abc" and with_adapter(None, "ocr") == "lora:ocr"
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}'
    base = _request_key("chat", body % b"base", base_model="base")
    assert base == _request_key("chat", body % b"base")  # the base model keys as before
    assert _request_key("chat", body % b"ocr", base_model="base") == "lora:ocr|" + base
