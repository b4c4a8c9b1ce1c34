"""The driver's side of tensor parallelism on Ray (`distributed_executor_backend="ray"`): one Ray actor per rank,
placed by a placement group (ray_placement.py), driven as the worker processes are (executor_base.Executor: one
plan to every rank, one reply from rank 0, steps sent ahead of their replies).

```
driver                                            RankActor x tp (ray_worker.py), one bundle each
submit(plan) --pickled once, run(bytes)-------->  worker.execute_step(plan), collectives among the ranks
collect()    <--rank 0's reply (each rank's call's result is watched for an error)
call(m, ...) --(CALL, m, args) to every rank-->   worker.m(...)
```

Failure and lifetime:
- While a call waits, the driver waits on the replies and on every actor's `watch` call at once: an actor that
  dies (its process killed, `ray.kill`, its machine gone) fails them within Ray's notice of the death (tens of
  milliseconds on one machine), and it becomes `EngineDeadError` naming the rank, for the call in progress and
  every later call; the other actors are killed. A watcher thread notices a death between steps.
- A worker that raises replies with its traceback: `WorkerError`. After a failed collective, the driver waits up
  to `death_grace_s` for a peer's death, the cause, as the process backend does.
- `shutdown()` (also when the executor is collected) asks every actor to stop, kills them, removes the placement
  group, and disconnects from Ray if the engine connected (ray_placement.RayConnection). Actors are owned by
  the driver: Ray ends them when the driver's process dies.
"""

from __future__ import annotations

import pickle
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from mmengine.distributed.executor_base import Executor, worker_error
from mmengine.distributed.process_group import DistributedInit
from mmengine.distributed.ray_placement import (
    RankPlace,
    RayConnection,
    create_placement_group,
    import_ray,
    rank_bundles,
    rank_devices,
)
from mmengine.distributed.worker_loop import ERROR, OK, WorkerFactory
from mmengine.errors import EngineDeadError

OPTION = "distributed_executor_backend='ray'"
# A message this small rides in the actor calls themselves (below Ray's own 100 KiB limit for arguments passed inline)
INLINE_BYTES = 64 * 1024


def rank_actor_class(ray: Any) -> Any:
    from mmengine.distributed.ray_worker import RankActor

    return ray.remote(concurrency_groups={"watch": 1})(RankActor)


def death_reason(error: BaseException) -> str:
    """Ray's reason for an actor's death, in a few words ("its worker process has died", "it was killed by
    `ray.kill`"), else the error's type."""
    for line in str(error).splitlines():
        line = line.strip()
        if line.startswith("The actor is dead because "):
            return line.removeprefix("The actor is dead because ").split(". ")[0].rstrip(".")
    return type(error).__name__


class RayRanks:
    """The ranks' actors, their `watch` calls (a death's sentinel), their placement group, and their stopping.
    `stop` is the executor's finalizer: it holds no executor, so an executor nobody shut down is still collected,
    and its actors stopped."""

    def __init__(self, ray: Any) -> None:
        self.ray = ray
        self.actors: list[Any] = []
        self.sentinels: dict[Any, int] = {}  # each actor's watch() call -> its rank
        self.places: list[RankPlace] = []
        self.placement_group: Any = None
        self.stopping = threading.Event()  # set first: deaths after it are the stop's, not failures
        self.watcher: threading.Thread | None = None
        self.stop_lock = threading.Lock()
        self.stopped = False

    def describe_death(self, rank: int, error: BaseException | None = None) -> str:
        if error is None:
            sentinel = next(ref for ref, r in self.sentinels.items() if r == rank)
            try:
                self.ray.get(sentinel, timeout=5.0)
            except Exception as err:  # noqa: BLE001 - the death's own words
                error = err
        where = ""
        if rank < len(self.places):
            place = self.places[rank]
            where = f" (Ray actor {place.actor_id}, pid {place.pid} on {place.node_ip})"
        reason = death_reason(error) if error is not None else "it stopped"
        return f"tensor-parallel worker rank {rank}{where} died ({reason})"

    def release(self) -> None:
        """Kills every actor at once, even one inside a collective."""
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass

    def stop(self, timeout_s: float = 5.0) -> None:
        """Asks every actor to stop (its worker's close()), kills them, removes the placement group. Runs once."""
        with self.stop_lock:  # the finalizer and the connection's finalizer may both call it
            if self.stopped:
                return
            self.stopped = True
        self.stopping.set()
        if self.ray.is_initialized():
            asked = []
            for actor in self.actors:
                try:
                    asked.append(actor.stop.remote())
                except Exception:  # noqa: BLE001 - a dead actor
                    pass
            if asked:
                self.ray.wait(asked, num_returns=len(asked), timeout=timeout_s)
            self.release()
            if self.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self.placement_group)
                except Exception:  # noqa: BLE001 - removed already
                    pass
        if self.watcher is not None and threading.current_thread() is not self.watcher:
            self.watcher.join(timeout=timeout_s)


