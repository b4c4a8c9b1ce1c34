"""A family's tiny-checkpoint builder: the same sequence for every family built at the tiny checkpoints' settings
(weights at TINY_INITIALIZER_RANGE with constants perturbed by TINY_CONSTANT_NOISE). The tokenizer from the spec,
the config from the spec and the tokenizer, seeded random weights with a generation config, then the processor's
files (checkpoint.save_checkpoint), and the on-disk cache of the builds (cache.cached_spec_build). A family's
module gives what is its own (the three steps, the model class, the generation config's stop tokens) and binds
`build` and `path` to its public names."""

from __future__ import annotations

import contextlib
import os
import pathlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from mmengine.testing.cache import cached_spec_build
from mmengine.testing.checkpoint import save_checkpoint
from mmengine.testing.weights import TINY_CONSTANT_NOISE, TINY_INITIALIZER_RANGE

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast


class TinySpec(Protocol):
    """What the builder reads off every family's spec (a frozen dataclass: the cache key hashes its fields)."""

    @property
    def seed(self) -> int: ...

    @property
    def dtype(self) -> str: ...


Spec = TypeVar("Spec", bound=TinySpec)


@dataclass(frozen=True)
class FamilyBuilder(Generic[Spec]):
    family: str  # the cache entries' name prefix
    version: int  # bump when what the builder writes changes, so cached checkpoints are rebuilt
    default_spec: Spec
    model_class: str  # transformers' model class, by name: imported when a checkpoint is built
    tokenizer: Callable[[Spec], PreTrainedTokenizerFast]
    config: Callable[[Spec, PreTrainedTokenizerFast, float], PretrainedConfig]  # (spec, tokenizer, initializer_range)
    save_processor: Callable[[Spec, PreTrainedTokenizerFast, pathlib.Path], None]  # its files, after the weights
    eos_tokens: tuple[str, ...] | None = None  # the generation config's stop tokens (None: the tokenizer's eos alone)
    bos_token: str | None = None  # the configs' BOS, for a tokenizer without one of its own
    tweak: Callable[[PreTrainedModel], None] | None = None  # weights.random_model's tweak
    quiet: tuple[str, ...] = ()  # warnings the build raises that mean nothing here (regexes on their messages)

    def build(self, path: str | os.PathLike, spec: Spec | None = None, *, device: str = "cpu", dtype: str | None = None,
              initializer_range: float = TINY_INITIALIZER_RANGE) -> pathlib.Path:
        """Builds a random-weight checkpoint of `spec` (None: the family's default spec; weights made on `device` in
        `dtype`, default the spec's) and saves it with its tokenizer, processor and chat template into `path`;
        returns the path."""
        import transformers

        spec = self.default_spec if spec is None else spec
        tokenizer = self.tokenizer(spec)
        with warnings.catch_warnings() if self.quiet else contextlib.nullcontext():
            for message in self.quiet:
                warnings.filterwarnings("ignore", message=message)
            return save_checkpoint(
                path, getattr(transformers, self.model_class), self.config(spec, tokenizer, initializer_range), tokenizer,
                lambda path: self.save_processor(spec, tokenizer, path), seed=spec.seed, device=device,
                dtype=dtype or spec.dtype, eos_tokens=self.eos_tokens, bos_token=self.bos_token,
                constant_noise=TINY_CONSTANT_NOISE, tweak=self.tweak,
            )

    def path(self, spec: Spec | None = None, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
        """The path of the cached tiny checkpoint of `spec` (None: the family's default spec), built on first use
        in `cache_dir` (None: $MMENGINE_CACHE_DIR or ~/.cache/mmengine/tiny-models)."""
        spec = self.default_spec if spec is None else spec
        return cached_spec_build(self.family, spec, self.version, self.build, cache_dir)
