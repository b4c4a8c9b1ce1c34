"""Expert parallelism's combine: one all-reduce of every token's partial sums, or an all-to-all dispatch.

    python benchmarks/expert_parallel.py                      # 2 gloo ranks on CPU, one thread each
    python benchmarks/expert_parallel.py --tokens 1,64,512 --hidden 2048 --inter 768 --experts 16 --top-k 4

With tensor-parallel attention every rank holds every token's hidden state when a MoE layer starts (the
o-projection's all-reduce). Two ways to run the layer with whole experts per rank:

- "all-reduce" (what mmengine runs, distributed/parallel_experts.py): each rank computes, for every token, the pairs
  routed to its experts (the others weigh zero) and one all-reduce of [T, H] sums the ranks' shares.
- "all-to-all": each rank takes its T/N of the tokens, exchanges the pair counts (all-to-all), sends each pair's row
  to its expert's rank (all-to-all), computes what it received, sends the results back (all-to-all), sums each of
  its tokens' pairs, and all-gathers the tokens so that every rank holds them all again for the next attention:
  four collectives where the first makes one, and rows of H travel k times per token instead of once.

Both are checked against the whole layer in one process, then timed (median and min of --repeats, after --warmup)
on the ranks of a MultiprocExecutor: the layer's wall time on rank 0 and, of it, the time inside collectives. JSON goes to
--output.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mmengine.distributed.executor import MultiprocExecutor  # noqa: E402
from mmengine.distributed.parallel_experts import ExpertParallelFusedExperts  # noqa: E402
from mmengine.distributed.process_group import TensorParallelGroup  # noqa: E402
from mmengine.layers.moe import FusedExperts  # noqa: E402


def make_layer(experts: int, hidden: int, inter: int, top_k: int, seed: int = 0) -> FusedExperts:
    gen = torch.Generator().manual_seed(seed)
    layer = FusedExperts(experts, hidden, inter, "silu", top_k)
    with torch.no_grad():
        layer.gate_up_proj.copy_(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5)
        layer.down_proj.copy_(torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5)
    layer.requires_grad_(False)
    return layer


def make_inputs(tokens: int, experts: int, hidden: int, top_k: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1)
    return x, weights / weights.sum(-1, keepdim=True), ids


class Collectives:
    """The group's collectives, timed (seconds spent inside them since the last `take`)."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        self.tp, self.spent = tp, 0.0

    def timed(self, fn, *args, **kwargs):
        started = time.perf_counter()
        out = fn(*args, **kwargs)
        self.spent += time.perf_counter() - started
        return out

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def all_reduce_layer(local: ExpertParallelFusedExperts, comm: Collectives, x, weights, ids) -> torch.Tensor:
    """mmengine's: this rank's experts over every token, then one all-reduce (ExpertParallelFusedExperts.forward)."""
    all_reduce = local.tp.all_reduce
    local.tp.all_reduce = lambda t: comm.timed(all_reduce, t)
    try:
        return local(x, weights, ids)
    finally:
        local.tp.all_reduce = all_reduce


