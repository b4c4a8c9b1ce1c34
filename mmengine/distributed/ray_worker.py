"""One tensor-parallel rank as a Ray actor: the worker loop's pieces (worker_loop.py) without the pipes.

```
driver (ray_executor.py)                          RankActor (one per placement-group bundle)
place()                                      -->  where it runs: machine, GPUs, pid
rendezvous()                       (rank 0)  -->  a free TCP port on its machine: the group's address
start(init, factory, threads, devices)       -->  start_worker: join the group, build the worker; (READY, rank, pid)
run(data)      the message pickled once     -->  run_message: (OK, result), an error_reply, or None (a step on
               (a large one in the object store)   a rank other than 0)
watch()        its own concurrency group     -->  returns only at stop(): while it waits, a death shows on it
stop()                                       -->  close_worker
```

Ray runs an actor's calls in the order they were sent (one at a time in the default concurrency group), so steps
sent ahead (async scheduling) run in order; `watch` sits in a group of its own and never holds them up.
"""

from __future__ import annotations

import os
import pickle
import threading
from typing import Any

import ray

from mmengine.distributed.process_group import DistributedInit, free_tcp_address
from mmengine.distributed.ray_placement import RankPlace
from mmengine.distributed.worker_loop import OK, READY, WorkerFactory, close_worker, error_reply, run_message, start_worker


class RankActor:
    """The body of a rank's actor (made a Ray actor class by `ray_executor.rank_actor_class`)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.worker: Any = None
        self.stopped = threading.Event()

    def place(self) -> tuple[str, RankPlace]:
        context = ray.get_runtime_context()
        gpus = tuple(str(gpu) for gpu in context.get_accelerator_ids().get("GPU", []))
        return OK, RankPlace(context.get_actor_id(), context.get_node_id(), ray.util.get_node_ip_address(), gpus, os.getpid())

    def rendezvous(self) -> tuple[str, str]:
        return OK, free_tcp_address(ray.util.get_node_ip_address())

    def start(self, init: DistributedInit, factory: WorkerFactory, torch_threads: int | None,
              visible_devices: str | None) -> tuple[Any, ...]:
        if visible_devices is not None:  # before CUDA starts in this process (rank_devices)
            os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
        try:
            self.worker = start_worker(init, factory, torch_threads)
        except BaseException as err:  # noqa: BLE001 - reported to the driver, which raises it
            return error_reply(self.rank, err)
        return READY, self.rank, os.getpid()

    def run(self, data: bytes) -> tuple[Any, ...] | None:
        """One message, pickled once by the driver (its bytes in the call, or in the object store for a large one)."""
        return run_message(self.worker, self.rank, pickle.loads(data))

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        self.stopped.wait()

    def stop(self) -> None:
        try:
            if self.worker is not None:
                close_worker(self.worker)
                self.worker = None
        finally:
            self.stopped.set()
