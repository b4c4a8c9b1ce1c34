"""Request: one prompt's state as it moves through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from mmengine.sample.params import SamplingParams


# The value of a sampled token that is still on the device (async scheduling): booked, not yet read.
PLACEHOLDER_TOKEN = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(frozen=True)
class VideoPatch:
    """Where a video item sits in its video: temporal patch `index` of `count`, and the M-RoPE temporal
    step between patches (Qwen2.5-VL: tokens_per_second x seconds per patch; 1 for Qwen2-VL)."""

    index: int
    count: int
    time_step: float = 1.0


@dataclass
class MMItem:
    """One multimodal item of a prompt: its placeholder run and the encoder's input for it."""

    modality: str
    mm_hash: str  # content hash (or a user-given id): equal hashes mean equal embeddings
    offset: int  # index of the item's first placeholder token in the prompt
    length: int  # number of placeholder tokens, one embedding each
    encoder_inputs: dict[str, torch.Tensor] = field(repr=False)  # the family's, e.g. {"pixel_values": [3, H, W]}
    video_patch: VideoPatch | None = None  # a video's items: one temporal patch each

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


@dataclass
class ProcessedPrompt:
    """A validated prompt: token ids with placeholder runs expanded, and its items."""

    prompt: str | None
    prompt_token_ids: list[int]
    mm_items: list[MMItem]
    # M-RoPE families: the prompt's [tokens, 3] positions and the shift of later ones
    # (a models.family.PromptPositions); None means each token's position is its index.
    mrope_positions: Any = None


class Request:
    def __init__(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        sampling_params: SamplingParams,
        arrival_index: int,
        generator: torch.Generator | None = None,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = processed.prompt
        self.prompt_token_ids = list(processed.prompt_token_ids)
        self.mm_items = processed.mm_items
        self.mrope_positions = processed.mrope_positions
        self.sampling_params = sampling_params
        self.arrival_index = arrival_index
        self.generator = generator
        self.cache_salt = cache_salt  # requests with different salts never share KV blocks
        self.lora_name = lora_name  # the adapter's identity separates caches (adapters run in a later version)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of all_token_ids
        # Tokens covered by blocks this request got from the prefix cache. Positions below it
        # are already in (shared) blocks: a recomputed last token there must not be stored again.
        self.num_prefix_hit_tokens = 0
        self.num_admission_skips = 0  # times a later request was admitted ahead of this one
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: str | int | None = None  # the stop string or stop token that finished it
        self.output_logprobs: list[Any] = []  # outputs.TokenLogprobs per generated token, when asked for
        self.prompt_logprobs: list[Any] | None = None  # TokenLogprobs per prompt token (None first), when asked for
        self.grammar: Any = None  # structured output: the matcher its output tokens are fed to
        self.spec_token_ids: list[int] = []  # speculative decoding: drafts for its next step to verify

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def resolve_placeholder(self, token_id: int) -> None:
        """Replaces the placeholder that stands for the last sampled token with its value."""
        assert self.output_token_ids[-1] == PLACEHOLDER_TOKEN, self
        self.output_token_ids[-1] = token_id
        self.all_token_ids[-1] = token_id

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt_tokens={self.num_prompt_tokens}, "
            f"output_tokens={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
