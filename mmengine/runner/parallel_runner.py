"""The driver's runner at tensor_parallel_size > 1: the engine talks to it as to a ModelRunner, and it sends
each step's plan to the ranks (worker processes, `worker.py`) and hands back rank 0's tokens.

```
engine (driver)                 ParallelRunner                         ModelWorker x tp (spawned)
scheduler -> SchedulerOutput -> StepPlan (plain data; requests the ranks   mirror requests, ModelRunner.launch over
                                have seen travel as a few numbers) ---->   this rank's slice; collectives
step loop <- RemoteStep     <-- StepResult from rank 0 <----------------  sampled tokens, logprobs
```

It holds no tensors: sizes come from rank 0's runner at start-up (`describe`), the KV block count is the
minimum over the ranks, and the encoder outputs it reports are the books of what the ranks hold. A worker that
dies or fails makes every later call raise EngineDeadError (`distributed/executor.py`); `shutdown()` stops them.

Speculative decoding: n-gram drafts are the driver's (every rank verifies them); a draft head (MTP, EAGLE-3) is split
over the ranks like the decoder (`distributed/sharded_draft_heads.py`), runs on them within each step that samples
as at TP 1 (`head_drafter.py`), and rank 0's reply carries its drafts (still one plan and one reply a step). With async
scheduling the next step is sent before a verify step's reply is read, as TP 1 launches it (`follows_drafts_on_device`):
the plan carries what TP 1's runner reads of the step loop's (the placeholder token and drafts, the chain depths, the
checkpoint copies), and each rank moves its rows by the drafts kept from the results of its own previous step, restoring
its own Gated DeltaNet states (`worker.py`, `follow_drafts.py`); the kept run's tokens reach the ranks with the next plan.

CUDA graphs: every rank captures the same buckets and variants in the same order (compared here before any
capture), each graph holding the rank's collectives (`distributed/graph_capture.py`); a step replays or runs eager by
the same rule on every rank, derived from the plan (`parallel_graphs.py`), and rank 0's replay counts come back with
each step (`decode_graphs`). A capture that fails on any rank stops every rank and raises CudaGraphCaptureError.
`capture_cuda_graphs(EagerCapturer())` sends the CPU stand-in to the ranks.

What is refused at TP > 1, by name, before any process starts (`check_parallel_options`): a decoder or a draft head
whose sizes the ranks do not divide (`distributed/sharded_model.py`, `distributed/sharded_draft_heads.py`), and
enable_expert_parallel on a model without experts or whose experts the ranks do not divide among them.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mmengine.config import EngineConfig
from mmengine.core.request import PLACEHOLDER_TOKEN
from mmengine.core.scheduler import SchedulerOutput
from mmengine.distributed.encoder_host_moves import DriverEncoderHost
from mmengine.distributed.executor import MultiprocExecutor
from mmengine.distributed.executor_base import Executor, WorkerError
from mmengine.distributed.kv_host_moves import DriverHostBlocks
from mmengine.distributed.ray_placement import import_ray
from mmengine.distributed.sharded_draft_heads import check_draft_head_shapes
from mmengine.distributed.sharded_model import check_tensor_parallel_shapes
from mmengine.errors import ConfigError, CudaGraphCaptureError, EngineDeadError
from mmengine.kv_cache.host_tier import KVCopy
from mmengine.kv_cache.manager import cdiv
from mmengine.models.family import ModelFamily
from mmengine.models.loader import fuse_expert_tensors
from mmengine.outputs import TokenLogprobs
from mmengine.runner.cuda_graphs import CaptureReport, GraphCapturer
from mmengine.runner.parallel_graphs import RemoteGraphs, check_same_capture_orders
from mmengine.runner.shared_pixels import PlanSegment
from mmengine.runner.step_plan import NewRequest, PlannedRow, StepPlan, StepResult
from mmengine.runner.worker import ModelWorker
from mmengine.sample.sampler import Sampler
from mmengine.sample.structured_output.masks import BitmaskFiller

logger = logging.getLogger(__name__)

UPDATE_CHUNK_BYTES = 256 << 20  # a weight update's tensors sent to the ranks per call (one pickle for all of them)


def check_parallel_options(config: EngineConfig, family: ModelFamily, device: torch.device) -> None:
    """ConfigErrors for what tensor parallelism does not run yet, each naming its option."""
    tp = config.parallel_config.tensor_parallel_size
    if tp == 1:
        return
    prefix = f"tensor_parallel_size={tp}"
    backend = config.parallel_config.distributed_executor_backend
    if backend == "ray":
        import_ray(f"{prefix}: distributed_executor_backend='ray'")
    elif multiprocessing.current_process().daemon:
        raise ConfigError(f"{prefix}: this process is a daemonic one (AsyncMMEngine's engine_core='process'), which cannot "
                          "start the worker processes; use engine_core='thread' or `mmengine serve --api-server-count`")
    check_draft_head_shapes(config, family, tp)
    check_tensor_parallel_shapes(family, tp, config.parallel_config.enable_expert_parallel)


def compact(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor on the CPU in storage of its own (a pickled view carries its whole storage)."""
    tensor = tensor.detach().cpu()
    if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tensor


