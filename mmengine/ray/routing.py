"""Cache-aware routing for data-parallel serving: which engine replica should answer a request.

A request's *key* names the cached state it most likely shares with earlier requests: its first
image (by content, or by the `mm_uuids` id that replaces the content hash), else the leading text
of its conversation (the system prompt and first user turn every later turn repeats). A consistent
hash ring maps keys to replicas, so a conversation and every request about the same picture land on
the replica that already holds its encoder output and KV blocks, and adding a replica moves only
about 1/N of the keys. A preferred replica with `max_ongoing_requests` in flight is saturated: the
request then goes to the least-loaded replica instead (it pays one encoder run there, rather than
queueing behind a hot key).

Pure Python, no Ray: the Serve ingress owns one Router and feeds it its own in-flight counts.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mmengine.encoder_cache.hashing import hash_bytes
from mmengine.errors import ConfigError
from mmengine.multimodal.media_urls import part_url

DEFAULT_VIRTUAL_NODES = 128
IMAGE_KEY_HASH = "xxh3_128"  # as mmengine.ray.keys.image_key, so a picture keys alike offline and online
DEFAULT_PREFIX_CHARS = 512  # leading prompt characters a completion's key covers


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class HashRing:
    """A consistent hash ring of replicas 0..N-1, each placed at `virtual_nodes` points."""

    def __init__(self, num_replicas: int, virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ConfigError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
        if not isinstance(virtual_nodes, int) or virtual_nodes < 1:
            raise ConfigError(f"virtual_nodes must be an int >= 1, got {virtual_nodes!r}")
        self.num_replicas = num_replicas
        points = sorted(
            (_hash64(f"replica-{replica}#{node}".encode()), replica)
            for replica in range(num_replicas)
            for node in range(virtual_nodes)
        )
        self._points = [point for point, _ in points]
        self._owners = [owner for _, owner in points]

    def lookup(self, key: str) -> int:
        """The replica owning `key`: the first ring point clockwise from the key's hash."""
        index = bisect.bisect_left(self._points, _hash64(key.encode()))
        return self._owners[index % len(self._points)]


@dataclass(frozen=True)
class Route:
    replica: int
    reason: str  # "affinity": the key's own replica; "fallback": it was saturated, so the least loaded


class Router:
    """Consistent hashing on the request key, with a least-loaded fallback past a queue bound."""

    def __init__(self, num_replicas: int, max_ongoing_requests: int, virtual_nodes: int = DEFAULT_VIRTUAL_NODES) -> None:
        if not isinstance(max_ongoing_requests, int) or max_ongoing_requests < 1:
            raise ConfigError(f"max_ongoing_requests must be an int >= 1, got {max_ongoing_requests!r}")
        self.ring = HashRing(num_replicas, virtual_nodes)
        self.max_ongoing_requests = max_ongoing_requests

    @property
    def num_replicas(self) -> int:
        return self.ring.num_replicas

    def route(self, key: str, loads: Sequence[int]) -> Route:
        """`loads[i]`: requests replica i is answering now."""
        if len(loads) != self.num_replicas:
            raise ValueError(f"expected {self.num_replicas} loads, got {len(loads)}")
        preferred = self.ring.lookup(key)
        if loads[preferred] < self.max_ongoing_requests:
            return Route(preferred, "affinity")
        least = min(range(self.num_replicas), key=lambda replica: (loads[replica], replica != preferred, replica))
        return Route(least, "affinity" if least == preferred else "fallback")


# -- request keys ------------------------------------------------------------------------------


def image_url_key(url: str) -> str:
    """A key for one image URL: a data: URL by the content hash of its decoded bytes (so the same
    picture sent twice gets the same key, and the key `mmengine.ray.keys.image_key` gives those
    bytes offline), any other URL (file://, http) by its text."""
    if url[:5].lower() == "data:":
        _, _, payload = url.partition(",")
        try:
            content = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            content = payload.encode()  # the replica rejects it with a clear error; any key will do
        return "image:" + hash_bytes(content, IMAGE_KEY_HASH)
    return "image-url:" + hashlib.sha256(url.encode()).hexdigest()


def _first_image_url(messages: list[Any]) -> str | None:
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url" and (url := part_url(part)) is not None:
                return url
    return None


def _leading_turns(messages: list[Any]) -> list[Any]:
    """The messages up to and including the first user message: what every later turn repeats."""
    leading = []
    for message in messages:
        leading.append(message)
        if isinstance(message, dict) and message.get("role") == "user":
            break
    return leading


def chat_request_key(messages: list[Any], mm_uuids: Sequence[str | None] | None = None, cache_salt: str | None = None) -> str:
    """The routing key of a chat: its first image (its mm_uuid if given, else its content), else a hash
    of its leading turns. Requests under different cache salts share no cache, so the salt is part of it."""
    salt = f"salt:{cache_salt}|" if cache_salt is not None else ""
    if mm_uuids and mm_uuids[0] is not None:
        return f"{salt}uuid:{mm_uuids[0]}"
    url = _first_image_url(messages)
    if url is not None:
        return salt + image_url_key(url)
    leading = json.dumps(_leading_turns(messages), sort_keys=True, ensure_ascii=False, default=str)
    return salt + "prefix:" + hashlib.sha256(leading.encode()).hexdigest()


def with_adapter(key: str | None, lora: str | None) -> str | None:
    """A sharing key for a request under a LoRA adapter: its KV blocks are the adapter's own, so its
    key (None: the request has none) becomes the adapter's, and an adapter's requests go where its
    weights and prefix blocks already are. The base model's keys are unchanged."""
    if lora is None:
        return key
    return f"lora:{lora}" if key is None else f"lora:{lora}|{key}"


def completion_request_key(prompt: str, cache_salt: str | None = None, prefix_chars: int = DEFAULT_PREFIX_CHARS) -> str:
    """The routing key of a text completion: a hash of the prompt's leading characters."""
    salt = f"salt:{cache_salt}|" if cache_salt is not None else ""
    return salt + "prefix:" + hashlib.sha256(prompt[:prefix_chars].encode()).hexdigest()
