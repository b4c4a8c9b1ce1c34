"""Gemma 4's audio side: the feature extractor's settings, the audio encoder and the audio items.

A clip is a mono 16 kHz waveform. transformers' Gemma4AudioFeatureExtractor turns it into log-mel
frames (20 ms windows every 10 ms, padded to a multiple of 128 samples) and a mask of the frames
whose whole window is real audio. The audio tower (a conformer after two stride-2 convolutions)
makes one soft token per 4 frames (40 ms: 25 per second), and the multimodal embedder projects each
to the decoder's width. In the prompt a clip is `<|audio>` + `<|audio|>` x soft tokens + `<audio|>`:
only the `<|audio|>` run takes the clip's embeddings; the two tokens around it are text. Audio soft
tokens attend causally, like text (only image and video tokens attend both ways).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.models.family import AudioFormat, EncoderInputs
from mmengine.models.gemma4_vision import buffers_to_parameters

# Checkpoint tensor prefix -> Gemma4AudioEncoder's own prefix (the rest of the name is kept).
AUDIO_CHECKPOINT_PREFIXES: dict[str, str] = {
    "model.audio_tower.": "audio_tower.",
    "model.embed_audio.": "embed_audio.",
}

# Gemma4AudioFeatureExtractor.__call__ truncates a clip past max_length=480000 samples (30 s at 16 kHz),
# and the processor caps a clip's soft tokens at audio_seq_length (750) to match: longer clips are refused.
MAX_AUDIO_SAMPLES = 480_000
DEFAULT_AUDIO_SEQ_LENGTH = 750
# The two stride-2 convolutions (kernel 3, padding 1) of the tower's subsampling, fixed by its code.
_SUBSAMPLING_LAYERS = 2


def load_gemma4_feature_extractor(model_dir: str | None) -> Any:
    """The checkpoint's Gemma4AudioFeatureExtractor (from processor_config.json or
    preprocessor_config.json), or transformers' defaults where the checkpoint saves no audio settings."""
    from transformers import Gemma4AudioFeatureExtractor

    if model_dir is None:
        return Gemma4AudioFeatureExtractor()
    try:
        return Gemma4AudioFeatureExtractor.from_pretrained(model_dir, local_files_only=True)
    except OSError:
        return Gemma4AudioFeatureExtractor()


def saved_audio_seq_length(model_dir: str | None) -> int:
    """Gemma4Processor's audio_seq_length as processor_config.json saves it (its default otherwise)."""
    path = Path(model_dir) / "processor_config.json" if model_dir is not None else None
    if path is None or not path.is_file():
        return DEFAULT_AUDIO_SEQ_LENGTH
    saved = json.loads(path.read_text(encoding="utf-8"))
    return int(saved.get("audio_seq_length", DEFAULT_AUDIO_SEQ_LENGTH))


# -- encoder --------------------------------------------------------------------------------------


class Gemma4AudioEncoder(nn.Module):
    """transformers' Gemma 4 audio tower and multimodal embedder, named as in the checkpoint (see
    AUDIO_CHECKPOINT_PREFIXES); the tower's persistent buffers are made parameters, as the vision side's."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

        # Eager attention: the tower's chunked local attention has no other implementation
        self.audio_tower = AutoModel.from_config(config.audio_config, dtype=torch.get_default_dtype())
        self.embed_audio = Gemma4MultimodalEmbedder(config.audio_config, config.text_config)
        buffers_to_parameters(self.audio_tower)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_audio.embedding_projection.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_audio.embedding_projection.weight.device

    @torch.inference_mode()
    def encode(self, items: list[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Clips (each {"input_features": [frames, mel bins], "input_features_mask": [frames]}) through the
        tower as one batch, the shorter ones padded with invalid frames; one [soft tokens, text hidden]
        tensor per clip, in order, its padding stripped as transformers strips it (the tower's output
        mask). A clip's soft tokens do not depend on the padding: masked frames are zeroed before each
        convolution, attention looks back only, and padded keys are masked."""
        frames = max(item["input_features"].shape[0] for item in items)
        features = torch.stack([_pad_frames(item["input_features"], frames) for item in items])
        mask = torch.stack([_pad_frames(item["input_features_mask"], frames) for item in items])
        features = features.to(self.device, self.dtype, non_blocking=True)
        mask = mask.to(self.device, non_blocking=True)
        output = self.audio_tower(features, mask, return_dict=True)
        embeddings = self.embed_audio(output.last_hidden_state)
        return [emb[valid] for emb, valid in zip(embeddings, output.attention_mask)]