def name_model(family: ModelFamily) -> torch.nn.Module:
    """The family's model on the meta device (no memory, no weights): its checkpoint names and layer shapes."""
    with torch.device("meta"):
        return type(family).model_class(family.hf_config)


def worker_config(config: EngineConfig) -> EngineConfig:
    """The ranks' config: cascade attention "auto" is off (its cost model is not weighed per rank yet; "on" runs, each
    rank on its heads: worker.rank_cascade_policy)."""
    if config.execution_config.cascade_attention != "auto":
        return config
    return EngineConfig(config.model, **{**config.options(), "cascade_attention": "off"})


def start_executor(backend: str, factory: Any, tensor_parallel_size: int, device: str, torch_threads: int | None,
                   on_death: Any) -> Executor:
    """The ranks started by `distributed_executor_backend`: "mp", worker processes on this machine; "ray", Ray actors
    placed by a placement group (distributed/ray_executor.py)."""
    if backend == "ray":
        from mmengine.distributed.ray_executor import RayExecutor

        return RayExecutor(factory, tensor_parallel_size, device=device, torch_threads=torch_threads, on_death=on_death)
    return MultiprocExecutor(factory, tensor_parallel_size, device=device, torch_threads=torch_threads, on_death=on_death)


class RemotePenalties:
    """Stands in for the runner's PenaltyState on the driver; the next plan carries what it gathered to the ranks:
    the requests the engine released (finished or aborted: the ranks forget them), and a penalized request's tokens
    kept by an n-gram verify step, known once booked (each rank counts them before its next step, as TP 1's runner
    does in count_kept_tokens; a draft head's kept runs are counted on the ranks' devices)."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.kept: list[tuple[str, list[int]]] = []

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def count_kept(self, request_id: str, tokens: list[int]) -> None:
        self.kept.append((request_id, list(tokens)))

    def take(self) -> tuple[list[str], list[tuple[str, list[int]]]]:
        released, kept, self.released, self.kept = self.released, self.kept, [], []
        return released, kept


@dataclass
class RemotePromptLogprobs:
    """One request's prompt log-probabilities from one step's chunk (as step_loop records them)."""

    request: Any
    first_position: int
    found: list[TokenLogprobs]

    def entries(self) -> list[TokenLogprobs]:
        return self.found


class RemoteStep:
    """A step sent to the ranks (the LaunchedStep the step loop reads): rank 0's result is read on first use, the
    steps' results in the order they were sent (async scheduling sends the next step before reading this one)."""

    pending = None

    def __init__(self, runner: ParallelRunner, seq: int, requests: dict[str, Any]) -> None:
        self.runner = runner
        self.seq = seq
        self.requests = requests
        self.fetched: StepResult | None = None
        self.found: list[RemotePromptLogprobs] | None = None

    def fetch(self) -> StepResult:
        if self.fetched is None:
            self.fetched = self.runner.collect(self.seq)
        return self.fetched

    def result(self) -> dict[str, list[int]]:
        return self.fetch().tokens

    def drafts(self, raw: bool = False) -> dict[str, list[int]]:
        """As LaunchedStep.drafts: each request's counted drafts, or (`raw`) the whole chain."""
        result = self.fetch()
        if raw:
            return result.drafts
        return {request_id: drafts[: result.draft_counts[request_id]] for request_id, drafts in result.drafts.items()}

    def token_logprobs(self) -> dict[str, list[TokenLogprobs]]:
        return self.fetch().logprobs

    @property
    def prompt_logprobs(self) -> list[RemotePromptLogprobs]:
        if self.found is None:
            self.found = [RemotePromptLogprobs(self.requests[part.request_id], part.first_position, part.entries)
                          for part in self.fetch().prompt_logprobs]
        return self.found


