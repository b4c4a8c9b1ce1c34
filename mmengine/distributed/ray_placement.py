"""Where the Ray backend's ranks run: the Ray cluster (joined, or started), one placement-group bundle per rank,
and which GPUs each rank's process sees.

- Ray: a process already connected (a data-parallel replica is a Ray actor; or the caller ran `ray.init`) uses its
  cluster. Otherwise `ray.init()` joins the cluster at RAY_ADDRESS, or the one `ray start` started on this machine,
  or starts one here; the last engine to shut down disconnects again (stopping a cluster it started).
- Bundles: {"GPU": 1, "CPU": 1} per rank on CUDA, {"CPU": 1} on CPU, PACK by default: the ranks on as few machines
  as hold them, so one machine first and several only when one has too few GPUs. Bundle i holds rank i, and rank
  0's machine is the group's rendezvous.
- GPUs: Ray shows an actor only its own GPU. Ranks on one machine are shown all of that machine's ranks' GPUs
  (in rank order) and each takes its own by index (vLLM does the same), so NCCL can reach its peers directly
  (peer to peer, NVLink) instead of through host memory.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from mmengine.errors import ConfigError

logger = logging.getLogger(__name__)

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class RankPlace:
    """Where one rank's actor runs (plain data: the actor reports it)."""

    actor_id: str
    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]  # Ray's accelerator ids of the actor's GPUs (its machine's numbering)
    pid: int


@dataclass(frozen=True)
class RankDevices:
    """What a rank's process is shown and which of it is its own."""

    visible_devices: str | None  # CUDA_VISIBLE_DEVICES for the process (None: left as Ray set it)
    local_rank: int  # the rank's index among its machine's ranks (its GPU: cuda:local_rank)


def import_ray(option: str) -> ModuleType:
    """Ray, or a ConfigError naming `option` when the `ray` extra is not installed."""
    try:
        import ray
    except ImportError as err:
        raise ConfigError(f"{option} needs Ray, which is not installed: pip install 'mmengine-vlm[ray]'") from err
    return ray


class RayConnection:
    """This process's use of Ray by the engines' executors: the first one joins (or starts) Ray unless the process
    is connected already, and the last one to leave disconnects again (stopping a cluster it started), so Ray is
    left as the caller had it."""

    lock = threading.Lock()
    users = 0
    connected_here = False

    @classmethod
    def acquire(cls, ray: ModuleType) -> None:
        with cls.lock:
            if cls.users == 0 and not ray.is_initialized():
                context = ray.init(configure_logging=False)
                cls.connected_here = True
                logger.info("Ray backend: connected to the Ray cluster at %s", context.address_info.get("gcs_address"))
            cls.users += 1

    @classmethod
    def release(cls, ray: ModuleType) -> None:
        with cls.lock:
            cls.users = max(0, cls.users - 1)
            if cls.users == 0 and cls.connected_here:
                cls.connected_here = False
                ray.shutdown()


def rank_bundles(tensor_parallel_size: int, device: str) -> list[dict[str, float]]:
    """One bundle per rank: a GPU (and a CPU for its loop) on CUDA, a CPU otherwise."""
    bundle = {"GPU": 1.0, "CPU": 1.0} if device == "cuda" else {"CPU": 1.0}
    return [dict(bundle) for _ in range(tensor_parallel_size)]


def check_room(ray: ModuleType, bundles: list[dict[str, float]], option: str) -> None:
    """A ConfigError when the whole cluster has fewer of a resource than the bundles ask for (waiting would not help)."""
    total = ray.cluster_resources()
    for resource in sorted({name for bundle in bundles for name in bundle}):
        wanted = sum(bundle.get(resource, 0.0) for bundle in bundles)
        if total.get(resource, 0.0) < wanted:
            raise ConfigError(f"{option}: {len(bundles)} ranks need {wanted:g} {resource} in all (one bundle of {bundles[0]} "
                              f"each), and the Ray cluster has {total.get(resource, 0.0):g}")


def create_placement_group(ray: ModuleType, bundles: list[dict[str, float]], strategy: str, timeout_s: float,
                           option: str) -> Any:
    """The ranks' placement group, once Ray has reserved every bundle; a ConfigError if it cannot within `timeout_s`
    (the group is removed again)."""
    from ray.util.placement_group import placement_group, remove_placement_group

    if strategy not in STRATEGIES:
        raise ConfigError(f"{option}: placement strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    check_room(ray, bundles, option)
    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise ConfigError(f"{option}: Ray could not place {len(bundles)} bundles of {bundles[0]} ({strategy}) within "
                          f"{timeout_s:.0f} s; the cluster's free resources: {ray.available_resources()}")
    return group


def rank_devices(places: list[RankPlace]) -> list[RankDevices]:
    """Each rank's devices: on a machine with GPUs, every rank there is shown the GPUs of all its ranks (in rank
    order) and takes its own by index; without GPUs, its index among the machine's ranks."""
    on_node: dict[str, list[int]] = {}
    for rank, place in enumerate(places):
        on_node.setdefault(place.node_id, []).append(rank)
    out = []
    for rank, place in enumerate(places):
        ranks = on_node[place.node_id]
        if not place.gpu_ids:
            out.append(RankDevices(None, ranks.index(rank)))
            continue
        gpus = list(dict.fromkeys(gpu for other in ranks for gpu in places[other].gpu_ids))
        out.append(RankDevices(",".join(gpus), gpus.index(place.gpu_ids[0])))
    return out
