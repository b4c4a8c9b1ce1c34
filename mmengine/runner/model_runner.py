"""ModelRunner: scheduler output -> tensors -> vision encoder + decoder -> sampled tokens.

No policy here: the runner computes exactly what the scheduler asked for. A step fills the
persistent input buffers, replays a CUDA graph when the batch is decode-only (else runs eager),
samples on the device and copies the sampled tokens back without waiting: reading them
(LaunchedStep.result) is the step's only host sync, and with async scheduling the next step is
already queued by then.

ModelRunner loads the model and coordinates a step; each part of the work lives in a module of its own:
inputs.py (the input buffers), encoder_runs.py (the towers and their outputs), state_steps.py (a hybrid
model's states), graph_steps.py and cuda_graphs.py (CUDA graphs), step_sampling.py (logits -> tokens),
head_drafter.py and follow_drafts.py (draft heads), kv_memory.py, kv_tensors.py and kv_copies.py (the KV cache).
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
from mmengine.runner.kv_tensors import PagedKVTensors, kv_block_bytes
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
from mmengine.runner.verify_graphs import verify_graph_sizes, verify_query_len
from mmengine.runner.graph_steps import GraphSteps
from mmengine.runner.inputs import InputBuffers
from mmengine.runner.follow_drafts import follow_drafts
from mmengine.runner.head_drafter import Eagle3DraftHead, HeadDrafter, MtpHead
from mmengine.sample.penalties import PenaltyState
from mmengine.runner.spans import span_ends
from mmengine.runner.launched_step import NOTHING_SAMPLED, LaunchedStep, PendingSample, TokenReadback
from mmengine.runner import encoder_runs, kv_copies, kv_memory, state_steps, step_sampling
from mmengine.sample.params import SamplingParams
from mmengine.sample.sampler import Sampler
from mmengine.core.scheduler import ScheduledRequest, SchedulerOutput
from mmengine.core.request import Request
from mmengine.sample.structured_output.masks import BitmaskFiller

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
        self.window_pool = kv_memory.plan_window_pool(family.kv_cache_windows(), config.cache_config, self.block_size,
                                                      config.scheduler_config.max_num_batched_tokens, max_model_len)
        self.num_window_blocks = 0
        # Hybrid models: each linear-attention layer's states, slots 0..max_num_seqs-1 live, then checkpoints,
        # then one scratch slot that a decode graph's padding rows write into
        self.recurrent_states: list[GatedDeltaStates] = []
        self.num_state_checkpoints = 0
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
        self._graph_steps: GraphSteps | None = None  # what the captured graphs read and write (graph_steps.py)
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

    @property
    def state_slot_bytes(self) -> int:
        """Bytes of one recurrent state (every linear-attention layer's): a live state or a checkpoint."""
        shape = self.family.recurrent_shape
        if shape is None:
            return 0
        return self.family.num_recurrent_layers * shape.state_bytes(torch.empty((), dtype=self.dtype).element_size())

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
        # the live states, each with a state per draft position (speculative decoding), and the scratch slot
        live_slots = self.config.scheduler_config.max_num_seqs * (1 + self.num_speculative_tokens) + 1
        available, self.num_state_checkpoints = kv_memory.reserve_state_memory(available, self.state_slot_bytes, live_slots,
                                                                               self.config.cache_config)
        per_block = self.kv_block_bytes + encoder_bytes_per_block
        num_blocks, self.num_window_blocks = kv_memory.fit_kv_blocks(
            available, encoder_fixed_bytes, per_block, self.window_block_bytes, self.window_pool, useful,
            self.config.cache_config.num_kv_blocks, self.device.type == "cuda")
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
        """What the profiling run encodes (runner/encoder_runs.py)."""
        return encoder_runs.profile_encoder_batches(self.family, self.config.multimodal_config, images_per_step,
                                                    encoder_budget_tokens)

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
        steps = self._graph_steps = GraphSteps(
            self.model, self.inputs, self.attn_backend, self.lora_context, graphs, hidden_size=self.text_config.hidden_size,
            max_model_len=self.max_model_len, num_kv_heads=self.num_kv_heads, dtype=self.dtype, device=self.device,
            scratch_state_slot=self._scratch_state_slot if self.recurrent_states else None)
        with torch.inference_mode():
            report = graphs.capture_all(steps.decode_step, capturer or self.capturer_factory(), self.device, steps.verify_step)
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
        self._graph_steps = None
        self.inputs.cascade_graph_bounds.clear()

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
        sizes = encoder_runs.warm_up_sizes(images_per_step)
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
        # checkpoints of rows launched ahead, before anything overwrites them
        state_steps.copy_states(self.recurrent_states, out.state_copies)
        # the host tier's hits first, before the evicted go to it (they may push these out)
        encoder_runs.restore_encoder_outputs(self.encoder_outputs, self.encoder_host_tier, out.scheduled, self.device)
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
            hidden = self._graph_steps.hidden
        elif inputs.graph_size is not None:
            if self.recurrent_states:
                self._graph_steps.set_state_slots(inputs.scheduled, inputs.graph_size)
            self.decode_graphs.replay(inputs.graph_size, inputs.graph_cascade, inputs.graph_lora)
            hidden = self._graph_steps.hidden
            if self.recurrent_states:
                state_steps.copy_states(self.recurrent_states, state_steps.decode_graph_saves(inputs.scheduled))
        else:
            embeds, deepstack = self._embed(inputs.input_ids, inputs.scheduled)
            hidden = self.model(embeds, inputs.positions, inputs.metadata, deepstack, input_ids=inputs.input_ids)
            if self._twin_saves:  # the second slot of each position saved twice gets the first's state
                state_steps.copy_states(self.recurrent_states, self._twin_saves)
                self._twin_saves = []
        if self.drafter is not None:
            self.drafter.remember(hidden, inputs, block_tables, out.draft_depths, shifts, max_shift)
        prompt_logprobs = step_sampling.prompt_logprobs(self.model.compute_logits, hidden, inputs.scheduled, self.device)
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
        self._graph_steps.prepare_verify(inputs.metadata, inputs.scheduled, size)
        if self.recurrent_states:
            self._twin_saves = []  # the eager forward's: the graph keeps every draft state itself
        self.decode_graphs.replay_verify(size)
        if self.recurrent_states:
            state_steps.copy_states(self.recurrent_states, state_steps.verify_graph_saves(inputs.scheduled))

    def _recurrent_step(self, scheduled: list[ScheduledRequest], query_start_loc: list[int]) -> RecurrentStep:
        """Starts each admitted request's live state, then describes the step to the linear-attention layers
        (runner/state_steps.py); the twin saves wait for the forward."""
        state_steps.start_states(self.recurrent_states, scheduled)
        step, self._twin_saves = state_steps.describe_step(scheduled, query_start_loc)
        return step

    @property
    def _scratch_state_slot(self) -> int:
        return self.recurrent_states[0].conv.shape[0] - 1

    @torch.inference_mode()
    def sample(self, pending: PendingSample | LaunchedStep) -> LaunchedStep:
        """Samples a launched step's logits (under each constrained row's grammar mask) and starts
        the copy of its tokens to the host (runner/step_sampling.py)."""
        if isinstance(pending, LaunchedStep):
            pending = pending.pending
        return step_sampling.sample_step(pending, device=self.device, sampler=self.sampler, penalties=self.penalties,
                                         grammar_masks=self.grammar_masks, readback=self._readback, drafter=self.drafter)

    @torch.inference_mode()
    def count_kept_tokens(self, request: Request, tokens: list[int]) -> None:
        """A penalized request's tokens kept by a verify step, into its output counts."""
        step_sampling.count_kept_tokens(self.penalties, request, tokens, self.device)

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

    def copy_kv_blocks(self, offloads: list[KVCopy], restores: list[KVCopy]) -> None:
        """Queues the step's copies between the KV tiers before anything else of the step (runner/kv_copies.py)."""
        kv_copies.copy_kv_blocks(self.kv_cache, self.device, offloads, restores)

    def free_encoder_outputs(self, mm_hashes: list[str], stale: list[str] = ()) -> None:
        """Drops evicted outputs from the device; the host tier, if any, keeps a copy of those not `stale`
        (made before a reset of the encoder cache)."""
        encoder_runs.free_encoder_outputs(self.encoder_outputs, self.encoder_host_tier, mm_hashes, stale)

    def _run_encoder(self, scheduled: list[ScheduledRequest], lora_slots: dict[str, int] | None = None) -> None:
        """Encodes the step's items; those of requests whose adapter changes the vision side
        (`lora_slots`) through their adapter's slot."""
        self.num_encoder_runs += encoder_runs.run_encoder(
            self.model, self.family, self.encoder_outputs, scheduled, lora_slots, pad_batches=self.pad_encoder_batches,
            lora_context=self.vision_lora_context, on_encoded=self.on_encoded, device=self.device, dtype=self.dtype)

    def _embed(self, input_ids: torch.Tensor, scheduled: list[ScheduledRequest],
               missing_ok: bool = False, table: torch.nn.Module | None = None) -> tuple[torch.Tensor, DeepStack | None]:
        """Text embeddings with the step's encoder outputs over their placeholders (runner/encoder_runs.py).
        `table`: the text embeddings' table, when not the target's (an EAGLE-3 head's own)."""
        return encoder_runs.embed(table if table is not None else self.model.embed_tokens, self.encoder_outputs,
                                  input_ids, scheduled, self.device, missing_ok)
