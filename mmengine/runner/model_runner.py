"""ModelRunner: scheduler output -> tensors -> vision encoder + decoder -> sampled tokens.

No policy here: the runner computes exactly what the scheduler asked for. A step fills the
persistent input buffers, replays a CUDA graph when the batch is decode-only (else runs eager),
samples on the device and copies the sampled tokens back without waiting: reading them
(LaunchedStep.result) is the step's only host sync, and with async scheduling the next step is
already queued by then.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from mmengine.config import EngineConfig
from mmengine.errors import ConfigError
from mmengine.encoder_cache.host_tier import EncoderHostTier
from mmengine.kernels.kv_quant import is_fp8
from mmengine.kv_cache.host_tier import KVCopy
from mmengine.kv_cache.manager import cdiv
from mmengine.runner.kv_tensors import PagedKVTensors, WindowPool, kv_block_bytes, split_kv_memory
from mmengine.layers.attention import AttentionMetadata
from mmengine.layers.attention_backends import get_attention_backend
from mmengine.layers.gated_delta import GatedDeltaStates, RecurrentStep
from mmengine.layers.kernel_dispatch import use_fused_kernels
from mmengine.layers.lora import ItemLoRAContext, LoRAContext, LoRALinear, LoRASegments, add_lora
from mmengine.models.family import ModelFamily
from mmengine.models.llama import DeepStack
from mmengine.lora.adapter import LoRAAdapter
from mmengine.models.loader import default_dtype, iter_checkpoint, parameters_on_meta
from mmengine.models.quantization import quantization_of
from mmengine.runner.cascade_plan import CascadePolicy, cascade_layer_shape
from mmengine.runner.cuda_graphs import CaptureReport, CudaGraphCapturer, DecodeGraphs, GraphCapturer, graph_batch_sizes
from mmengine.runner.verify_graphs import (
    RecurrentColumns,
    refresh_host_lists,
    state_source,
    verify_graph_sizes,
    verify_metadata,
    verify_query_len,
)
from mmengine.runner.inputs import InputBuffers
from mmengine.runner.follow_drafts import follow_drafts
from mmengine.runner.head_drafter import DeviceDrafts, Eagle3DraftHead, HeadDrafter, MtpHead
from mmengine.sample.penalties import PenaltyState, apply_logit_bias
from mmengine.runner.spans import span_ends
from mmengine.runner.launched_step import NOTHING_SAMPLED, LaunchedStep, PendingSample, PromptLogprobs, TokenReadback
from mmengine.sample.params import SamplingParams
from mmengine.sample.sampler import Sampler, token_logprobs
from mmengine.core.scheduler import ScheduledRequest, SchedulerOutput
from mmengine.core.request import Request
from mmengine.sample.structured_output.masks import BitmaskFiller, apply_token_bitmask

logger = logging.getLogger(__name__)


class ModelRunner:
    follows_drafts_on_device = True  # a step may be launched before a draft head's step is read (follow_drafts.py)

    def __init__(
        self,
        config: EngineConfig,
        family: ModelFamily,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache_config.block_size
        self.max_model_len = max_model_len
        self.family = family
        self.text_config = family.text_config
        quantization = quantization_of(family.hf_config)
        # int4 and FP8 weights stay quantized for their GEMMs where the fused kernels run (not under LoRA,
        # which wraps the dense projections); elsewhere they are dequantized at load. Kept quantized, the
        # model is built with its parameters on meta and the projections' dense weights never take memory.
        packed: dict | None = {} if quantization is not None and not config.lora_config.enable_lora and \
            use_fused_kernels(device, get_attention_backend(config.execution_config.attn_backend, device).name) else None
        with torch.device(device), default_dtype(dtype), parameters_on_meta() if packed is not None else contextlib.nullcontext():
            self.model = family.model_class(family.hf_config)
        if packed is not None:
            self.model.defer_quantizable_weights(device)
        if family.num_draft_layers:  # speculative decoding with the checkpoint's MTP head (dense, never deferred)
            with torch.device(device), default_dtype(dtype):
                self.model.enable_mtp(family.num_draft_layers)
        self.model.load_weights(iter_checkpoint(model_dir), quantization, packed)
        self.num_quantized_projections = self.model.use_quantized_weights(packed) if packed is not None else 0
        self.kv_dtype = config.resolve_kv_cache_dtype(dtype)
        self.model.eval()
        # LoRA slots are allocated here, before the KV cache is sized, so its profile counts them.
        self.lora_context: LoRAContext | None = None
        self.vision_lora_context: ItemLoRAContext | None = None
        self.vision_lora_modules: dict[str, LoRALinear] = {}
        if config.lora_config.enable_lora:
            self.lora_context = self.model.language_model.enable_lora(config.lora_config.max_loras, config.lora_config.max_lora_rank)
            self.vision_lora_context, self.vision_lora_modules = self.model.enable_vision_lora(config.lora_config.max_loras, config.lora_config.max_lora_rank)
        self.attn_backend = get_attention_backend(config.execution_config.attn_backend, device)
        self._set_kv_scales()
        if self.lora_context is not None:
            self.lora_context.use_kernels = self.vision_lora_context.use_kernels = use_fused_kernels(device, self.attn_backend.name)
        self.sampler = Sampler(config.model_config.seed)
        self.encoder_outputs: dict[str, torch.Tensor] = {}  # the encoder cache's tensors, by mm_hash
        self.encoder_host_tier: EncoderHostTier | None = None  # where evicted outputs wait (set by the engine)
        self.on_encoded: Callable[[tuple[str, torch.Tensor]], None] | None = None  # told of each output the tower makes
        self.kv_cache: PagedKVTensors | None = None
        # Sliding-window layers' own pool (None: every cached layer keeps every token, in one pool)
        self.window_pool = self._plan_window_pool()
        self.num_window_blocks = 0
        # Hybrid models: each linear-attention layer's states, slots 0..max_num_seqs-1 live, then checkpoints,
        # then one scratch slot that a decode graph's padding rows write into
        self.recurrent_states: list[GatedDeltaStates] = []
        self.num_state_checkpoints = 0
        self._graph_state_slots: torch.Tensor | None = None  # a decode graph's slot per row, rewritten before each replay
        self._twin_saves: list[tuple[int, int]] = []  # (slot saved, slot that gets the same state) after this forward
        self.num_encoder_runs = 0  # items encoded
        # On a GPU, one-size items go through the tower in batches padded to a power of two: cuDNN
        # plans its attention and convolution per input shape (60-70 ms for each new image count on
        # an H100 at the LLaVA-1.5-7B shape), so start-up warms the few batch sizes there are.
        self.pad_encoder_batches = device.type == "cuda" and family.items_have_one_size
        self.num_cascade_steps = 0  # steps that ran cascade attention
        self.num_cascade_groups = 0  # shared-prefix groups over those steps
        self.num_cascade_tokens = 0  # query tokens that attended to a shared prefix in a group
        self.num_speculative_tokens = config.spec_config.num_speculative_tokens
        # A verify step samples every position of a request: its last token's and each draft's.
        max_sampled_rows = config.scheduler_config.max_num_seqs * (1 + self.num_speculative_tokens)
        self.inputs = InputBuffers(
            max_tokens=max(config.scheduler_config.max_num_batched_tokens, config.scheduler_config.max_num_seqs),
            max_reqs=config.scheduler_config.max_num_seqs,
            max_sampled_rows=max_sampled_rows,
            max_blocks_per_req=cdiv(max_model_len, self.block_size),
            block_size=self.block_size,
            vocab_size=self.text_config.vocab_size,
            device=device,
            position_channels=family.position_channels,
            cascade=self._cascade_policy(),
            lora=config.lora_config.enable_lora,
            windowed=self.window_pool is not None,
        )
        # (room for a draft head's drafts and their counts too: max_num_seqs * (k + 1) values more)
        self._readback = TokenReadback(2 * max_sampled_rows, device)
        self.grammar_masks = BitmaskFiller(self.text_config.vocab_size, max_sampled_rows, device)
        self.penalties = PenaltyState(self.text_config.vocab_size, device)
        self.decode_graphs: DecodeGraphs | None = None
        self.capturer_factory: Callable[[], GraphCapturer] = CudaGraphCapturer  # what capture_cuda_graphs() records with
        # The final hidden states of a graph step, at a fixed address (rows beyond the batch are padding).
        self._graph_hidden: torch.Tensor | None = None
        self._verify_columns: RecurrentColumns | None = None  # a hybrid model's verify graphs, by token column
        self._verify_metadata: dict[int, AttentionMetadata] = {}  # each verify graph's, for its host lists
        self.drafter: HeadDrafter | None = None
        if family.num_draft_layers:
            self.drafter = HeadDrafter(MtpHead(self), self.block_size, self.num_speculative_tokens)
        elif config.spec_config.method == "eagle3":
            self.drafter = HeadDrafter(Eagle3DraftHead(self, config.spec_config.draft_model), self.block_size,
                                       self.num_speculative_tokens)

    def _cascade_policy(self) -> CascadePolicy:
        """"auto" weighs cascade against the Triton kernels; the PyTorch reference runs it on "on" only."""
        mode = self.config.execution_config.cascade_attention
        if mode == "auto" and self.attn_backend.name != "triton":
            mode = "off"
        shape = cascade_layer_shape(self.text_config.num_attention_heads, self.family.kv_cache_layout(),
                                    self.family.kv_cache_windows(), self.kv_element_bytes)
        sm_count = getattr(self.attn_backend, "sm_count", None)
        return CascadePolicy(
            mode=mode,
            block_size=self.block_size,
            tokens_per_tile=shape.tokens_per_tile,
            kv_bytes_per_token=shape.kv_bytes_per_token,
            num_kv_heads=shape.num_kv_heads,
            num_sms=sm_count(self.device) if sm_count is not None else 8,
        )

    # -- KV cache -----------------------------------------------------------

    def _set_kv_scales(self) -> None:
        scaled = self.model.apply_kv_scales() if is_fp8(self.kv_dtype) else 0
        if is_fp8(self.kv_dtype) and scaled < self.family.num_attention_layers:
            logger.warning("kv_cache_dtype=%r: the checkpoint has K/V scales for %d of %d attention layers; the others "
                           "use 1.0 (values beyond +-448 saturate)", self.config.cache_config.kv_cache_dtype, scaled,
                           self.family.num_attention_layers)
        elif not is_fp8(self.kv_dtype) and self.model.kv_scales:
            logger.info("the checkpoint's K/V scales apply to kv_cache_dtype='fp8' only; the cache is %s", self.kv_dtype)

    @property
    def num_kv_heads(self) -> int:
        """KV heads of the cached layers (the most, where layers differ)."""
        return max(heads for heads, _ in self.family.kv_cache_layout())

    @property
    def kv_element_bytes(self) -> int:
        return torch.empty((), dtype=self.kv_dtype).element_size()

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of a block of the full-attention pool (of every cached layer, without a window pool)."""
        return kv_block_bytes(self._pool_layout(windowed=False), self.block_size, self.kv_element_bytes)

    @property
    def window_block_bytes(self) -> int:
        """Bytes of a block of the sliding-window pool (0 without one)."""
        return kv_block_bytes(self._pool_layout(windowed=True), self.block_size, self.kv_element_bytes)

    def _windowed_layers(self) -> list[bool]:
        return [self.window_pool is not None and window is not None for window in self.family.kv_cache_windows()]

    def _pool_layout(self, windowed: bool) -> list[tuple[int, int]]:
        return [shape for shape, w in zip(self.family.kv_cache_layout(), self._windowed_layers()) if w == windowed]

    def _plan_window_pool(self) -> WindowPool | None:
        """The sliding-window layers' pool, when they have one window shorter than max_model_len (and the
        config does not keep every token's K/V everywhere)."""
        windows = {w for w in self.family.kv_cache_windows() if w is not None}
        if self.config.cache_config.sliding_kv_ratio is None or len(windows) != 1 or min(windows) >= self.max_model_len:
            if len(windows) > 1:
                logger.info("sliding windows of %s tokens: every cached layer keeps every token", sorted(windows))
            return None
        return WindowPool.plan(min(windows), self.config.cache_config.sliding_kv_ratio, self.block_size,
                               self.config.scheduler_config.max_num_batched_tokens, self.max_model_len)

    @property
    def state_slot_bytes(self) -> int:
        """Bytes of one recurrent state (every linear-attention layer's): a live state or a checkpoint."""
        shape = self.family.recurrent_shape
        if shape is None:
            return 0
        return self.family.num_recurrent_layers * shape.state_bytes(torch.empty((), dtype=self.dtype).element_size())

    def _reserve_state_memory(self, available: int) -> int:
        """Hybrid models: takes the live states and the checkpoints out of `available` (cache memory);
        sets num_state_checkpoints and returns what is left for the KV cache."""
        slot = self.state_slot_bytes
        if slot == 0:
            return available
        # the live states, each with a state per draft position (speculative decoding), and the scratch slot
        available -= (self.config.scheduler_config.max_num_seqs * (1 + self.num_speculative_tokens) + 1) * slot
        if not self.config.cache_config.enable_prefix_caching:
            self.num_state_checkpoints = 0
        elif self.config.cache_config.num_state_checkpoints is not None:
            self.num_state_checkpoints = self.config.cache_config.num_state_checkpoints
        else:
            self.num_state_checkpoints = max(0, int(available * self.config.cache_config.state_checkpoint_memory_fraction) // slot)
        return available - self.num_state_checkpoints * slot

    @property
    def embedding_bytes(self) -> int:
        """Bytes of one encoder output row (one image placeholder's embedding, with its DeepStack levels)."""
        return self.family.embedding_width * torch.empty((), dtype=self.dtype).element_size()

    def determine_num_kv_blocks(self, encoder_fixed_bytes: int, encoder_bytes_per_block: int, images_per_step: int,
                                encoder_budget_tokens: int = 0) -> int:
        """KV blocks that fit in the memory left after the encoder cache's fixed part; each block
        also pays for its share of the encoder cache's pinned room."""
        useful = self.config.scheduler_config.max_num_seqs * cdiv(self.max_model_len, self.block_size)
        if self.device.type == "cuda":
            available = self._profile_kv_cache_bytes(images_per_step, encoder_budget_tokens)
        else:
            available = self.config.cache_config.cpu_kv_cache_bytes
        available = self._reserve_state_memory(available)
        per_block = self.kv_block_bytes + encoder_bytes_per_block
        num_blocks, self.num_window_blocks = split_kv_memory(available - encoder_fixed_bytes, per_block,
                                                             self.window_block_bytes, self.window_pool, useful)
        if self.config.cache_config.num_kv_blocks is not None:
            cuda = self.device.type == "cuda"  # on a GPU a cap within the memory; on CPU the count
            num_blocks = min(num_blocks, self.config.cache_config.num_kv_blocks) if cuda else self.config.cache_config.num_kv_blocks
            if self.window_pool is not None:
                wanted = self.window_pool.blocks_for(num_blocks)
                self.num_window_blocks = min(self.num_window_blocks, wanted) if cuda else wanted
        if num_blocks < 1 or (self.window_pool is not None and self.num_window_blocks < self.window_pool.min_blocks):
            raise ConfigError(
                f"no memory left for the KV cache ({available} bytes available, {encoder_fixed_bytes} for the encoder "
                f"cache, {per_block} bytes per block"
                + (f", {self.window_pool.min_blocks} sliding-window blocks of {self.window_block_bytes} bytes at least)"
                   if self.window_pool is not None else ")")
            )
        return int(num_blocks)

    def allocate_kv_cache(self, num_blocks: int, num_state_slots: int | None = None, num_window_blocks: int | None = None) -> None:
        """The KV cache of `num_blocks` blocks (and num_window_blocks for the sliding-window layers; None:
        num_window_blocks as determined) and, for a hybrid model, its recurrent states (None: max_num_seqs
        live slots, num_state_checkpoints, one scratch slot)."""
        window_blocks = self.num_window_blocks if num_window_blocks is None else num_window_blocks
        self.kv_cache = PagedKVTensors(self.family.kv_cache_layout(), num_blocks, self.block_size, self.kv_dtype, self.device,
                                       self._windowed_layers(), window_blocks)
        self._bind_kv_cache(self.kv_cache)
        recurrent = self.family.recurrent_shape
        if recurrent is not None:
            max_num_seqs = self.config.scheduler_config.max_num_seqs
            slots = num_state_slots or max_num_seqs * (1 + self.num_speculative_tokens) + self.num_state_checkpoints + 1
            self.recurrent_states = []  # the old ones go first (the profiling run's)
            for layer in self.model.language_model.linear_layers():
                layer.states = GatedDeltaStates(recurrent, slots, self.device, self.dtype)
                self.recurrent_states.append(layer.states)

    def _bind_kv_cache(self, kv_cache: PagedKVTensors) -> None:
        draft_layers = self.drafter.head.attention_layers() if self.drafter is not None else []
        for i, attn in enumerate(self.model.language_model.attention_layers() + draft_layers):
            attn.kv_cache = kv_cache[i]
            attn.layer_index = i
            attn.backend = self.attn_backend

    def profile_encoder_batches(self, images_per_step: int, encoder_budget_tokens: int) -> list[list]:
        """What the profiling run encodes: a step's worth of the largest pictures and, for a family that
        takes audio, a step's worth (of the encoder budget) of the longest clips (a tower of its own,
        which may take more memory than the pictures' batch)."""
        batches = [self.family.dummy_items(images_per_step)] if images_per_step > 0 else []
        if "audio" in self.family.max_tokens_by_modality() and self.config.multimodal_config.limit_mm_per_prompt.get("audio", 0) > 0:
            per_clip = self.family.max_tokens_per_item({"audio": 1}, self.config.multimodal_config.max_audio_seconds)
            clips = self.family.dummy_audio_items(max(1, encoder_budget_tokens // per_clip), self.config.multimodal_config.max_audio_seconds)
            if clips:
                batches.append(clips)
        return batches

    def _profile_kv_cache_bytes(self, images_per_step: int, encoder_budget_tokens: int) -> int:
        """Runs the largest step once (a full token budget, a full encoder budget, sampling for
        every sequence) and captures the decode graphs over a scratch cache; returns what is left
        for the KV cache under gpu_memory_utilization."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        num_tokens = min(self.config.scheduler_config.max_num_batched_tokens, self.max_model_len)
        num_blocks = cdiv(num_tokens, self.block_size)
        self.allocate_kv_cache(num_blocks, num_state_slots=1, num_window_blocks=num_blocks)  # both pools: one block table
        with torch.inference_mode():
            for batch in self.profile_encoder_batches(images_per_step, encoder_budget_tokens):
                self.model.encode_items(batch)
            metadata = AttentionMetadata.build(
                query_lens=[num_tokens], seq_lens=[num_tokens], block_tables=[list(range(num_blocks))],
                slot_mapping=torch.arange(num_tokens), device=self.device,
            )
            if self.recurrent_states:
                metadata.recurrent = RecurrentStep([0, num_tokens], [0])
            ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
            hidden = self.model(self.model.embed_tokens(ids), self._plain_positions(num_tokens), metadata, input_ids=ids)
            rows = min(self.config.scheduler_config.max_num_seqs, num_tokens)
            logits = self.model.compute_logits(hidden[-rows:])
            del hidden
            params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * rows
            self.sampler(logits, params, [None] * rows)
            del logits
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        graph_bytes = 0
        if self.use_cuda_graphs:
            graph_bytes = self.capture_cuda_graphs().memory_bytes
            self.release_cuda_graphs()
        self.kv_cache = None
        for layer in self.model.language_model.linear_layers() if self.recurrent_states else ():
            layer.states = None
        self.recurrent_states = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        available = int(total * self.config.cache_config.gpu_memory_utilization) - peak - non_torch - graph_bytes
        logger.info(
            "KV cache profile: total %d, peak %d, non-torch %d, CUDA graphs %d -> %d bytes for KV",
            total, peak, non_torch, graph_bytes, available,
        )
        return max(available, 0)

    def _plain_positions(self, num_tokens: int) -> torch.Tensor:
        """Positions 0..n-1 in the family's layout ([n], or [n, 3] with M-RoPE)."""
        positions = torch.arange(num_tokens, device=self.device)
        channels = self.family.position_channels
        return positions if channels == 1 else positions[:, None].expand(num_tokens, channels).contiguous()

    # -- CUDA graphs and warm-up ----------------------------------------------

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs on CUDA with the Triton kernels, unless enforce_eager."""
        return not self.config.execution_config.enforce_eager and self.device.type == "cuda" and self.attn_backend.name == "triton"

    def plan_cuda_graphs(self) -> DecodeGraphs:
        """The graphs a capture records (none captured yet): buckets and variants, from the config alone, so
        every tensor-parallel rank plans the same ones in the same order."""
        sizes = graph_batch_sizes(self.config.scheduler_config.max_num_seqs, self.config.execution_config.max_cuda_graph_batch_size)
        query_len = 1 + self.num_speculative_tokens
        verify_sizes = verify_graph_sizes(sizes, query_len, self.inputs.max_tokens) if query_len > 1 else []
        # The cascade variants read their groups from device buffers, as only the Triton kernels do.
        with_cascade = self.inputs.cascade is not None and self.attn_backend.name == "triton"
        cascade_sizes = [size for size in sizes if size >= 2] if with_cascade else []
        return DecodeGraphs(sizes, cascade_sizes, lora_sizes=sizes if self.lora_context is not None else [],
                            verify_sizes=verify_sizes, verify_query_len=query_len)

    def capture_cuda_graphs(self, capturer: GraphCapturer | None = None) -> CaptureReport:
        """Captures one decode step per batch-size bucket over the bound KV cache and the
        persistent input buffers. `capturer` defaults to `capturer_factory()`: real CUDA graphs (tests pass a
        stand-in; a tensor-parallel rank's factory captures its collectives)."""
        assert self.kv_cache is not None, "allocate the KV cache before capturing"
        graphs = self.plan_cuda_graphs()
        sizes, verify_sizes, query_len, cascade_sizes = graphs.sizes, graphs.verify_sizes, graphs.verify_query_len, graphs.cascade_sizes
        rows = max(max(sizes), max(verify_sizes, default=0) * query_len)
        self._graph_hidden = torch.zeros(rows, self.text_config.hidden_size, dtype=self.dtype, device=self.device)
        if self.recurrent_states:
            self._graph_state_slots = torch.full((max(sizes),), self._scratch_state_slot, dtype=torch.long, device=self.device)
            if verify_sizes:
                self._verify_columns = RecurrentColumns(max(verify_sizes), query_len, self._scratch_state_slot, self.device)
        with torch.inference_mode():
            report = graphs.capture_all(self._decode_step, capturer or self.capturer_factory(), self.device, self._verify_step)
        if self.lora_context is not None:
            self.lora_context.segments = None
        self.decode_graphs = graphs
        logger.info(
            "captured %d decode graphs (batch sizes %d..%d, %d with a cascade variant) and %d verify graphs of %d tokens a "
            "request in %.2f s using %.1f MiB", len(sizes), sizes[0], sizes[-1], len(cascade_sizes), len(verify_sizes),
            query_len, report.seconds, report.memory_bytes / 2**20,
        )
        return report

    def release_cuda_graphs(self) -> None:
        self.decode_graphs = None
        self._graph_hidden = None
        self._graph_state_slots = None
        self._verify_columns = None
        self._verify_metadata.clear()
        self.inputs.cascade_graph_bounds.clear()

    def _verify_step(self, size: int) -> Callable[[], None]:
        """A verify step of `size` requests of up to 1 + num_speculative_tokens tokens over the persistent
        buffers (runner/verify_graphs.py), writing the final hidden states into the static output."""
        query_len = 1 + self.num_speculative_tokens
        num_tokens = size * query_len
        self.inputs.fill_dummy_decode(size, query_len)
        buffers = self.inputs
        metadata = verify_metadata(
            size, query_len, buffers.slot_mapping.device[:num_tokens], buffers.query_start_loc.device[: size + 1],
            buffers.seq_lens.device[:size], buffers.block_tables.device[:size],
            buffers.window_slot_mapping.device[:num_tokens] if buffers.windowed else None,
            buffers.window_block_tables.device[:size] if buffers.windowed else None,
        )
        if self.recurrent_states:
            self._verify_columns.fill_padding(size)
            metadata.recurrent = RecurrentStep([0], [], graph_columns=self._verify_columns.views(size))
        self._verify_metadata[size] = metadata
        input_ids, positions = buffers.input_ids.device[:num_tokens], buffers.positions.device[:num_tokens]
        hidden_out = self._graph_hidden[:num_tokens]
        context = self.lora_context

        def step() -> None:
            if context is not None:
                context.segments = None  # verify graphs have no LoRA variant: a step with adapters runs eager
            hidden_out.copy_(self.model(self.model.embed_tokens(input_ids), positions, metadata, input_ids=input_ids))

        return step

    def _decode_step(self, size: int, cascade: bool = False, lora: bool = False) -> Callable[[], None]:
        """A decode step of `size` rows over the persistent buffers, writing the final hidden states
        into the static output. Everything the launches depend on is fixed per size: the decode
        attention's split count, a context bound of max_model_len and, for the cascade variant, the
        prefix pass's grids (runner/cascade_plan.py's GraphBounds)."""
        self.inputs.fill_dummy_decode(size)
        splits = None
        if hasattr(self.attn_backend, "choose_num_splits"):
            splits = self.attn_backend.choose_num_splits(size, self.num_kv_heads, self.max_model_len, self.device)
        buffers = self.inputs
        metadata = AttentionMetadata(
            slot_mapping=buffers.slot_mapping.device[:size],
            query_start_loc=buffers.query_start_loc.device[: size + 1],
            seq_lens=buffers.seq_lens.device[:size],
            block_tables=buffers.block_tables.device[:size],
            window_slot_mapping=buffers.window_slot_mapping.device[:size] if buffers.windowed else None,
            window_block_tables=buffers.window_block_tables.device[:size] if buffers.windowed else None,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
            query_start_loc_cpu=list(range(size + 1)),
            num_decodes=size,
            max_decode_seq_len=self.max_model_len,
            max_prefill_query_len=0,
            decode_num_splits=splits,
            cascade=self.inputs.cascade_graph_metadata(size, self.inputs.cascade.graph_bounds(size, self.max_model_len))
            if cascade else None,
        )
        if self.recurrent_states:
            self._graph_state_slots.fill_(self._scratch_state_slot)
            metadata.recurrent = RecurrentStep(list(range(size + 1)), [], decode_slots=self._graph_state_slots[:size])
        input_ids, positions = buffers.input_ids.device[:size], buffers.positions.device[:size]
        hidden_out = self._graph_hidden[:size]
        context = self.lora_context
        segments = buffers.lora_graph_segments(size) if lora else None

        def step() -> None:
            if context is not None:  # read while the step is recorded (or, on the CPU stand-in, re-run)
                context.segments = segments
            hidden_out.copy_(self.model(self.model.embed_tokens(input_ids), positions, metadata, input_ids=input_ids))

        return step

    def warm_up(self, images_per_step: int = 0) -> None:
        """Compiles every kernel configuration an eager step can launch, so no request pays for a JIT: on a
        GPU, the attention kernels and the vision tower at each batch size a step can use. (On CPU the Triton
        kernels run in Triton's interpreter, which compiles nothing: warming them up only cost start-up time,
        about 1.7 s of CPU an engine or rank on the tiny LLaVA.)"""
        warm_up = getattr(self.attn_backend, "warm_up", None)
        if warm_up is not None and self.kv_cache is not None and self.device.type == "cuda":
            layers = self.model.language_model.attention_layers()
            spans = any(layer.bidirectional_spans for layer in layers)
            with torch.inference_mode():
                for layer in {(a.num_heads, a.head_dim, a.num_kv_heads): a for a in layers}.values():  # each shape once
                    warm_up(layer.num_heads, layer.head_dim, layer.kv_cache, self.max_model_len, self.dtype, bidirectional_spans=spans)
        self.warm_up_encoder(images_per_step)
        self.warm_up_lora()

    def warm_up_lora(self) -> int:
        """On a GPU, compiles the LoRA kernels for each projection's shapes, for decode rows and for
        prefill chunks (their tile sizes differ), so the first adapter request pays no JIT. Returns
        how many shapes were warmed."""
        context = self.lora_context
        if context is None or not context.use_kernels or self.device.type != "cuda":
            return 0
        shapes = {}
        for _, module in self.model.language_model.lora_modules():
            shapes.setdefault((module.in_features, module.lora_a.shape[1], module.out_features), module)
        with torch.inference_mode():
            for module in shapes.values():
                for length in (1, 17):  # the decode tile and the prefill tile
                    x = torch.zeros(length, module.in_features, dtype=self.dtype, device=self.device)
                    y = torch.zeros(length, module.out_features, dtype=self.dtype, device=self.device)
                    add_lora(y, x, module.lora_a, module.lora_b, LoRASegments.build([0], [length], [0], self.device), True)
        return len(shapes)

    def warm_up_encoder(self, images_per_step: int) -> list[int]:
        """Runs the vision tower once at every padded batch size a step of up to images_per_step
        images can use; returns those sizes (none when batches are not padded: other shapes are
        not known ahead)."""
        if not self.pad_encoder_batches or images_per_step < 1:
            return []
        sizes = [1 << i for i in range(encoder_batch_size(images_per_step).bit_length())]
        for size in sizes:
            self.model.encode_items(self.family.dummy_items(size))
        return sizes

    # -- one step -----------------------------------------------------------

    def execute(self, out: SchedulerOutput, block_tables: dict[str, list[int]],
                window_tables: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
        """Runs one step and returns the sampled tokens of every request whose step reached its last token."""
        return self.launch(out, block_tables, window_tables=window_tables).result()

    @torch.inference_mode()
    def launch(
        self, out: SchedulerOutput, block_tables: dict[str, list[int]], previous: LaunchedStep | None = None,
        window_tables: dict[str, list[int]] | None = None,
    ) -> LaunchedStep:
        """Queues one step on the device without waiting for it; result() reads its tokens.
        A decode whose input is a placeholder (async scheduling) takes `previous`'s token on the device.
        `window_tables`: each request's sliding-window pool blocks (with a window pool)."""
        if self.drafter is not None:
            self.drafter.forget()
        for source, target in out.state_copies:  # checkpoints of rows launched ahead, before anything overwrites them
            for states in self.recurrent_states:
                states.copy(source, target)
        self._restore_encoder_outputs(out.scheduled)  # before the evicted go to the host tier (they may push these out)
        self.free_encoder_outputs(out.freed_encoder_hashes, out.stale_encoder_hashes)
        self._run_encoder(out.scheduled, out.encoder_lora_slots)
        scheduled = [s for s in out.scheduled if s.num_new_tokens > 0]  # zero-token requests just wait
        if not scheduled:
            return NOTHING_SAMPLED
        graph_size, graph_query_len = self._graph_size_for(scheduled)
        inputs = self.inputs.prepare(scheduled, block_tables, graph_size, previous.token_rows() if previous else None,
                                     lora_slots=out.lora_slots, window_tables=window_tables, graph_query_len=graph_query_len,
                                     moved_on_device=previous is not None and previous.device_drafts is not None)
        if self.lora_context is not None and inputs.graph_size is None:
            self.lora_context.segments = self._lora_segments(inputs.scheduled, out.lora_slots)
        shifts, max_shift = None, 0
        if inputs.deferred_rows is not None and previous.device_drafts is not None:  # launched ahead of a draft head's step
            shifts, max_shift = follow_drafts(inputs, previous.tokens, previous.device_drafts, self.block_size,
                                              self.recurrent_states, self.device.type == "cpu" or self.attn_backend.name != "triton")
        elif inputs.deferred_rows is not None:
            inputs.input_ids.index_copy_(0, inputs.deferred_rows, previous.tokens.index_select(0, inputs.deferred_sources))
        if inputs.cascade_groups:
            self.num_cascade_steps += 1
            self.num_cascade_groups += len(inputs.cascade_groups)
            self.num_cascade_tokens += inputs.metadata.cascade.num_tokens
        if self.recurrent_states:
            inputs.metadata.recurrent = self._recurrent_step(inputs.scheduled, inputs.metadata.query_start_loc_cpu)
        if self.family.bidirectional_modalities and inputs.graph_size is None:
            inputs.metadata.span_ends = span_ends(inputs.scheduled, self.family.bidirectional_modalities, self.device)
        if inputs.graph_size is not None and inputs.graph_query_len > 1:
            self._replay_verify(inputs)
            hidden = self._graph_hidden
        elif inputs.graph_size is not None:
            if self.recurrent_states:
                self._set_graph_state_slots(inputs.scheduled, inputs.graph_size)
            self.decode_graphs.replay(inputs.graph_size, inputs.graph_cascade, inputs.graph_lora)
            hidden = self._graph_hidden
            for s in inputs.scheduled if self.recurrent_states else ():
                for _, target in s.state.saves:  # a decode saves after its one token
                    for states in self.recurrent_states:
                        states.copy(s.state.slot, target)
        else:
            embeds, deepstack = self._embed(inputs.input_ids, inputs.scheduled)
            hidden = self.model(embeds, inputs.positions, inputs.metadata, deepstack, input_ids=inputs.input_ids)
            if self._twin_saves:
                self._copy_twin_saves()
        if self.drafter is not None:
            self.drafter.remember(hidden, inputs, block_tables, out.draft_depths, shifts, max_shift)
        prompt_logprobs = self._prompt_logprobs(hidden, inputs.scheduled)
        if not inputs.sampled:
            if self.drafter is not None:  # the head's pass over the chunk: its K/V
                self.drafter.draft(None, [])
            return LaunchedStep([], None, None, None, prompt_logprobs=prompt_logprobs) if prompt_logprobs else NOTHING_SAMPLED
        pending = PendingSample(self.model.compute_logits(hidden[inputs.logits_indices]), inputs.sampled, inputs.sampling,
                                prompt_logprobs)
        if any(s.draft_token_ids and s.request.sampling_params.penalized for s in inputs.sampled):
            pending.input_ids = inputs.input_ids.index_select(0, inputs.logits_indices)
        if any(s.request.grammar is not None for s in inputs.sampled):
            # The masks need every token sampled so far: the engine calls sample() once the grammars
            # have them (with async scheduling, after reading the previous step's tokens, while this
            # step's forward runs on the device).
            return LaunchedStep([s.request.request_id for s in inputs.sampled], None, None, None, pending=pending)
        return self.sample(pending)

    def _replay_verify(self, inputs) -> None:
        """Replays the verify graph of the step's size; then a hybrid model's checkpoints inside the step
        are copied from the states the graph kept (runner/verify_graphs.py)."""
        size = inputs.graph_size
        refresh_host_lists(self._verify_metadata[size], inputs.metadata)
        if self.recurrent_states:
            self._twin_saves = []  # the eager forward's: the graph keeps every draft state itself
            self._verify_columns.fill(inputs.scheduled, inputs.metadata.query_start_loc_cpu, size)
        self.decode_graphs.replay_verify(size)
        for s in inputs.scheduled if self.recurrent_states else ():
            for position, target in s.state.saves:
                source = state_source(s, position)
                for states in self.recurrent_states:
                    states.copy(source, target)

    def _recurrent_step(self, scheduled: list[ScheduledRequest], query_start_loc: list[int]) -> RecurrentStep:
        """Starts each admitted request's live state (zeros, or a checkpoint copied in), then describes
        the step to the linear-attention layers: slots and saves in packed order."""
        for s in scheduled:
            plan = s.state
            if plan.reset or plan.restore_from is not None:
                for states in self.recurrent_states:
                    if plan.reset:
                        states.reset(plan.slot)
                    else:
                        states.copy(plan.restore_from, plan.slot)
        saves, self._twin_saves = [], []
        for s in scheduled:
            offsets: list[tuple[int, int]] = []
            for position, slot in sorted(s.state.saves + s.state.draft_saves):
                if offsets and offsets[-1][0] == position - s.start:  # a checkpoint and a draft state at one position
                    self._twin_saves.append((offsets[-1][1], slot))
                else:
                    offsets.append((position - s.start, slot))
            saves.append(offsets)
        stepwise = frozenset(i for i, s in enumerate(scheduled) if s.state.draft_saves)  # verify steps: token by token
        return RecurrentStep(query_start_loc[: len(scheduled) + 1], [s.state.slot for s in scheduled], saves, stepwise=stepwise)

    def _copy_twin_saves(self) -> None:
        """After the forward: the second slot of each position saved twice gets the first's state."""
        for source, target in self._twin_saves:
            for states in self.recurrent_states:
                states.copy(source, target)
        self._twin_saves = []

    @property
    def _scratch_state_slot(self) -> int:
        return self.recurrent_states[0].conv.shape[0] - 1

    def _set_graph_state_slots(self, scheduled: list[ScheduledRequest], graph_size: int) -> None:
        """Each row's live slot for the graph step (padding rows: the scratch slot). Copied from a fresh
        host tensor, which the copy has read when it returns, so the next step may rewrite nothing early."""
        slots = [s.state.slot for s in scheduled] + [self._scratch_state_slot] * (graph_size - len(scheduled))
        self._graph_state_slots[:graph_size].copy_(torch.tensor(slots, dtype=torch.long))

    def _device_longs(self, values: list[int]) -> torch.Tensor:
        """A small int64 tensor on the device without waiting for it: a blocking copy would wait for
        the step's forward, which is still running when sampling is prepared."""
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)

    def _prompt_logprobs(self, hidden: torch.Tensor, scheduled: list[ScheduledRequest]) -> list[PromptLogprobs]:
        """For the requests that asked (SamplingParams.prompt_logprobs): the log-probability of each
        prompt token this step's chunk predicts (the token after each position), and the best k."""
        found, row = [], 0
        for s in scheduled:
            request, k = s.request, s.request.sampling_params.prompt_logprobs
            last = min(s.end, request.num_prompt_tokens - 1)  # the last prompt position predicts the first output
            if k is not None and last > s.start:
                logits = self.model.compute_logits(hidden[row : row + last - s.start])
                targets = self._device_longs(request.prompt_token_ids[s.start + 1 : last + 1])
                found.append(PromptLogprobs(request, s.start + 1, targets, *token_logprobs(logits, targets, k), k))
            row += s.num_new_tokens
        return found

    @torch.inference_mode()
    def sample(self, pending: PendingSample | LaunchedStep) -> LaunchedStep:
        """Samples a launched step's logits (under each constrained row's grammar mask) and starts
        the copy of its tokens to the host."""
        if isinstance(pending, LaunchedStep):
            pending = pending.pending
        logits, sampled = pending.logits, pending.sampled
        constrained = [row for row, s in enumerate(sampled) if s.request.grammar is not None]
        drafts_before = _drafts_before_rows(sampled) if any(s.draft_token_ids for s in sampled) else None
        if constrained:
            drafts_before = drafts_before or _drafts_before_rows(sampled)
            bitmask = self.grammar_masks.fill([sampled[row].request.grammar for row in constrained],
                                              [drafts_before[row] for row in constrained])
            rows = self._device_longs(constrained)
            logits = apply_token_bitmask(logits, rows, bitmask.to(self.device, non_blocking=True))
        params = [s.request.sampling_params for s in sampled]
        biased = [(row, p.logit_bias) for row, p in enumerate(params) if p.logit_bias]
        if biased:
            logits = apply_logit_bias(logits, biased)
        # A finished request's row here is the extra step of async scheduling, whose token is dropped.
        penalized = [row for row, p in enumerate(params) if p.penalized and not sampled[row].request.is_finished]
        if penalized:
            batch_rows = self._device_longs(penalized)
            state_rows = self._device_longs([self.penalties.row_of(sampled[row].request.request_id,
                                                                   sampled[row].request.prompt_token_ids) for row in penalized])
            columns = [[params[row].presence_penalty for row in penalized], [params[row].frequency_penalty for row in penalized],
                       [params[row].repetition_penalty for row in penalized]]
            presence, frequency, repetition = torch.tensor(columns, dtype=torch.float32).to(self.device, non_blocking=True)
            # a verify row counts the drafts before it as output, as the device holds them (a row launched ahead
            # has placeholders on the host); its request's kept run is counted once known (with a draft head on the
            # device, _count_kept_runs; else count_kept_tokens, once booked), the others' tokens as they are sampled
            logits = self.penalties.apply(logits, batch_rows, state_rows, presence, frequency, repetition,
                                          self._penalty_draft_counts(pending.input_ids, penalized, drafts_before))
        tokens = self.sampler(logits, params, [s.request.generator for s in sampled], pending.sampling)
        if penalized:
            plain = [i for i, row in enumerate(penalized) if not sampled[row].draft_token_ids]
            if len(plain) == len(penalized):
                self.penalties.count(state_rows, tokens.index_select(0, batch_rows))
            elif plain:
                index = self._device_longs(plain)
                self.penalties.count(state_rows.index_select(0, index), tokens.index_select(0, batch_rows.index_select(0, index)))
        # a draft head drafts now, on the device, so the drafts come back with the tokens (runner/head_drafter.py)
        drafts = self.drafter.draft(tokens, sampled) if self.drafter is not None else None
        if penalized and drafts is not None and drafts_before is not None:
            self._count_kept_runs(tokens, sampled, penalized, batch_rows, state_rows, drafts_before, drafts)
        launched = self._readback.start([s.request.request_id for s in sampled], tokens, drafts)
        launched.prompt_logprobs = pending.prompt_logprobs
        asked = [row for row, p in enumerate(params) if p.logprobs is not None]
        if asked:  # read back with the tokens (the copy waits for them anyway)
            ks = [params[row].logprobs for row in asked]
            index = self._device_longs(asked)
            launched.logprobs = (asked, *token_logprobs(logits.index_select(0, index), tokens.index_select(0, index), max(ks)), ks)
        return launched

    def _penalty_draft_counts(self, input_ids: torch.Tensor | None, penalized: list[int],
                              drafts_before: list[list[int]] | None) -> torch.Tensor | None:
        """[len(penalized), vocab] the drafts before each penalized row (the input tokens of the rows after its
        run's first, up to its own), counted on the device; None when no row comes after drafts."""
        pairs = [(i, row - back) for i, row in enumerate(penalized) for back in range(len(drafts_before[row]) if drafts_before else 0)]
        if not pairs:
            return None
        rows, sources = zip(*pairs)
        return self.penalties.tokens_counted(len(penalized), self._device_longs(list(rows)),
                                             input_ids.index_select(0, self._device_longs(list(sources))))

    def _count_kept_runs(self, tokens: torch.Tensor, sampled: list[ScheduledRequest], penalized: list[int],
                         batch_rows: torch.Tensor, state_rows: torch.Tensor, drafts_before: list[list[int]],
                         drafts: DeviceDrafts) -> None:
        """A draft head's penalized verify rows: the tokens of each kept run (its positions up to the accepted count,
        on the device) go into the request's counts now, so a step launched before this one is read penalizes by
        them. (A run that booking cuts ends its request, whose counts go.)"""
        verify = [i for i, row in enumerate(penalized) if sampled[row].draft_token_ids]
        if not verify:
            return
        order = {request_id: r for r, request_id in enumerate(drafts.request_ids)}
        index = self._device_longs(verify)
        accepted = drafts.accepted.index_select(0, self._device_longs([order[sampled[penalized[i]].request.request_id] for i in verify]))
        positions = self._device_longs([len(drafts_before[penalized[i]]) for i in verify])  # each row's place in its run
        self.penalties.count(state_rows.index_select(0, index), tokens.index_select(0, batch_rows.index_select(0, index)),
                             positions <= accepted)

    @torch.inference_mode()
    def count_kept_tokens(self, request: Request, tokens: list[int]) -> None:
        """A penalized request's tokens kept by a verify step, into its output counts."""
        row = self.penalties.row_of(request.request_id, request.prompt_token_ids)
        self.penalties.count(self._device_longs([row] * len(tokens)), self._device_longs(tokens))

    def _graph_size_for(self, scheduled: list[ScheduledRequest]) -> tuple[int | None, int]:
        """(graph bucket, tokens a request) for a batch of decodes and verifies whose tokens are all
        text: a decode graph's bucket when every request computes one token, a verify graph's when some
        verify drafts; (None, 1) otherwise (eager)."""
        graphs = self.decode_graphs
        if graphs is None:
            return None, 1
        for s in scheduled:
            items = s.request.mm_items
            if items and items[-1].end > s.start:  # the token may be an image placeholder
                return None, 1
        query_len = verify_query_len(scheduled, graphs.verify_query_len)
        if query_len is None:
            return None, 1
        if query_len == 1:
            return graphs.bucket_for(len(scheduled)), 1
        size = graphs.verify_bucket_for(len(scheduled))
        return (size, graphs.verify_query_len) if size is not None else (None, 1)

    def _lora_segments(self, scheduled: list[ScheduledRequest], slots: dict[str, int]) -> LoRASegments | None:
        """The packed batch's rows that run an adapter, one segment per request (None when there are none)."""
        if not slots:
            return None
        starts, lens, slot_ids, row = [], [], [], 0
        for s in scheduled:
            slot = slots.get(s.request.request_id)
            if slot is not None:
                starts.append(row)
                lens.append(s.num_new_tokens)
                slot_ids.append(slot)
            row += s.num_new_tokens
        return LoRASegments.build(starts, lens, slot_ids, self.device) if starts else None

    def load_lora_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Writes an adapter's weights into device slot `slot` of every projection (zeros where it has none)."""
        for layer, module in self.model.language_model.lora_modules():
            module.load_slot(slot, adapter.layer_pairs(layer, tuple(piece.name for piece in module.slices)))
        for name, module in self.vision_lora_modules.items():
            module.load_slot(slot, {name: adapter.vision_pairs[name]} if name in adapter.vision_pairs else {})

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], loaded: list[str]) -> None:
        """Copies new values into the model's parameters (in place: CUDA graphs read them), appending our
        name of each to `loaded`. Projections kept quantized for the fused kernels cannot be replaced."""
        if self.num_quantized_projections:
            raise ConfigError(f"update_weights: {self.num_quantized_projections} projections run on quantized "
                              "weights (FP8 or int4 kernels), which it does not replace")
        self.model.update_weights(weights, loaded)

    def clear_lora_slot(self, slot: int) -> None:
        for _, module in self.model.language_model.lora_modules():
            module.clear_slot(slot)
        for module in self.vision_lora_modules.values():
            module.clear_slot(slot)

    @torch.inference_mode()
    def copy_kv_blocks(self, offloads: list[KVCopy], restores: list[KVCopy]) -> None:
        """Queues the step's copies between the KV tiers before anything else of the step, batched: the
        evicted blocks gathered in one launch and copied to host memory, then the host-tier hits stacked
        and copied back in one transfer and one scatter."""
        if offloads:
            ids = torch.tensor([c.block_id for c in offloads]).to(self.device, non_blocking=True)
            gathered = self.kv_cache.gather_blocks(ids)  # per layer shape [layers, 2, n, block_size, heads, dim]
            pin = self.device.type == "cuda"
            for index, copy in enumerate(offloads):
                parts = []
                for group in gathered:
                    block = group[:, :, index]
                    host = torch.empty(block.shape, dtype=block.dtype, pin_memory=pin)
                    host.copy_(block, non_blocking=pin)  # its own buffer: an entry never keeps the batch alive
                    parts.append(host)
                copy.entry.kv, copy.done = parts, True
            if pin:
                copied = torch.cuda.Event()
                copied.record()
                for copy in offloads:
                    copy.entry.copied = copied
        if restores:
            ids = torch.tensor([c.block_id for c in restores]).to(self.device, non_blocking=True)
            for copy in restores:
                # a block offloaded a step or two ago (the host runs ahead of the device under async scheduling)
                # may still be on its way to host memory: the stack below reads it on the host
                if copy.entry.copied is not None:
                    copy.entry.copied.synchronize()
            stacked = [torch.stack([c.entry.kv[g] for c in restores], dim=2) for g in range(len(restores[0].entry.kv))]
            if self.device.type == "cuda":
                stacked = [part.pin_memory() for part in stacked]
            self.kv_cache.scatter_blocks(ids, stacked)
            for copy in restores:
                copy.done = True

    def free_encoder_outputs(self, mm_hashes: list[str], stale: list[str] = ()) -> None:
        """Drops evicted outputs from the device; the host tier, if any, keeps a copy of those not `stale`
        (made before a reset of the encoder cache)."""
        for mm_hash in mm_hashes:
            output = self.encoder_outputs.pop(mm_hash)
            if self.encoder_host_tier is not None and mm_hash not in stale:
                self.encoder_host_tier.store(mm_hash, output)

    def _restore_encoder_outputs(self, scheduled: list[ScheduledRequest]) -> None:
        """Copies the step's items that the host tier holds back to the device (queued, no wait)."""
        for s in scheduled:
            for idx in s.restored_items:
                mm_hash = s.request.mm_items[idx].mm_hash
                self.encoder_outputs[mm_hash] = self.encoder_host_tier.load(mm_hash, self.device)

    def _run_encoder(self, scheduled: list[ScheduledRequest], lora_slots: dict[str, int] | None = None) -> None:
        """Encodes the step's items; those of requests whose adapter changes the vision side
        (`lora_slots`) through their adapter's slot."""
        jobs = [(s.request, idx) for s in scheduled for idx in s.encoder_items]
        for req, idx in [job for job in jobs if "image_embeds" in job[0].mm_items[job[1]].encoder_inputs]:
            item = req.mm_items[idx]  # precomputed embeddings go straight into the cache: no tower run
            self.encoder_outputs[item.mm_hash] = item.encoder_inputs["image_embeds"].to(self.device, self.dtype, copy=True)
        jobs = [(req, idx) for req, idx in jobs if "image_embeds" not in req.mm_items[idx].encoder_inputs]
        # Padded batches hold pictures only (dummy_items' kind): other items (audio clips) go in a batch of their own
        padding = [self.pad_encoder_batches and req.mm_items[idx].modality == "image" for req, idx in jobs]
        padded = [job for job, pad in zip(jobs, padding) if pad]
        rest = [job for job, pad in zip(jobs, padding) if not pad]
        for group, pad in ((padded, True), (rest, False)):
            if group:
                self._encode_batch(group, pad, lora_slots)

    def _encode_batch(self, jobs: list[tuple[Request, int]], pad: bool, lora_slots: dict[str, int] | None) -> None:
        """Encodes items in one encode_items call (padded with dummy items to a warmed-up size when `pad`)."""
        inputs = [req.mm_items[idx].encoder_inputs for req, idx in jobs]
        if pad:
            inputs += self.family.dummy_items(encoder_batch_size(len(inputs)) - len(inputs))
        context = self.vision_lora_context
        if context is not None and lora_slots:
            slots = [lora_slots.get(req.request_id, -1) for req, _ in jobs] + [-1] * (len(inputs) - len(jobs))
            context.items = [(slot, self.model.encoder_rows(item)) for slot, item in zip(slots, inputs)]
        try:
            embeddings = self.model.encode_items(inputs)[: len(jobs)]
        finally:
            if context is not None:
                context.items = None
        for (req, idx), emb in zip(jobs, embeddings):
            item = req.mm_items[idx]
            if emb.shape[0] != item.length:
                raise RuntimeError(
                    f"the vision encoder produced {emb.shape[0]} embeddings for an item with {item.length} "
                    "placeholder tokens; the processor and model configs disagree"
                )
            # a copy: a view would keep the whole step's batch (padding included) alive while any one
            # of its items stays cached, past what the encoder cache counts
            self.encoder_outputs[item.mm_hash] = emb.to(self.dtype, copy=True)
            if self.on_encoded is not None:
                self.on_encoded((item.mm_hash, self.encoder_outputs[item.mm_hash]))
        self.num_encoder_runs += len(jobs)

    def _embed(self, input_ids: torch.Tensor, scheduled: list[ScheduledRequest],
               missing_ok: bool = False, table: torch.nn.Module | None = None) -> tuple[torch.Tensor, DeepStack | None]:
        """Text embeddings, with each image's embeddings written over its placeholder positions, and
        (Qwen3-VL) the DeepStack levels of those positions. `missing_ok`: an item not encoded yet keeps
        its placeholders' text embeddings (the MTP head's look one token ahead, maybe into the next chunk's).
        `table`: the text embeddings' table, when not the target's (an EAGLE-3 head's own)."""
        embeds = (table if table is not None else self.model.embed_tokens)(input_ids)
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        offset = 0
        for s in scheduled:
            for item in s.request.mm_items:
                if not item.overlaps(s.start, s.end):
                    continue
                lo, hi = max(s.start, item.offset), min(s.end, item.end)
                emb = self.encoder_outputs.get(item.mm_hash) if missing_ok else self.encoder_outputs[item.mm_hash]
                if emb is None:
                    continue
                src.append(emb[lo - item.offset : hi - item.offset])
                dst.append(torch.arange(offset + lo - s.start, offset + hi - s.start, device=self.device))
            offset += s.num_new_tokens
        if not dst:
            return embeds, None
        rows, values = torch.cat(dst), torch.cat(src).to(embeds.dtype)
        hidden = embeds.shape[1]
        embeds[rows] = values[:, :hidden]
        if values.shape[1] == hidden:
            return embeds, None
        return embeds, DeepStack(rows, values[:, hidden:].reshape(len(rows), -1, hidden).transpose(0, 1))


def _drafts_before_rows(sampled: list[ScheduledRequest]) -> list[list[int]]:
    """For each logits row, the drafts its position comes after: a verify step's rows are consecutive,
    the request's last token's first (none), then one per draft."""
    before: list[list[int]] = []
    for row, s in enumerate(sampled):
        index = len(before[-1]) + 1 if row and sampled[row - 1] is s else 0
        before.append(s.draft_token_ids[:index])
    return before


def encoder_batch_size(num_items: int) -> int:
    """The padded batch a step's one-size items go through the vision tower in: a power of two."""
    return 1 << (num_items - 1).bit_length()