@dataclass
class PendingRemoteStep:
    """A step with grammar-constrained rows, not sent yet: their masks are taken in `sample()`, once the grammars
    have every token sampled so far (with async scheduling, after the step in flight is read)."""

    plan: StepPlan
    masked: list[tuple[int, Any]]  # (row of the plan, its request)
    requests: dict[str, Any]
    pending: bool = True


class ParallelRunner:
    follows_drafts_on_device = True  # each rank moves the rows launched ahead of a draft head's step (worker.py)

    def __init__(self, config: EngineConfig, family: ModelFamily, model_dir: Path, device: torch.device, dtype: torch.dtype,
                 max_model_len: int) -> None:
        check_parallel_options(config, family, device)
        self.config = config
        self.family = family
        self.tensor_parallel_size = config.parallel_config.tensor_parallel_size
        self.device = torch.device("cpu")  # the driver's own tensors (generators, masks): the ranks hold the rest
        self.worker_device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        factory = functools.partial(ModelWorker, config=worker_config(config), family=family, model_dir=str(model_dir),
                                    dtype=dtype, max_model_len=max_model_len)
        threads = max(1, torch.get_num_threads() // self.tensor_parallel_size) if device.type == "cpu" else None
        self.dead_error: EngineDeadError | None = None
        # (set before the executor starts: a rank that dies during start-up calls on_death, which releases them)
        self.segments: list[PlanSegment] = []  # the plan being built: its pictures in shared memory
        self.segments_of: dict[int, list[PlanSegment]] = {}  # sent plans' segments, unlinked once their replies are read
        self.backend = config.parallel_config.distributed_executor_backend
        # Pictures travel in shared memory only to processes on this machine; Ray's object store carries them itself
        self.shares_pixels = self.backend == "mp"
        self.executor = start_executor(self.backend, factory, self.tensor_parallel_size, device.type, threads, self.on_death)
        described = self.executor.call("describe")
        info = described[0]
        self.weight_bytes_per_rank = [d["weight_bytes"] for d in described]
        self.kv_block_bytes: int = info["kv_block_bytes"]
        self.window_block_bytes: int = info["window_block_bytes"]
        self.embedding_bytes: int = info["embedding_bytes"]
        self.state_slot_bytes: int = info["state_slot_bytes"]
        self.window_pool = info["window_pool"]
        self.use_cuda_graphs: bool = info["use_cuda_graphs"]  # the ranks capture at start-up (CUDA, Triton, not enforce_eager)
        self.decode_graphs: RemoteGraphs | None = None  # rank 0's graphs and replay counts, once captured
        self.num_window_blocks = 0
        self.num_state_checkpoints = 0
        self.num_kv_blocks = 0
        self.block_size = config.cache_config.block_size
        self.sampler = Sampler(config.model_config.seed)  # the engine's make_generator (the ranks seed their own)
        self.penalties = RemotePenalties()
        # a constrained verify row's masks: one a position, the grammar's after the drafts before it
        self.grammar_masks = BitmaskFiller(family.text_config.vocab_size, 1 + config.spec_config.num_speculative_tokens, self.device)
        self.encoder_outputs: dict[str, bool] = {}  # the mm_hashes the ranks hold
        self.encoder_host_tier = None  # the encoder host tier's books (start-up sets it); the ranks hold the outputs
        self.encoder_host_books: DriverEncoderHost | None = None
        self.on_encoded = None
        self.lora_loads: list[tuple[int, Any]] = []  # (slot, adapter or None) for the next plan
        self.host_blocks = DriverHostBlocks()  # the KV host tier's copies for the next plan
        # With LoRA the engine's adapter books read the model's names and its vision side's shapes: a copy on meta
        self.model = name_model(family) if config.lora_config.enable_lora else None
        self.vision_lora_modules: dict[str, Any] = self.model.vision_linears() if self.model is not None else {}
        self.num_encoder_runs = 0
        self.num_cascade_steps = self.num_cascade_groups = self.num_cascade_tokens = 0
        self.synced: dict[str, int] = {}  # request id -> how many of its tokens the ranks have
        self.last_step_seconds = (0.0, 0.0)  # the last step read: from its sending to its reply, rank 0's time in it
        self.num_submitted = self.num_collected = 0  # steps sent, and replies read (in order)
        self.submitted_at: dict[int, float] = {}
        self.max_in_flight = 0  # the most steps sent and not read at once (2 with async scheduling)
        self.results: dict[int, StepResult] = {}  # replies read before their steps asked
        self.freed: list[str] = []  # encoder outputs to drop with the next plan
        self.stale: list[str] = []

    @property
    def encoder_host(self) -> DriverEncoderHost | None:
        """The books over the encoder host tier that start-up gives this runner (`encoder_host_tier`), if any."""
        if self.encoder_host_tier is not None and self.encoder_host_books is None:
            self.encoder_host_books = DriverEncoderHost(self.encoder_host_tier, self.embedding_bytes)
        return self.encoder_host_books

    def on_death(self, error: EngineDeadError) -> None:
        self.dead_error = error
        self.release_segments()
        logger.error("tensor-parallel workers failed: %s", error)

    def check_alive(self) -> None:
        self.executor.check_alive()

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.release_segments()

    def release_segments(self) -> None:
        """Unlinks the shared pictures of the plans not read back (a failed or stopped executor)."""
        for segments in [self.segments, *self.segments_of.values()]:
            for segment in segments:
                segment.release()
        self.segments, self.segments_of = [], {}

    # -- start-up --------------------------------------------------------------------------------------------------

    def determine_num_kv_blocks(self, encoder_fixed_bytes: int, encoder_bytes_per_block: int, images_per_step: int,
                                encoder_budget_tokens: int = 0) -> int:
        """The fewest blocks any rank has room for (each rank sizes its own memory)."""
        # (on CUDA the ranks' profile runs capture their graphs once, to weigh them)
        found = self.call_capturing("determine_num_kv_blocks", encoder_fixed_bytes, encoder_bytes_per_block, images_per_step,
                                    encoder_budget_tokens)
        num_blocks = min(blocks for blocks, _, _ in found)
        self.num_window_blocks = min(windows for _, windows, _ in found)
        self.num_state_checkpoints = min(checkpoints for _, _, checkpoints in found)
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_bytes_per_rank = self.executor.call("allocate_kv_cache", num_blocks, self.num_window_blocks)
        self.num_kv_blocks = num_blocks

    def capture_cuda_graphs(self, capturer: GraphCapturer | None = None) -> CaptureReport:
        """Every rank captures the same graphs in the same order (checked first: runner/parallel_graphs.py); returns
        rank 0's report. `capturer`: a picklable stand-in the ranks capture with (EagerCapturer on CPU); None, real
        CUDA graphs holding the collectives (distributed/graph_capture.py)."""
        orders = self.executor.call("graph_plan")
        check_same_capture_orders(orders)
        reports = self.call_capturing("capture_cuda_graphs", capturer)
        self.decode_graphs = RemoteGraphs(orders[0], 1 + self.config.spec_config.num_speculative_tokens)
        return reports[0]

    def call_capturing(self, method: str, *args: Any) -> list[Any]:
        """Every rank's result of a call that may capture CUDA graphs. A rank whose capture fails ends the executor
        (the others are stopped, even inside a collective) and its CudaGraphCaptureError is raised here."""
        try:
            return self.executor.call(method, *args)
        except WorkerError as err:
            if isinstance(err.error, CudaGraphCaptureError):
                raise err.error from err
            raise

    def warm_up(self, images_per_step: int = 0) -> None:
        self.executor.call("warm_up", images_per_step)

    # -- a step ----------------------------------------------------------------------------------------------------

    def execute(self, out: SchedulerOutput, block_tables: dict[str, list[int]],
                window_tables: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
        return self.sample(self.launch(out, block_tables, window_tables=window_tables)).result()

    def launch(self, out: SchedulerOutput, block_tables: dict[str, list[int]], previous: Any = None,
               window_tables: dict[str, list[int]] | None = None) -> Any:
        """Sends the step to every rank (one plan, pickled once) without waiting; the returned step's result() reads
        rank 0's tokens. A step that computes no token is waited for here (nothing reads it later). Requests
        decoding after a step in flight (async scheduling) carry placeholders, which each rank fills in with the
        token it sampled itself."""
        plan, masked = self.plan(out, block_tables, window_tables)
        requests = {s.request.request_id: s.request for s in out.scheduled}
        if masked:
            return PendingRemoteStep(plan, masked, requests)
        return self.send(plan, requests, wait=out.num_scheduled_tokens == 0)

    def sample(self, launched: Any) -> Any:
        """Sends a step whose constrained rows waited for their grammars, each row with its token bitmask."""
        if not isinstance(launched, PendingRemoteStep):
            return launched
        for index, request in launched.masked:
            drafts = launched.plan.rows[index].draft_token_ids
            launched.plan.rows[index].grammar_mask = self.grammar_masks.fill(
                [request.grammar] * (1 + len(drafts)), [drafts[:i] for i in range(1 + len(drafts))]).clone()
        return self.send(launched.plan, launched.requests, wait=False)

    def send(self, plan: StepPlan, requests: dict[str, Any], wait: bool) -> RemoteStep:
        segments, self.segments = self.segments, []
        try:
            self.executor.submit(plan)
        except BaseException:
            for segment in segments:
                segment.release()
            raise
        self.num_submitted += 1
        if segments:
            self.segments_of[self.num_submitted] = segments
        self.submitted_at[self.num_submitted] = time.perf_counter()
        self.max_in_flight = max(self.max_in_flight, self.num_submitted - self.num_collected)
        step = RemoteStep(self, self.num_submitted, requests)
        if wait:
            step.fetch()
        return step

    def collect(self, seq: int) -> StepResult:
        """Step `seq`'s result, reading the ranks' replies in order up to it."""
        while self.num_collected < seq:
            result: StepResult = self.executor.collect()
            self.num_collected += 1
            for segment in self.segments_of.pop(self.num_collected, []):  # every rank has copied its pictures out
                segment.release()
            self.results[self.num_collected] = result
            sent = self.submitted_at.pop(self.num_collected)
            self.last_step_seconds = (time.perf_counter() - sent, result.seconds)  # (the driver's wait, rank 0's compute)
            self.num_encoder_runs = result.num_encoder_runs
            self.num_cascade_steps, self.num_cascade_groups, self.num_cascade_tokens = result.cascade
            if result.graph_replays is not None and self.decode_graphs is not None:
                self.decode_graphs.update(result.graph_replays)
        return self.results.pop(seq)

    def plan(self, out: SchedulerOutput, block_tables: dict[str, list[int]],
             window_tables: dict[str, list[int]] | None) -> tuple[StepPlan, list[tuple[int, Any]]]:
        """The step as plain data, and its rows a grammar constrains (their masks are taken when it is sent)."""
        plan = StepPlan(block_tables=block_tables, window_tables=window_tables, lora_slots=dict(out.lora_slots),
                        encoder_lora_slots=dict(out.encoder_lora_slots), lora_loads=self.lora_loads,
                        draft_depths=out.draft_depths, state_copies=list(out.state_copies))
        self.lora_loads = []
        plan.kv_moves = self.host_blocks.take()
        masked: list[tuple[int, Any]] = []
        plan.forget, plan.kept_tokens = self.penalties.take()
        for request_id in plan.forget:
            self.synced.pop(request_id, None)
        new_items = [item for s in out.scheduled if s.request.request_id not in self.synced for item in s.request.mm_items]
        segment = PlanSegment(new_items) if new_items and self.shares_pixels else None  # the new pictures, in shared memory
        if segment is not None and segment.memory is not None:
            self.segments.append(segment)
        for s in out.scheduled:
            request = s.request
            request_id = request.request_id
            if request_id not in self.synced:
                items = segment.share(request.mm_items) if segment is not None else request.mm_items
                plan.new_requests.append(NewRequest(request_id, list(request.prompt_token_ids), items,
                                                    request.mrope_positions, request.sampling_params))
                self.synced[request_id] = request.num_prompt_tokens
            base = min(self.synced[request_id], request.num_tokens)
            # a placeholder (the last token, booked before its step was read) is sent again once known: a rank fills it
            # in with its last sample, which is not the token there after a verify row that kept fewer than all drafts
            self.synced[request_id] = request.num_tokens - (request.all_token_ids[-1] == PLACEHOLDER_TOKEN)
            if request.grammar is not None and s.samples:
                masked.append((len(plan.rows), request))
            plan.rows.append(PlannedRow(request_id, s.start, s.num_new_tokens, list(s.encoder_items), base,
                                        request.all_token_ids[base:], request.num_prefix_hit_tokens, state=s.state,
                                        draft_token_ids=list(s.draft_token_ids)))
            for index in s.encoder_items:
                self.encoder_outputs[request.mm_items[index].mm_hash] = True
                if self.encoder_host is not None:
                    self.encoder_host.encoded(request.mm_items[index].mm_hash, request.mm_items[index].length)
            for index in s.restored_items:  # (each rank copies it back from its host tier)
                self.encoder_outputs[request.mm_items[index].mm_hash] = True
                self.encoder_host.restore(request.mm_items[index].mm_hash, request.mm_items[index].length)
            plan.rows[-1].restored_items = list(s.restored_items)
        if self.encoder_host is not None:  # after the restores, as the runner stores them at TP 1
            self.encoder_host.free(out.freed_encoder_hashes, out.stale_encoder_hashes)
            plan.encoder_host = self.encoder_host.take()
        freed = [*self.freed, *out.freed_encoder_hashes]
        plan.freed_encoder_hashes = freed
        plan.stale_encoder_hashes = [*self.stale, *out.stale_encoder_hashes]
        self.freed, self.stale = [], []
        for mm_hash in freed:
            self.encoder_outputs.pop(mm_hash, None)
        return plan, masked

    def free_encoder_outputs(self, mm_hashes: list[str], stale: list[str] = ()) -> None:
        """Drops outputs from the ranks with the next plan (the host tier keeps those not stale)."""
        if self.encoder_host is not None:
            self.encoder_host.free(mm_hashes, list(stale))
        for mm_hash in mm_hashes:
            self.encoder_outputs.pop(mm_hash, None)
        self.freed.extend(mm_hashes)
        self.stale.extend(stale)

    def copy_kv_blocks(self, offloads: list[KVCopy], restores: list[KVCopy]) -> None:
        """The ranks copy their slices of these blocks with the next plan, before its forward."""
        self.host_blocks.book(offloads, restores)

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded: list[str]) -> None:
        """Sends the new weights to the ranks in chunks of about UPDATE_CHUNK_BYTES (each pickled once for all of
        them); each rank checks them as TP 1 does and loads its part (`distributed/sharded_update.py`). A refused
        weight raises its error here, those before it loaded (as at TP 1), and the ranks go on serving."""
        self.collect_all()
        num_experts = getattr(self.family.text_config, "num_experts", 0) or 0
        stream = iter(fuse_expert_tensors(weights, num_experts) if num_experts > 0 else weights)  # (a layer's experts in one chunk)
        chunk: list[tuple[str, torch.Tensor]] = []
        size, first, failure = 0, True, None
        while True:
            try:
                name, tensor = next(stream)
            except StopIteration:
                break
            except Exception as err:  # noqa: BLE001 - a bad pair: those before it are loaded first, as at TP 1
                failure = err
                break
            tensor = compact(tensor)
            chunk.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= UPDATE_CHUNK_BYTES:
                self.send_weights(chunk, first, loaded)
                chunk, size, first = [], 0, False
        if chunk:
            self.send_weights(chunk, first, loaded)
        if failure is not None:
            raise failure

    def send_weights(self, chunk: list[tuple[str, torch.Tensor]], first: bool, loaded: list[str]) -> None:
        replies = self.executor.call("update_weights", chunk, first)
        loaded.extend(replies[0][0])
        error = next((error for _, error in replies if error is not None), None)  # (every rank checks the same)
        if error is not None:
            raise error

    def collect_all(self) -> None:
        """Reads every sent step's reply (kept for its step): a call to the ranks waits for no step."""
        if self.num_collected < self.num_submitted:
            self.results[self.num_submitted] = self.collect(self.num_submitted)

    def load_lora_slot(self, slot: int, adapter: Any) -> None:
        """The ranks load the adapter into `slot` (each its part) before the next step: with the next plan."""
        self.lora_loads.append((slot, adapter))

    def count_kept_tokens(self, request: Any, tokens: list[int]) -> None:
        """A penalized request's tokens kept by a verify step (n-gram drafts), counted on each rank with the next plan."""
        self.penalties.count_kept(request.request_id, tokens)

    def clear_lora_slot(self, slot: int) -> None:
        self.lora_loads.append((slot, None))

    @property
    def memory_per_rank(self) -> dict[str, int]:
        """Rank 0's weights and KV cache bytes (each rank holds about as much)."""
        return {"weights": self.weight_bytes_per_rank[0], "kv_cache": getattr(self, "kv_bytes_per_rank", [0])[0],
                "kv_blocks": self.num_kv_blocks, "max_blocks_per_request": cdiv(self.max_model_len, self.config.cache_config.block_size)}
