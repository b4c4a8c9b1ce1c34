"""Exact fast image preprocessing: the pixel values of transformers' PIL image processors, bitwise, in a
fraction of their time.

A PIL image processor resizes the uint8 picture with PIL, then takes it to float: rescale (x * 1/255 in
float64, cast to float32), normalize ((x - mean) / std in float32), each a pass over the image, with
channel-first transposes, validations and, for patch models, a patchify copy on top. Every one of those
float steps acts on one value at a time, so a float output depends only on its channel and its uint8
input: a table of 3 x 256 values, computed once by the processor's own rescale and normalize, gives
every output bit for bit. The fast path therefore keeps the geometry in uint8 (PIL's own resize, the
same crop and patch layout as transformers, as cheap uint8 copies) and writes each float output once,
by table lookup, straight into the tensor the model takes.

Covered (by exact class, with the settings the engine loads them with): Qwen2VLImageProcessorPil (Qwen2,
2.5, 3-VL and Qwen3.5's native-resolution patches), Gemma4ImageProcessorPil, and the generic resize /
center-crop processors (CLIPImageProcessorPil, SiglipImageProcessorPil: LLaVA's towers). Anything else, or
a setting these do not implement, keeps transformers' processor (`fast_image_processor` says why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from mmengine.multimodal.resize_guard import resized_size

logger = logging.getLogger(__name__)

# Makes an output tensor (shape, numpy dtype) that the fast path fills through its numpy view: a worker
# process passes one that allocates shared memory, so the output crosses to the engine without a copy.
Allocate = Callable[[tuple[int, ...], np.dtype], torch.Tensor]
FastImageProcessor = Callable[..., dict[str, torch.Tensor]]  # (pictures, allocate=empty) -> the processor's outputs


def empty(shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
    return torch.from_numpy(np.empty(shape, dtype=dtype))


class PixelTable:
    """What the processor's rescale and normalize make of each uint8 value, per channel, computed by its
    own methods: `values[c, x]` is the output of input x in channel c, bit for bit (then cast to `dtype`
    where the processor casts its output, as Qwen's patchify does to float32)."""

    def __init__(self, processor: Any, dtype: np.dtype | None = None) -> None:
        ramp = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 1, 256)).copy()  # channel-first, as it runs
        values: np.ndarray = ramp
        if processor.do_rescale:
            values = processor.rescale(values, processor.rescale_factor)
        if processor.do_normalize:
            values = processor.normalize(values, processor.image_mean, processor.image_std)
        self.values = np.ascontiguousarray(values[:, 0, :], dtype=dtype)  # [3, 256]

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    def lookup(self, pixels: np.ndarray, out: np.ndarray, channel_axis: int) -> None:
        """out[..., c, ...] = values[c, pixels[..., c, ...]] along `channel_axis` (the same shape)."""
        for channel in range(3):
            index = (slice(None),) * channel_axis + (channel,)
            np.take(self.values[channel], pixels[index], out=out[index], mode="clip")  # (uint8: never clipped; unbuffered)


def _rgb_array(picture: Image.Image) -> np.ndarray:
    if picture.mode != "RGB":  # the engine hands RGB pictures (image_loading.py); others are converted as transformers does
        picture = picture.convert("RGB")
    return np.asarray(picture)


def _resized(picture: Image.Image, height: int, width: int, resample: Any) -> Image.Image:
    """PIL's resize as transformers calls it (image_transforms.resize: reducing_gap None)."""
    return picture.resize((width, height), resample=int(resample), reducing_gap=None)


