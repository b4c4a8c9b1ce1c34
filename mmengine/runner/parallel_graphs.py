"""The driver's view of the ranks' CUDA graphs at tensor_parallel_size > 1.

Every rank captures the same graphs in the same order (`DecodeGraphs.capture_order`, planned from the config): a
graph's collectives pair with the same graph's on the other ranks. The driver compares the ranks' orders before
any capture. A step replays or runs eager by the same rule on every rank (`ModelRunner._graph_size_for` and
`InputBuffers.prepare`), a function of the step's plan alone (its rows, drafts, items and adapter slots) and of
the captured buckets, so no rank replays while another runs eager. Rank 0's replay counts come back with each
step's result; `RemoteGraphs` keeps them where a single-process engine keeps its own (`runner.decode_graphs`).
"""

from __future__ import annotations

from mmengine.errors import CudaGraphCaptureError
from mmengine.runner.cuda_graphs import ReplayCounts

CaptureOrder = list[tuple[str, int, bool, bool]]  # (kind, size, cascade, lora) per graph


def check_same_capture_orders(orders: list[CaptureOrder]) -> None:
    """Every rank must record the same graphs in the same order, else their collectives would not pair up."""
    for rank, order in enumerate(orders[1:], start=1):
        if order != orders[0]:
            raise CudaGraphCaptureError(f"tensor-parallel rank {rank} plans other CUDA graphs than rank 0 ({order} against "
                                        f"{orders[0]}); pass enforce_eager=True to run without CUDA graphs")


class RemoteGraphs:
    """Rank 0's graphs as the driver sees them: the buckets captured and the replays counted so far (the
    attributes of a DecodeGraphs that the engine's stats and tests read)."""

    def __init__(self, order: CaptureOrder, verify_query_len: int) -> None:
        decodes = [(size, cascade, lora) for kind, size, cascade, lora in order if kind == "decode"]
        self.sizes = sorted({size for size, _, _ in decodes})
        self.cascade_sizes = sorted(size for size, cascade, _ in decodes if cascade)
        self.lora_sizes = sorted(size for size, _, lora in decodes if lora)
        self.verify_sizes = sorted(size for kind, size, _, _ in order if kind == "verify")
        self.verify_query_len = verify_query_len
        self.update(ReplayCounts())

    def update(self, counts: ReplayCounts) -> None:
        self.num_replays = counts.num_replays
        self.num_cascade_replays = counts.num_cascade_replays
        self.num_lora_replays = counts.num_lora_replays
        self.num_verify_replays = counts.num_verify_replays
