"""One tensor-parallel rank: its slice of the model, its KV heads' blocks, the encoder outputs, the sampler.

Built in a worker process by `distributed/worker_loop.py` (`ModelWorker(group, ...)`); the driver's
`parallel_runner.py` calls it. The rank runs the same ModelRunner as a single-process engine, over a family
whose model is split (`distributed/sharded_model.py`) and whose KV layout holds this rank's heads, and over a
mirror of the driver's requests (plain `Request`s rebuilt from the plans: prompt, items, tokens, seeds).

Every rank computes every step (the collectives need them all) and samples from the same all-gathered
logits with the same seeded generators; rank 0's tokens go back. Grammars stay with the driver: the plan
carries each constrained row's token bitmask. With async scheduling a placeholder token is the one this rank sampled
last step; after a draft head's step, the rows the driver launched ahead of it are moved on this rank's device from that
step's results (its accepted counts, samples, drafts and draft states), as TP 1's runner moves them (follow_drafts.py).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from mmengine.config import EngineConfig
from mmengine.core.request import PLACEHOLDER_TOKEN, ProcessedPrompt, Request
from mmengine.core.scheduler import ScheduledRequest, SchedulerOutput
from mmengine.distributed.encoder_data_parallel import data_parallel_encoder
from mmengine.distributed.encoder_host_moves import RankEncoderHostTier
from mmengine.distributed.kv_host_moves import RankHostBlocks
from mmengine.distributed.graph_capture import capture_failed, rank_capturer
from mmengine.distributed.process_group import TensorParallelGroup
from mmengine.distributed.quantized_parallel import weight_bytes
from mmengine.distributed.sharded_model import tensor_parallel_family
from mmengine.models.family import ModelFamily
from mmengine.runner.cuda_graphs import CaptureReport, GraphCapturer, ReplayCounts
from mmengine.runner.cascade_plan import CascadePolicy, cascade_layer_shape
from mmengine.runner.launched_step import LaunchedStep
from mmengine.runner.model_runner import ModelRunner
from mmengine.runner.shared_pixels import take_shared
from mmengine.runner.step_plan import PromptLogprobsPart, StepPlan, StepResult


class PlannedMask:
    """A constrained row's grammar, as the driver's grammar stood: its token bitmask for this step."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask


class PlannedMasks:
    """Stands in for the runner's BitmaskFiller: the rows' masks came with the plan (a verify row's, one a position:
    the row after n drafts reads the request's mask n)."""

    def fill(self, matchers: list[PlannedMask], drafts: list[list[int]] | None = None) -> torch.Tensor:
        before = drafts if drafts is not None else [[]] * len(matchers)
        return torch.cat([matcher.mask[len(d) : len(d) + 1] for matcher, d in zip(matchers, before, strict=True)])


def rank_cascade_policy(runner: ModelRunner, tp_size: int) -> CascadePolicy:
    """The runner's cascade policy planned for this rank's heads (it counts the whole model's query heads against the
    rank's KV heads: with KV heads replicated the GQA group, and so the tile, differs). Every rank plans the same groups
    from the same plan: the block tables and spans are the driver's."""
    shape = cascade_layer_shape(runner.text_config.num_attention_heads // tp_size, runner.family.kv_cache_layout(),
                                runner.family.kv_cache_windows(), runner.kv_element_bytes)
    return replace(runner.inputs.cascade, tokens_per_tile=shape.tokens_per_tile, kv_bytes_per_token=shape.kv_bytes_per_token,
                   num_kv_heads=shape.num_kv_heads)