class QwenPatches:
    """Qwen2VLImageProcessorPil: smart_resize, rescale, normalize, and the (grid, C*T*P*P) patches with each
    patch repeated over the temporal patch, merge windows contiguous."""

    def __init__(self, processor: Any) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        self.processor = processor
        self.smart_resize = smart_resize
        self.table = PixelTable(processor, np.float32)  # patchify casts to float32
        size = processor.size
        get = size.get if isinstance(size, dict) else lambda key: getattr(size, key, None)
        self.min_pixels, self.max_pixels = get("shortest_edge"), get("longest_edge")
        self.patch, self.merge, self.temporal = processor.patch_size, processor.merge_size, processor.temporal_patch_size

    def __call__(self, pictures: Sequence[Image.Image], allocate: Allocate = empty) -> dict[str, torch.Tensor]:
        p, m, t = self.patch, self.merge, self.temporal
        sizes = [self.smart_resize(picture.height, picture.width, factor=p * m, min_pixels=self.min_pixels,
                                   max_pixels=self.max_pixels) for picture in pictures]
        grids = [[1, height // p, width // p] for height, width in sizes]
        pixel_values = allocate((sum(gh * gw for _, gh, gw in grids), 3 * t * p * p), np.dtype(np.float32))
        out, start = pixel_values.numpy(), 0
        for picture, (height, width), (_, gh, gw) in zip(pictures, sizes, grids):
            self._one(picture, height, width, out[start: start + gh * gw].reshape(gh * gw, 3, t, p, p))
            start += gh * gw
        return {"pixel_values": pixel_values, "image_grid_thw": torch.tensor(grids, dtype=torch.int64)}

    def _one(self, picture: Image.Image, height: int, width: int, out: np.ndarray) -> None:
        p, m = self.patch, self.merge
        pixels = _rgb_array(_resized(picture, height, width, self.processor.resample))  # [H, W, 3] uint8
        gh, gw = height // p, width // p
        # (gh/m, m, p, gw/m, m, p, C) -> (gh/m, gw/m, m, m, C, p, p): one uint8 copy in the output's patch order
        ordered = pixels.reshape(gh // m, m, p, gw // m, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        ordered = np.ascontiguousarray(ordered).reshape(gh * gw, 3, 1, p, p)
        self.table.lookup(ordered, out[:, :, :1], channel_axis=1)
        out[:, :, 1:] = out[:, :, :1]  # transformers repeats each patch over the temporal patch


class Gemma4Patches:
    """Gemma4ImageProcessorPil: an aspect-preserving resize within the patch budget, rescale (normalize
    off by default), (patches, P*P*C) patches padded to max_patches with zeros, positions with -1."""

    def __init__(self, processor: Any) -> None:
        from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

        self.processor = processor
        self.target_size = get_aspect_ratio_preserving_size
        self.table = PixelTable(processor)
        self.patch, self.pooling = processor.patch_size, processor.pooling_kernel_size
        self.max_patches = processor.max_soft_tokens * self.pooling**2

    def __call__(self, pictures: Sequence[Image.Image], allocate: Allocate = empty) -> dict[str, torch.Tensor]:
        p, n = self.patch, len(pictures)
        pixel_tensor = allocate((n, self.max_patches, p * p * 3), self.table.dtype)
        position_tensor = allocate((n, self.max_patches, 2), np.dtype(np.int64))
        pixel_values, positions = pixel_tensor.numpy(), position_tensor.numpy()
        pixel_values.fill(0)  # the padding
        positions.fill(-1)
        soft_tokens = []
        for i, picture in enumerate(pictures):
            height, width = self.target_size(picture.height, picture.width, p, self.max_patches, self.pooling)
            if (height, width) != (picture.height, picture.width):
                picture = _resized(picture, height, width, self.processor.resample)
            pixels = _rgb_array(picture)
            gh, gw = height // p, width // p
            ordered = np.ascontiguousarray(pixels.reshape(gh, p, gw, p, 3).transpose(0, 2, 1, 3, 4)).reshape(gh * gw, p * p, 3)
            self.table.lookup(ordered, pixel_values[i, : gh * gw].reshape(gh * gw, p * p, 3), channel_axis=2)
            grid_x, grid_y = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
            positions[i, : gh * gw] = np.stack([grid_x, grid_y], axis=-1).reshape(gh * gw, 2)
            soft_tokens.append(gh * gw // self.pooling**2)
        return {"pixel_values": pixel_tensor, "image_position_ids": position_tensor,
                "num_soft_tokens_per_image": torch.tensor(soft_tokens)}


class ResizedCrops:
    """transformers' generic PIL pipeline (PilBackend._preprocess: CLIP's and SigLIP's processors): resize by
    the `size` rule, center crop, rescale, normalize; [N, C, H, W]."""

    def __init__(self, processor: Any) -> None:
        from transformers.image_transforms import center_crop

        self.processor = processor
        self.center_crop = center_crop
        self.table = PixelTable(processor)
        crop = processor.crop_size if processor.do_center_crop else None
        get = (crop.get if isinstance(crop, dict) else lambda key: getattr(crop, key, None)) if crop is not None else None
        self.crop = (get("height"), get("width")) if get is not None else None

    def __call__(self, pictures: Sequence[Image.Image], allocate: Allocate = empty) -> dict[str, torch.Tensor]:
        arrays = [self._uint8(picture) for picture in pictures]
        if len({array.shape for array in arrays}) != 1:  # transformers stacks them: they must agree
            raise ValueError(f"pictures of different preprocessed sizes: {sorted({a.shape for a in arrays})}")
        pixel_values = allocate((len(arrays), *arrays[0].shape), self.table.dtype)
        out = pixel_values.numpy()
        for i, array in enumerate(arrays):
            self.table.lookup(array, out[i], channel_axis=0)
        return {"pixel_values": pixel_values}

    def _uint8(self, picture: Image.Image) -> np.ndarray:
        """The picture resized and cropped, channel-first uint8 (the crop pads with 0 as transformers' does)."""
        if self.processor.do_resize:
            picture = _resized(picture, *resized_size(self.processor, picture.height, picture.width), self.processor.resample)
        pixels = _rgb_array(picture).transpose(2, 0, 1)
        if self.crop is not None:
            from transformers.image_utils import ChannelDimension

            pixels = self.center_crop(pixels, self.crop, data_format=ChannelDimension.FIRST,
                                      input_data_format=ChannelDimension.FIRST)
        return pixels


def fast_image_processor(processor: Any) -> tuple[FastImageProcessor | None, str]:
    """The exact fast path for transformers' image processor `processor`, or None and why not."""
    from transformers.image_processing_backends import PilBackend

    kind = type(processor).__name__
    if not isinstance(processor, PilBackend):
        return None, f"{kind} is not one of transformers' PIL image processors"
    if getattr(processor, "do_convert_rgb", True) is False:
        return None, f"{kind} with do_convert_rgb=False"
    if getattr(processor, "do_pad", None):
        return None, f"{kind} with do_pad"
    if kind == "Qwen2VLImageProcessorPil":
        if not processor.do_resize:
            return None, f"{kind} with do_resize=False"
        return QwenPatches(processor), kind
    if kind == "Gemma4ImageProcessorPil":
        return Gemma4Patches(processor), kind
    own = type(processor)
    generic = own._preprocess is PilBackend._preprocess and own.resize is PilBackend.resize and own.center_crop is PilBackend.center_crop
    if generic and kind in ("CLIPImageProcessorPil", "SiglipImageProcessorPil"):
        return ResizedCrops(processor), kind
    return None, f"{kind} has no exact fast path"