def all_to_all_layer(local: ExpertParallelFusedExperts, comm: Collectives, x, weights, ids) -> torch.Tensor:
    """Dispatch and combine by all-to-all over this rank's T/N tokens, then an all-gather of the tokens."""
    tp, size, per_rank = local.tp, local.tp.size, local.num_experts
    tokens = x.shape[0]
    share = -(-tokens // size)
    mine = slice(tp.rank * share, min(tokens, (tp.rank + 1) * share))
    x_mine, w_mine, ids_mine = x[mine], weights[mine], ids[mine]
    flat_ids = ids_mine.reshape(-1)
    owner = flat_ids // per_rank
    order = torch.argsort(owner, stable=True)  # pairs grouped by the rank of their expert
    send_counts = torch.bincount(owner, minlength=size)
    recv_counts = torch.empty_like(send_counts)
    comm.timed(dist.all_to_all_single, recv_counts, send_counts)
    send_rows = x_mine.repeat_interleave(ids_mine.shape[1], dim=0)[order]
    send_experts = flat_ids[order]
    recv_rows = x.new_empty(int(recv_counts.sum()), x.shape[1])
    recv_experts = flat_ids.new_empty(int(recv_counts.sum()))
    splits_out, splits_in = send_counts.tolist(), recv_counts.tolist()
    comm.timed(dist.all_to_all_single, recv_rows, send_rows.contiguous(), splits_in, splits_out)
    comm.timed(dist.all_to_all_single, recv_experts, send_experts.contiguous(), splits_in, splits_out)
    # each received row through its expert (weight 1: the routing weight is applied where the token lives)
    ones = torch.ones(recv_rows.shape[0], 1, dtype=x.dtype)
    local_ids = (recv_experts - local.held.start)[:, None]
    computed = local.expert_loop(recv_rows, ones, torch.nn.functional.one_hot(local_ids, per_rank))
    back = x.new_empty(send_rows.shape)
    comm.timed(dist.all_to_all_single, back, computed, splits_out, splits_in)
    per_pair = torch.empty_like(back)
    per_pair[order] = back
    out_mine = (per_pair.view(-1, ids_mine.shape[1], x.shape[1]) * w_mine[..., None]).sum(1)
    padded = x.new_zeros(share, x.shape[1])
    padded[: out_mine.shape[0]] = out_mine
    gathered = [torch.empty_like(padded) for _ in range(size)]
    comm.timed(dist.all_gather, gathered, padded)
    return torch.cat(gathered)[:tokens]


class BenchWorker:
    """One rank: its half of the experts; `run(...)` times both ways on the same inputs."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        self.tp = tp

    def run(self, experts: int, hidden: int, inter: int, top_k: int, tokens: list[int], warmup: int, repeats: int) -> dict:
        group = TensorParallelGroup(self.tp.rank, self.tp.size, self.tp.device)  # its all_reduce is patched per call
        dense = make_layer(experts, hidden, inter, top_k)
        local = ExpertParallelFusedExperts(dense, group, "experts")
        local.weight_loader(local.gate_up_proj, dense.gate_up_proj)
        local.weight_loader(local.down_proj, dense.down_proj)
        del dense
        comm = Collectives(group)
        rows = {}
        with torch.inference_mode():
            for count in tokens:
                x, weights, ids = make_inputs(count, experts, hidden, top_k)
                for name, layer in (("all-reduce", all_reduce_layer), ("all-to-all", all_to_all_layer)):
                    walls, comms = [], []
                    for step in range(warmup + repeats):
                        self.tp.barrier()
                        comm.take()
                        started = time.perf_counter()
                        out = layer(local, comm, x, weights, ids)
                        wall, spent = time.perf_counter() - started, comm.take()
                        if step >= warmup:
                            walls.append(wall)
                            comms.append(spent)
                    rows.setdefault(count, {})[name] = {"median_ms": statistics.median(walls) * 1e3, "min_ms": min(walls) * 1e3,
                                                         "collectives_ms": statistics.median(comms) * 1e3,
                                                         "checksum": float(out.double().sum())}
        return rows


def check_both_ways(args: argparse.Namespace) -> None:
    """In one process (the collectives stood in for): each way sums to the whole layer."""
    dense = make_layer(args.experts, args.hidden, args.inter, args.top_k)
    x, weights, ids = make_inputs(37, args.experts, args.hidden, args.top_k)
    with torch.inference_mode():
        expected = dense(x, weights, ids)
        total = torch.zeros_like(x)
        for rank in range(args.ranks):
            group = TensorParallelGroup(rank, args.ranks, torch.device("cpu"))
            group.all_reduce = lambda t: t
            local = ExpertParallelFusedExperts(dense, group, "experts")
            local.weight_loader(local.gate_up_proj, dense.gate_up_proj)
            local.weight_loader(local.down_proj, dense.down_proj)
            total += local(x, weights, ids)
    torch.testing.assert_close(total, expected, atol=1e-4, rtol=1e-4)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", default="1,16,128,1024", help="tokens a step (comma-separated)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=512, help="one expert's intermediate size")
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", default="benchmarks/results/expert_parallel.json")
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    check_both_ways(args)
    with MultiprocExecutor(BenchWorker, args.ranks, torch_threads=1) as executor:
        results = executor.call("run", args.experts, args.hidden, args.inter, args.top_k, tokens, args.warmup, args.repeats)
    rank0 = results[0]
    print(f"{args.ranks} gloo ranks on CPU, one thread each: {args.experts} experts ({args.experts // args.ranks} a rank), "
          f"top-{args.top_k}, hidden {args.hidden}, expert intermediate {args.inter}, fp32")
    print("median ms of the layer on rank 0 (min), and of it the median ms inside collectives")
    print(f"{'tokens':>7} {'all-reduce':>16} {'(collectives)':>14} {'all-to-all':>16} {'(collectives)':>14}")
    for count in tokens:
        a, b = rank0[count]["all-reduce"], rank0[count]["all-to-all"]
        if abs(a["checksum"] - b["checksum"]) > 1e-3 * max(1.0, abs(a["checksum"])):
            raise AssertionError(f"{count} tokens: the two ways disagree ({a['checksum']} vs {b['checksum']})")
        print(f"{count:>7} {a['median_ms']:>8.2f} ({a['min_ms']:>5.2f}) {a['collectives_ms']:>14.2f} "
              f"{b['median_ms']:>8.2f} ({b['min_ms']:>5.2f}) {b['collectives_ms']:>14.2f}")
    report = {"settings": vars(args), "machine": {"platform": platform.platform(), "torch": torch.__version__},
              "rank0": {str(count): rank0[count] for count in tokens}}
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