class ModelWorker:
    """What one rank holds and runs (distributed.worker_loop.Worker)."""

    def __init__(self, tp: TensorParallelGroup, *, config: EngineConfig, family: ModelFamily, model_dir: str,
                 dtype: torch.dtype, max_model_len: int) -> None:
        self.tp = tp
        ranked = tensor_parallel_family(family, tp, config.parallel_config.enable_expert_parallel)
        self.runner = ModelRunner(config, ranked, Path(model_dir), tp.device, dtype, max_model_len)
        self.runner.grammar_masks = PlannedMasks()
        self.runner.capturer_factory = rank_capturer(tp)  # CUDA graphs that hold the step's collectives
        if config.parallel_config.mm_encoder_tp_mode == "data":  # each rank encodes its share of a step's pictures
            self.runner.model.encode_items = data_parallel_encoder(self.runner.model.encode_items, tp, self.runner.vision_lora_context)
        self.requests: dict[str, Request] = {}
        self.host_blocks = RankHostBlocks()  # this rank's slice of the KV blocks the driver's host tier holds
        if self.runner.inputs.cascade is not None:
            self.runner.inputs.cascade = rank_cascade_policy(self.runner, tp.size)
        if config.cache_config.encoder_cache_host_bytes:  # its copies of the outputs the driver's host tier holds
            self.runner.encoder_host_tier = RankEncoderHostTier()
        self.sampled: dict[str, list[int]] = {}  # the last step's tokens, by request
        self.previous: LaunchedStep | None = None  # the last step, whose drafts a step launched ahead of it follows

    # -- start-up (every rank) -----------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """The sizes the driver's start-up reads off a runner (this rank's: KV heads split)."""
        runner = self.runner
        return {
            "kv_block_bytes": runner.kv_block_bytes,
            "window_block_bytes": runner.window_block_bytes,
            "embedding_bytes": runner.embedding_bytes,
            "state_slot_bytes": runner.state_slot_bytes,
            "window_pool": runner.window_pool,
            "use_cuda_graphs": runner.use_cuda_graphs,
            "weight_bytes": weight_bytes(runner.model),  # (a quantized layer's bits, scales and zeros too)
        }

    def determine_num_kv_blocks(self, *args: Any, **kwargs: Any) -> tuple[int, int, int]:
        num_blocks = self.runner.determine_num_kv_blocks(*args, **kwargs)
        return num_blocks, self.runner.num_window_blocks, self.runner.num_state_checkpoints

    def allocate_kv_cache(self, num_blocks: int, num_window_blocks: int | None = None) -> int:
        """Allocates this rank's KV blocks; returns their bytes."""
        self.runner.allocate_kv_cache(num_blocks, num_window_blocks=num_window_blocks)
        windows = self.runner.num_window_blocks if num_window_blocks is None else num_window_blocks
        return num_blocks * self.runner.kv_block_bytes + windows * self.runner.window_block_bytes

    def warm_up(self, images_per_step: int = 0) -> None:
        self.runner.warm_up(images_per_step)

    def graph_plan(self) -> list[tuple[str, int, bool, bool]]:
        """The graphs this rank would capture, in order (the driver checks that the ranks agree)."""
        return self.runner.plan_cuda_graphs().capture_order()

    def capture_cuda_graphs(self, capturer: GraphCapturer | None = None) -> CaptureReport:
        """Captures this rank's graphs (`capturer`: a stand-in sent by the driver; None: real CUDA graphs)."""
        try:
            return self.runner.capture_cuda_graphs(capturer)
        except Exception as err:
            raise capture_failed(self.tp, err) from err

    def graph_counts(self) -> ReplayCounts | None:
        graphs = self.runner.decode_graphs
        return graphs.counts() if graphs is not None else None

    # -- a step ------------------------------------------------------------------------------------------------

    def execute_step(self, plan: StepPlan) -> StepResult | None:
        started = time.perf_counter()
        runner = self.runner
        for request_id, tokens in plan.kept_tokens:
            if request_id in self.requests and request_id not in plan.forget:
                runner.count_kept_tokens(self.requests[request_id], tokens)
        for request_id in plan.forget:
            self.requests.pop(request_id, None)
            runner.penalties.release(request_id)
        for new in plan.new_requests:
            processed = ProcessedPrompt(None, new.prompt_token_ids, take_shared(new.mm_items), new.mrope_positions)
            generator = runner.sampler.make_generator(new.sampling_params, runner.device)
            self.requests[new.request_id] = Request(new.request_id, processed, new.sampling_params, 0, generator)
        # launched ahead of a draft head's step: this rank moves the rows on the device from that step's results, as
        # TP 1's runner does (follow_drafts.py); their placeholders stay, and the driver sends the tokens once known
        previous = self.previous if self.previous is not None and self.previous.device_drafts is not None else None
        scheduled = []
        for row in plan.rows:
            request = self.requests[row.request_id]
            if row.new_tokens or row.token_base < request.num_tokens:
                del request.all_token_ids[row.token_base:]
                request.all_token_ids.extend(row.new_tokens)
                if PLACEHOLDER_TOKEN in row.new_tokens and previous is None:  # async: the token this rank sampled last step
                    self.fill_placeholders(request)
            request.num_computed_tokens = row.start
            request.num_prefix_hit_tokens = row.num_prefix_hit_tokens
            request.grammar = None if row.grammar_mask is None else PlannedMask(row.grammar_mask)
            scheduled.append(ScheduledRequest(request, row.start, row.num_new_tokens, list(row.encoder_items), state=row.state,
                                              draft_token_ids=list(row.draft_token_ids), restored_items=list(row.restored_items)))
        for slot, adapter in plan.lora_loads:
            if adapter is None:
                runner.clear_lora_slot(slot)
            else:
                runner.load_lora_slot(slot, adapter)
        freed = [h for h in dict.fromkeys(plan.freed_encoder_hashes) if h in runner.encoder_outputs]
        host = plan.encoder_host
        if runner.encoder_host_tier is not None:
            runner.encoder_host_tier.keep = set(host.keep) if host is not None else set()
        # Freed before the step (not after its restores, as at TP 1): a restore may read what a free keeps, and the
        # driver's tier has decided what the ranks keep
        runner.free_encoder_outputs(freed, list(plan.stale_encoder_hashes))
        out = SchedulerOutput(scheduled=scheduled, stale_encoder_hashes=list(plan.stale_encoder_hashes),
                              lora_slots=plan.lora_slots, encoder_lora_slots=plan.encoder_lora_slots,
                              draft_depths=plan.draft_depths, state_copies=list(plan.state_copies))
        if plan.kv_moves is not None:
            self.host_blocks.apply(runner, plan.kv_moves)
        launched = runner.launch(out, plan.block_tables, previous, window_tables=plan.window_tables)
        if host is not None:
            runner.encoder_host_tier.drop_all(host.dropped)
        if launched.pending is not None:
            launched = runner.sample(launched)
        tokens = launched.result()
        self.sampled, self.previous = tokens, launched
        if self.tp.rank != 0:
            return None
        # a draft head's, made within the step as at TP 1 (runner/head_drafter.py): the chain, and the drafts counted
        drafts, counted = launched.drafts(raw=True), launched.drafts()
        prompt_logprobs = [PromptLogprobsPart(part.request.request_id, part.first_position, part.entries())
                           for part in launched.prompt_logprobs]
        return StepResult(tokens, launched.token_logprobs(), prompt_logprobs, runner.num_encoder_runs, time.perf_counter() - started,
                          self.graph_counts(), drafts=drafts, draft_counts={r: len(d) for r, d in counted.items()},
                          cascade=(runner.num_cascade_steps, runner.num_cascade_groups, runner.num_cascade_tokens))

    def fill_placeholders(self, request: Request) -> None:
        """The driver booked a token it has not read yet (async scheduling): it is the one this rank sampled for the
        request in the previous step (every rank samples the same). Only the request's last token can be one."""
        tokens = request.all_token_ids
        if PLACEHOLDER_TOKEN in tokens[:-1] or request.request_id not in self.sampled:
            raise RuntimeError(f"request {request.request_id!r}: a placeholder token this rank did not sample")
        tokens[-1] = self.sampled[request.request_id][-1]

    def recurrent_states(self, slots: list[int]) -> list[torch.Tensor]:
        """This rank's recurrent state at each slot (every linear-attention layer's conv and recurrent parts, flat, on
        the CPU): what the driver's books say a checkpoint holds can be read back from each rank."""
        states = self.runner.recurrent_states
        return [torch.cat([torch.cat([layer.conv[slot].flatten(), layer.recurrent[slot].flatten()]) for layer in states]).cpu()
                for slot in slots]

    def update_weights(self, weights: list[tuple[str, torch.Tensor]], first: bool) -> tuple[list[str], Exception | None]:
        """One chunk of a weight update (`first`: its first, which starts the update's checks): our names of the
        weights loaded, and the error that stopped it, returned rather than raised (a worker that raises ends the
        executor; a refused weight leaves the engine serving, as at TP 1)."""
        if first:
            self.runner.model.update_check = None
        loaded: list[str] = []
        try:
            self.runner.update_weights(weights, loaded)
        except Exception as err:  # noqa: BLE001 - returned, as TP 1 raises it to the caller and goes on serving
            return loaded, err
        return loaded, None

    def close(self) -> None:
        self.requests.clear()