def watch(ranks: RayRanks, report: weakref.WeakMethod) -> None:
    """A thread: an actor that dies while no call waits (between steps) ends the executor all the same."""
    try:
        ready, _ = ranks.ray.wait(list(ranks.sentinels), num_returns=1)
    except Exception:  # noqa: BLE001 - Ray is gone: so are the actors, and the executor is stopping
        return
    mark_dead = report()
    if ready and not ranks.stopping.is_set() and mark_dead is not None:
        mark_dead(EngineDeadError(ranks.describe_death(ranks.sentinels[ready[0]])))


def stop_and_disconnect(ranks: RayRanks) -> None:
    """The end of an executor nobody shut down: its actors stopped, its use of Ray given back."""
    ranks.stop()
    RayConnection.release(ranks.ray)


class RayExecutor(Executor):
    """Starts `tensor_parallel_size` Ray actors, each `worker_factory(its TensorParallelGroup)`, one per bundle
    of a placement group (`placement_strategy`, PACK by default), joined by torch.distributed at a free port of
    rank 0's machine (gloo on CPU, NCCL on CUDA), and drives them like MultiprocExecutor."""

    def __init__(self, worker_factory: WorkerFactory, tensor_parallel_size: int, *, device: str = "cpu",
                 backend: str | None = None, torch_threads: int | None = None, placement_strategy: str = "PACK",
                 start_timeout_s: float = 300.0, placement_timeout_s: float = 120.0, death_grace_s: float = 2.0,
                 on_death: Callable[[EngineDeadError], None] | None = None) -> None:
        super().__init__(tensor_parallel_size, death_grace_s, on_death)
        ray = import_ray(OPTION)
        self.ray = ray
        self.ranks = RayRanks(ray)
        self.finalizer = weakref.finalize(self, self.ranks.stop)
        RayConnection.acquire(ray)
        self.connection = weakref.finalize(self, stop_and_disconnect, self.ranks)
        self.in_flight: deque[dict[int, Any]] = deque()  # each message sent: its call on each rank, by rank
        self.unread: dict[Any, int] = {}  # calls whose replies no caller reads (steps on ranks 1..): watched for errors
        try:
            self.ranks.placement_group = create_placement_group(ray, rank_bundles(tensor_parallel_size, device),
                                                                placement_strategy, placement_timeout_s, OPTION)
            self.start_actors(device)
            places = self.await_all(self.message_to_each("place"), start_timeout_s)
            self.ranks.places = [places[rank] for rank in range(tensor_parallel_size)]
            self.pids: list[int] = [place.pid for place in self.ranks.places]
            address = self.await_all({0: self.ranks.actors[0].rendezvous.remote()}, start_timeout_s)[0]
            factory = ray.put(worker_factory)  # once, for every rank
            devices = rank_devices(self.ranks.places)
            self.in_flight.append({
                rank: actor.start.remote(DistributedInit(tensor_parallel_size, rank, address, device=device, backend=backend,
                                                         local_rank=devices[rank].local_rank),
                                         factory, torch_threads, devices[rank].visible_devices)
                for rank, actor in enumerate(self.ranks.actors)
            })
            self.await_start(start_timeout_s)
        except BaseException:
            self.finalizer()
            self.disconnect()
            raise
        self.watcher = self.ranks.watcher = threading.Thread(
            target=watch, args=(self.ranks, weakref.WeakMethod(self.mark_dead)), name="mmengine-tp-ray-watcher", daemon=True)
        self.watcher.start()

    def start_actors(self, device: str) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor_class = rank_actor_class(self.ray)
        resources = {"num_gpus": 1, "num_cpus": 1} if device == "cuda" else {"num_cpus": 1}
        for rank in range(self.tensor_parallel_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.ranks.placement_group,
                                                        placement_group_bundle_index=rank)
            actor = actor_class.options(scheduling_strategy=strategy, max_restarts=0, **resources).remote(rank)
            self.ranks.actors.append(actor)
            self.ranks.sentinels[actor.watch.remote()] = rank

    def message_to_each(self, method: str) -> dict[int, Any]:
        return {rank: getattr(actor, method).remote() for rank, actor in enumerate(self.ranks.actors)}

    def await_all(self, calls: dict[int, Any], timeout_s: float) -> dict[int, Any]:
        self.in_flight.append(calls)
        return self.await_replies(list(calls), timeout_s=timeout_s)

    # -- the transport ----------------------------------------------------------------------------------------

    def encode(self, message: tuple[Any, ...]) -> Any:
        """The message pickled once: small, the bytes ride in each rank's call (Ray's object store would cost more
        than the copies); large (a plan with pictures), put once into the object store, which every rank reads."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        return data if len(data) < INLINE_BYTES else self.ray.put(data)

    def send(self, payload: Any) -> None:
        self.in_flight.append({rank: actor.run.remote(payload) for rank, actor in enumerate(self.ranks.actors)})

    def await_replies(self, ranks: Iterable[int], kind: str = OK, timeout_s: float | None = None) -> dict[int, Any]:
        calls = self.in_flight.popleft()
        wanted = set(ranks)
        pending = {ref: rank for rank, ref in calls.items() if rank in wanted}
        self.unread.update({ref: rank for rank, ref in calls.items() if rank not in wanted})
        results: dict[int, Any] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                # the unread first: ray.wait names the ready ones in this order, so each is read (and let go) as soon
                # as it is ready, before the awaited reply ends the wait
                ready, _ = self.ray.wait([*self.unread, *pending, *self.ranks.sentinels], num_returns=1, timeout=remaining)
            except Exception as err:  # noqa: BLE001 - Ray itself went away (a shutdown from another thread)
                self.fail(EngineDeadError(f"the tensor-parallel executor lost Ray ({type(err).__name__}: {err})"))
            if not ready:
                self.fail(EngineDeadError(f"tensor-parallel workers {sorted(pending.values())} did not answer within {timeout_s:.0f} s"))
            ref = ready[0]
            if ref in self.ranks.sentinels:
                self.fail(EngineDeadError(self.ranks.describe_death(self.ranks.sentinels[ref])))
            awaited = ref in pending
            rank = pending.pop(ref) if awaited else self.unread.pop(ref)
            reply = self.reply_of(ref, rank)
            if reply is not None and reply[0] == ERROR:  # after a failed collective, a peer's death is the cause to report
                self.fail(self.first_death(self.death_grace_s if reply[-1] else 0.05) or worker_error(reply))
            if awaited:
                if reply is None or reply[0] != kind:
                    self.fail(EngineDeadError(f"tensor-parallel worker rank {rank} answered {reply!r:.80} where {kind!r} was due"))
                results[rank] = reply[-1]
        return results

    def reply_of(self, ref: Any, rank: int) -> Any:
        """The call's return value; a dead actor (or a reply Ray cannot bring back) ends the executor."""
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayActorError as err:
            self.fail(self.first_death(self.death_grace_s) or EngineDeadError(self.ranks.describe_death(rank, err)))
        except Exception as err:  # noqa: BLE001 - an object lost with its machine, a reply that does not unpickle
            self.fail(EngineDeadError(f"tensor-parallel worker rank {rank}'s reply could not be read: {type(err).__name__}: {err}"))

    def first_death(self, grace_s: float) -> EngineDeadError | None:
        if not self.ranks.sentinels:
            return None
        try:
            ready, _ = self.ray.wait(list(self.ranks.sentinels), num_returns=1, timeout=grace_s)
        except Exception as err:  # noqa: BLE001 - Ray itself went away
            return EngineDeadError(f"the tensor-parallel executor lost Ray ({type(err).__name__}: {err})")
        return EngineDeadError(self.ranks.describe_death(self.ranks.sentinels[ready[0]])) if ready else None

    def release(self) -> None:
        self.ranks.release()

    def stop(self) -> None:
        self.finalizer()

    def shutdown(self) -> None:
        super().shutdown()
        idle = self.lock.acquire(timeout=10.0)  # a call in flight ends once its actors are gone: then Ray may go
        try:
            self.disconnect()
        finally:
            if idle:
                self.lock.release()

    def disconnect(self) -> None:
        """Gives back this executor's use of Ray (once): the last user disconnects (ray_placement.RayConnection)."""
        self.connection()