def _pad_frames(tensor: torch.Tensor, frames: int) -> torch.Tensor:
    """`tensor` ([frames, ...]) padded with zeros (False for a mask) to `frames` rows."""
    missing = frames - tensor.shape[0]
    if missing == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((missing, *tensor.shape[1:]))])


# -- items ----------------------------------------------------------------------------------------


class Gemma4AudioItems:
    """What a family needs to know of Gemma 4's audio clips: the waveform it takes, items, their token
    counts, the largest one, and the tokens around a clip's soft tokens in the prompt."""

    def __init__(self, hf_config: PretrainedConfig, feature_extractor: Any, audio_seq_length: int) -> None:
        self.hf_config = hf_config
        self.feature_extractor = feature_extractor
        self.audio_seq_length = audio_seq_length
        self.format = AudioFormat(int(feature_extractor.sampling_rate), MAX_AUDIO_SAMPLES)

    # -- prompt tokens --

    @property
    def audio_token_id(self) -> int:
        """`<|audio|>`: one per soft token, each replaced by the clip's embedding."""
        return self.hf_config.audio_token_id

    def prompt_ids(self, num_tokens: int) -> list[int]:
        """The ids a clip's `<|audio|>` marker becomes in the prompt (as Gemma4Processor expands it)."""
        return [self.hf_config.boa_token_id, *[self.audio_token_id] * num_tokens, self.hf_config.eoa_token_index]

    # -- items --

    def item(self, waveform: np.ndarray) -> EncoderInputs:
        """A mono waveform at the format's rate (at most max_samples) as the tower's inputs: its log-mel
        frames and their mask, as transformers' feature extractor makes them (given a list, one clip)."""
        batch = self.feature_extractor([waveform], return_tensors="pt", truncation=False)
        return EncoderInputs(input_features=batch["input_features"][0].clone(),
                             input_features_mask=batch["input_features_mask"][0].clone())

    def num_tokens(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Soft tokens of an item: its valid frames after the two stride-2 subsamplings, counted on the
        mask as Gemma4Processor counts them (the tower's output mask is the same)."""
        mask = inputs["input_features_mask"]
        for _ in range(_SUBSAMPLING_LAYERS):
            mask = mask[::2]
        return int(mask.sum())

    def num_tokens_of_samples(self, num_samples: int) -> int:
        """Soft tokens of a clip of `num_samples` samples (Gemma4Processor's arithmetic; 25 per second)."""
        extractor = self.feature_extractor
        frames = (num_samples + extractor.frame_length // 2 - (extractor.frame_length + 1)) // extractor.hop_length + 1
        if frames <= 0:
            return 0
        for _ in range(_SUBSAMPLING_LAYERS):
            frames = (frames - 1) // 2 + 1
        return min(frames, self.audio_seq_length)

    @property
    def max_tokens(self) -> int:
        return self.num_tokens_of_samples(self.format.max_samples)

    def explain(self) -> str:
        rate = self.format.sampling_rate
        return (f"audio: at most {self.format.max_samples} samples at {rate} Hz ({self.format.max_seconds:g} s, the feature "
                f"extractor's cap), one embedding per 4 hops of {self.feature_extractor.hop_length} samples: at most {self.max_tokens}")
