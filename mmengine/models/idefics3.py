"""Idefics3 (`Idefics3ForConditionalGeneration`, also the published SmolVLM v1 checkpoints) and SmolVLM2
(`SmolVLMForConditionalGeneration`): transformers' SigLIP-style vision tower (Idefics3VisionTransformer /
SmolVLMVisionTransformer) and pixel-shuffle connector over the engine's Llama decoder.

A picture is cut into tiles plus a global image (models/idefics3_tiles.py); each goes through the tower at
the tile's size, its patch states are pixel-shuffled (`scale_factor` squared neighbouring patches into one
vector) and projected to the decoder's width: `image_seq_len` embeddings a tile. The processor writes each
tile's run after its `<fake_token_around_image><row_i_col_j>` marker and the global image's after
`<global-img>`, so a picture's runs are separated by text tokens: each tile (and the global image) is an
item of its own (ModelFamily.image_items), with its own encoder-cache entry, hashed from the picture's hash
(its pixels under the processor's settings, the splitting ones among them) and the tile's index. One entry
per tile rather than per picture because an entry fills one contiguous run of placeholders, and because the
decoder attends causally, so a prefill chunk may end anywhere in a picture while the encoder budget needs
only one tile's embeddings. The marker's text is the processor's (ModelFamily.image_marker_text). Positions
are plain 1-D.

Videos (SmolVLM2) are not supported: transformers' video processor needs torchvision and its prompt needs
num2words; a video is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig

from mmengine.errors import InvalidInputError, UnsupportedModelError
from mmengine.models.family import EncoderInputs, ModelClass, ModelFamily, pil_image_processor
from mmengine.models.idefics3_tiles import MarkerTokens, TileSettings
from mmengine.multimodal.light_processor import LightProcessor


def check_idefics3_config(config: PretrainedConfig) -> None:
    vision, scale = config.vision_config, config.scale_factor
    side = vision.image_size // vision.patch_size
    if side % scale:
        raise UnsupportedModelError(f"scale_factor {scale} must divide the tower's {side}x{side} patches")


class Idefics3Family(ModelFamily):
    architectures = ("Idefics3ForConditionalGeneration",)
    model_type = "idefics3"
    display_name = "Idefics3 / SmolVLM (SigLIP-style tower, pixel-shuffle connector, tiles plus a global image, Llama decoder)"
    model_class = ModelClass("mmengine.models.idefics3_model", "Idefics3Model")
    items_have_one_size = True  # every tile and global image is the tile's square

    def __init__(self, hf_config: PretrainedConfig, image_processor_settings: dict[str, Any] | None = None,
                 model_dir: str | None = None) -> None:
        super().__init__(hf_config, image_processor_settings, model_dir)
        check_idefics3_config(hf_config)
        self.tiles = TileSettings.from_settings(self.image_processor_settings, hf_config.vision_config.image_size)
        side, scale = self.tiles.tile // self.patch_size, hf_config.scale_factor
        if self.tiles.tile % self.patch_size or side % scale:
            raise UnsupportedModelError(f"tiles of {self.tiles.tile} px (max_image_size) must be whole {self.patch_size} px patches "
                                        f"whose side scale_factor {scale} divides")

    full_processor_reason = ""

    @classmethod
    def load_light_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """Idefics3Processor's parts: the tokenizer with the special tokens the processor adds to it, the PIL image
        processor reporting each picture's grid, the saved chat template and the marker tokens."""
        from mmengine.multimodal.light_processor import checkpoint_text_parts, unpickled_without_modeling_code

        tokenizer, saved = checkpoint_text_parts(model_dir)
        fake, image = "<fake_token_around_image>", "<image>"
        tokenizer.add_special_tokens({"additional_special_tokens": [fake, image, "<end_of_utterance>"]})  # as Idefics3Processor
        image_processor = pil_image_processor(model_dir, overrides)
        image_processor.return_row_col_info = True
        return TiledLightProcessor(tokenizer, unpickled_without_modeling_code(image_processor),
                                   saved.get("chat_template"), image,
                                   fake_image_token=fake, global_image_tag="<global-img>")

    @classmethod
    def load_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """transformers' Idefics3Processor (its PIL image processor), whose image processor also reports each
        picture's grid (return_row_col_info, which transformers' processor asks for on each call), so the
        engine, calling it alone, knows the tiles' rows and columns."""
        processor = super().load_processor(model_dir, overrides)
        processor.image_processor.return_row_col_info = True
        return processor

    # -- items --

    @property
    def patch_size(self) -> int:
        return self.hf_config.vision_config.patch_size

    def tile_tokens(self, height: int, width: int) -> int:
        """Embeddings a tile of this size makes: its patches, pixel-shuffled."""
        return (height // self.patch_size) * (width // self.patch_size) // self.hf_config.scale_factor**2

    @property
    def tokens_per_tile(self) -> int:
        return self.tile_tokens(self.tiles.tile, self.tiles.tile)

    def max_tokens_by_modality(self) -> dict[str, int]:
        return {"image": self.tokens_per_tile}

    @property
    def max_items_per_image(self) -> int:
        return self.tiles.max_items

    def explain_max_tokens_per_item(self, limits: Mapping[str, int] | None = None, max_audio_seconds: float | None = None) -> str:
        tile, patch, scale = self.tiles.tile, self.patch_size, self.hf_config.scale_factor
        grid = self.tiles.max_grid
        pictures = ("every picture one global image" if grid == (0, 0) else "a picture's tiles unbounded (do_resize off)"
                    if grid is None else f"a picture up to {grid[0]}x{grid[1]} tiles plus the global image")
        return (f"one item per tile: {tile}x{tile} px, {tile // patch}x{tile // patch} patches of {patch} px pixel-shuffled by "
                f"{scale} to {self.tokens_per_tile} tokens; {pictures}")

    def split_images(self, batch: Any, num_images: int) -> list[EncoderInputs]:
        """One entry per picture: its tiles then its global image ([rows*cols+1, 3, S, S], the global image alone
        when not split) and its grid (rows, cols)."""
        if "rows" not in batch or "cols" not in batch:
            raise UnsupportedModelError("the image processor does not report each picture's grid (return_row_col_info)")
        pixel_values = batch["pixel_values"]
        grids = [(int(r), int(c)) for r, c in zip(_flat(batch["rows"]), _flat(batch["cols"]))]
        counts = [rows * cols + 1 if rows or cols else 1 for rows, cols in grids]
        if pixel_values.dim() != 5 or len(grids) != num_images or pixel_values.shape[0] * pixel_values.shape[1] < sum(counts):
            raise UnsupportedModelError(f"the image processor returned {tuple(pixel_values.shape)} tiles and the grids "
                                        f"{grids} for {num_images} images")
        tiles = pixel_values.flatten(0, 1)  # (one sample: the flat list of pictures, each its tiles in order)
        pictures, row = [], 0
        for (rows, cols), count in zip(grids, counts):
            pixels = tiles[row:row + count]
            pictures.append(EncoderInputs(pixel_values=pixels if num_images == 1 else pixels.clone(), grid=torch.tensor([rows, cols])))
            row += count
        return pictures

    def image_items(self, inputs: EncoderInputs) -> list[EncoderInputs]:
        """Each tile, then the global image. Precomputed embeddings stand for a picture that is not split (one
        run of one tile's tokens): a split picture's would not say its grid, which decides the prompt."""
        if "image_embeds" in inputs:
            rows = int(inputs["image_embeds"].shape[0])
            if rows != self.tokens_per_tile:
                raise InvalidInputError(f"image_embeds has {rows} rows; precomputed embeddings stand for a picture that is "
                                        f"not split: one tile's {self.tokens_per_tile}")
            return [inputs]
        return [EncoderInputs(pixel_values=tile) for tile in inputs["pixel_values"]]

    def image_marker_text(self, processor: Any, picture: EncoderInputs) -> str | None:
        rows, cols = (int(x) for x in picture["grid"].tolist()) if "grid" in picture else (0, 0)
        return self.marker_tokens(processor).text(rows, cols)

    @staticmethod
    def marker_tokens(processor: Any) -> MarkerTokens:
        return MarkerTokens(processor.fake_image_token, processor.global_image_tag, processor.image_token)

    def num_tokens(self, inputs: EncoderInputs) -> int:
        if "image_embeds" in inputs:
            return int(inputs["image_embeds"].shape[0])
        return self.tile_tokens(*inputs["pixel_values"].shape[-2:])

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """The array the picture's tiles are cut from (the largest preprocessing makes)."""
        return self.tiles.split_size(height, width)

    def dummy_items(self, num_items: int) -> list[EncoderInputs]:
        tile = self.tiles.tile
        return [EncoderInputs(pixel_values=torch.zeros(3, tile, tile)) for _ in range(num_items)]


def _flat(values: Any) -> list[Any]:
    """The image processor's per-sample lists (or tensor) of rows or cols, flattened."""
    values = values.tolist() if isinstance(values, torch.Tensor) else values
    return [x for sample in values for x in (sample if isinstance(sample, (list, tuple)) else [sample])]


class SmolVLMFamily(Idefics3Family):
    architectures = ("SmolVLMForConditionalGeneration",)
    model_type = "smolvlm"
    display_name = "SmolVLM2 (SigLIP-style tower, pixel-shuffle connector, tiles plus a global image, Llama decoder)"
    model_class = ModelClass("mmengine.models.idefics3_model", "SmolVLMModel")

    @classmethod
    def load_light_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """load_processor's parts and the marker tokens SmolVLMProcessor takes from the tokenizer (else its defaults)."""
        from mmengine.multimodal.light_processor import checkpoint_text_parts, unpickled_without_modeling_code

        tokenizer, saved = checkpoint_text_parts(model_dir)
        from transformers import SmolVLMImageProcessorPil

        image_processor = SmolVLMImageProcessorPil.from_pretrained(model_dir, local_files_only=True, **overrides)
        image_processor.return_row_col_info = True
        return TiledLightProcessor(
            tokenizer, unpickled_without_modeling_code(image_processor),
            saved.get("chat_template") or tokenizer.chat_template,
            getattr(tokenizer, "image_token", "<image>"), getattr(tokenizer, "video_token", "<video>"),
            fake_image_token=getattr(tokenizer, "fake_image_token", "<fake_token_around_image>"),
            global_image_token=getattr(tokenizer, "global_image_token", "<global-img>"),
        )

    @classmethod
    def load_processor(cls, model_dir: str, overrides: dict[str, Any]) -> Any:
        """transformers' SmolVLMProcessor from the tokenizer, the PIL image processor and the saved processor
        settings (image_seq_len), without its video processor (torchvision only) and its video prompt's
        num2words, so it is the same processor on every machine."""
        from transformers import AutoTokenizer, SmolVLMImageProcessorPil, SmolVLMProcessor

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        image_processor = SmolVLMImageProcessorPil.from_pretrained(model_dir, local_files_only=True, **overrides)
        image_processor.return_row_col_info = True
        saved, _ = SmolVLMProcessor.get_processor_dict(model_dir, local_files_only=True)
        settings = {"image_seq_len": saved["image_seq_len"]} if saved.get("image_seq_len") is not None else {}
        return smolvlm_image_processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                                               chat_template=saved.get("chat_template") or tokenizer.chat_template, **settings)

    @staticmethod
    def marker_tokens(processor: Any) -> MarkerTokens:
        return MarkerTokens(processor.fake_image_token, processor.global_image_token, processor.image_token)


@dataclass
class TiledLightProcessor(LightProcessor):
    """A LightProcessor with the tokens Idefics3's and SmolVLM's processors write around a picture's tiles."""

    fake_image_token: str = ""
    global_image_tag: str = ""  # Idefics3Processor's name
    global_image_token: str = ""  # SmolVLMProcessor's


def smolvlm_image_processor_class() -> type:
    """SmolVLMProcessor without its video processor: transformers reads a processor's parts from its __init__
    signature. Its __init__'s attributes are set here, since it insists on num2words (for video prompts only);
    its apply_chat_template reads the video processor's frame settings, so the generic one is used."""
    from transformers import ProcessorMixin, SmolVLMProcessor

    class SmolVLMImageOnlyProcessor(SmolVLMProcessor):
        def __init__(self, image_processor=None, tokenizer=None, image_seq_len: int = 169, chat_template=None, **kwargs):
            self.fake_image_token = getattr(tokenizer, "fake_image_token", "<fake_token_around_image>")
            self.image_token = getattr(tokenizer, "image_token", "<image>")
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.end_of_utterance_token = getattr(tokenizer, "end_of_utterance_token", "<end_of_utterance>")
            self.global_image_token = getattr(tokenizer, "global_image_token", "<global-img>")
            self.image_seq_len = image_seq_len
            self.video_token = getattr(tokenizer, "video_token", "<video>")
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

        def apply_chat_template(self, conversation, chat_template=None, **kwargs):  # type: ignore[override]
            return ProcessorMixin.apply_chat_template(self, conversation, chat_template, **kwargs)

    return SmolVLMImageOnlyProcessor
