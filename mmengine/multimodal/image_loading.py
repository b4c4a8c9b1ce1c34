"""Turn user-supplied images (paths, encoded bytes, PIL images, numpy arrays) into RGB PIL images.

Every image a request carries goes through `load_image`, which is the only place untrusted image
data is decoded. It guards against decompression bombs before any pixel is decoded, rejects corrupt
or truncated data with a typed error, and normalises every PIL mode to RGB the way Hugging Face
image processors do (transparency composited onto white).
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from typing import IO

import numpy as np
from PIL import Image, ImageOps

from mmengine.errors import (
    ConfigError,
    CorruptImageError,
    ImageTooLargeError,
    InvalidInputError,
    UnsupportedImageTypeError,
)

ImageInput = Image.Image | str | os.PathLike | bytes | bytearray | memoryview | np.ndarray

# 64 Mi pixels (8192 x 8192) is beyond any camera photo, decodes to 192 MiB of RGB, and stays below
# Pillow's own warning threshold (Image.MAX_IMAGE_PIXELS, about 89.5 M), so with the default every
# image Pillow would call a bomb is rejected by our check, with our message.
DEFAULT_MAX_IMAGE_PIXELS: int = 64 * 1024 * 1024

# Encoded formats we decode. Pillow can open many more, but some hand the data to external programs
# (EPS runs Ghostscript) or are rarely exercised parsers; untrusted input only gets these.
SUPPORTED_IMAGE_FORMATS: tuple[str, ...] = (
    "PNG", "JPEG", "MPO", "GIF", "WEBP", "BMP", "TIFF", "AVIF", "PPM",
)

# Files up to this size are read whole to key the preprocessing cache by their bytes.
MAX_ENCODED_FILE_BYTES: int = 64 * 1024 * 1024

_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa", "La"})
_HIGH_DEPTH_MODES = frozenset({"I", "F", "I;16", "I;16L", "I;16B", "I;16N"})
_NUMPY_CHANNELS = (1, 3, 4)
_MAX_SHOWN_PATH = 200


def load_image(
    image: ImageInput,
    *,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    image_index: int = 0,
    encoded: bytes | None = None,
) -> Image.Image:
    """Return `image` as a fully decoded, detached RGB PIL image.

    Paths and encoded bytes are decoded (first frame of animations, EXIF orientation applied);
    `encoded`, when given, is the path's or bytes' content as `encoded_bytes` already read it.
    PIL images are used as given (current frame, no EXIF rotation), numpy arrays must be uint8, or
    float in [0, 1], shaped HxW, HxWx1, HxWx3 or HxWx4 (RGBA). Raises CorruptImageError,
    ImageTooLargeError or UnsupportedImageTypeError with a reason starting "image {image_index}: ".
    """
    if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
        raise ConfigError(f"max_pixels must be a positive int, got {max_pixels!r}")
    if encoded is not None:
        shown = _shown_path(image) if isinstance(image, (str, os.PathLike)) else "image bytes"
        with _decode_errors(image_index, shown):
            return _decode(io.BytesIO(encoded), max_pixels, image_index)
    if isinstance(image, Image.Image):
        return _load_pil(image, max_pixels, image_index)
    if isinstance(image, np.ndarray):
        return _load_array(image, max_pixels, image_index)
    if isinstance(image, (str, os.PathLike)):
        return _load_path(image, max_pixels, image_index)
    if isinstance(image, (bytes, bytearray, memoryview)):
        return _load_bytes(image, max_pixels, image_index)
    raise UnsupportedImageTypeError(
        f"image {image_index}: unsupported image type {_type_name(image)}; expected a PIL image, "
        "a file path, encoded image bytes or a numpy array"
    )


def encoded_bytes(image: ImageInput, *, image_index: int = 0) -> bytes | None:
    """The encoded bytes of a file path or bytes input (read, not decoded); None for decoded inputs
    (PIL images, numpy arrays) and for files over MAX_ENCODED_FILE_BYTES, which are left to the
    decoder's streaming checks. Raises CorruptImageError for an unreadable file or empty bytes."""
    if isinstance(image, (str, os.PathLike)):
        try:
            with open(image, "rb") as file:
                if os.fstat(file.fileno()).st_size > MAX_ENCODED_FILE_BYTES:
                    return None
                data = file.read()
        except (OSError, ValueError) as exc:  # ValueError: e.g. an embedded NUL byte
            raise CorruptImageError(f"image {image_index}: cannot read {_shown_path(image)}: {_reason(exc)}") from exc
    elif isinstance(image, (bytes, bytearray, memoryview)):
        data = image if isinstance(image, bytes) else bytes(image)
    else:
        return None
    if not data:
        raise CorruptImageError(f"image {image_index}: image bytes are empty")
    return data


def image_content_bytes(image: Image.Image) -> bytes:
    """Canonical bytes of an image's content for hashing: mode, size and raw pixel bytes.

    Meant for `load_image` results, so the same picture given as a path, encoded bytes, a PIL
    image or a numpy array yields the same bytes.
    """
    header = f"{image.mode} {image.width}x{image.height}\n".encode("ascii")
    return header + image.tobytes()


# --- input kinds -------------------------------------------------------------------------------


def _load_pil(image: Image.Image, max_pixels: int, index: int) -> Image.Image:
    _check_size(image.size, max_pixels, index)
    with _decode_errors(index, "PIL image"):
        image.load()
        return _to_rgb(image)


def _load_path(path: str | os.PathLike, max_pixels: int, index: int) -> Image.Image:
    shown = _shown_path(path)
    try:
        file = open(path, "rb")  # closed by the `with` below
    except (OSError, ValueError) as exc:  # ValueError: e.g. an embedded NUL byte
        raise CorruptImageError(f"image {index}: cannot read {shown}: {_reason(exc)}") from exc
    with file, _decode_errors(index, shown):
        return _decode(file, max_pixels, index)


def _reason(exc: OSError | ValueError) -> str:
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


def _load_bytes(data: bytes | bytearray | memoryview, max_pixels: int, index: int) -> Image.Image:
    if not isinstance(data, bytes):
        data = bytes(data)  # also flattens non-contiguous or non-byte memoryviews
    if not data:
        raise CorruptImageError(f"image {index}: image bytes are empty")
    with _decode_errors(index, "image bytes"):
        return _decode(io.BytesIO(data), max_pixels, index)


def _load_array(array: np.ndarray, max_pixels: int, index: int) -> Image.Image:
    is_float = array.dtype.kind == "f"
    if not (array.dtype == np.uint8 or is_float) or not (
        array.ndim == 2 or (array.ndim == 3 and array.shape[2] in _NUMPY_CHANNELS)
    ):
        raise UnsupportedImageTypeError(
            f"image {index}: unsupported numpy array of shape {array.shape} and dtype {array.dtype}; "
            "expected uint8 (or float in [0, 1]) shaped HxW, HxWx1, HxWx3 or HxWx4, channels last"
        )
    height, width = array.shape[:2]
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    _check_size((width, height), max_pixels, index)
    if is_float:
        array = _unit_float_to_uint8(array, index)
    return _to_rgb(Image.fromarray(np.ascontiguousarray(array)))


def _unit_float_to_uint8(array: np.ndarray, index: int) -> np.ndarray:
    low, high = float(array.min()), float(array.max())
    if not (low >= 0.0 and high <= 1.0):  # written this way so NaN is rejected too
        raise UnsupportedImageTypeError(
            f"image {index}: float numpy array of shape {array.shape} and dtype {array.dtype} has "
            f"values in [{low}, {high}]; float images must lie in [0, 1]"
        )
    return np.rint(array.astype(np.float32) * np.float32(255.0)).astype(np.uint8)


# --- decoding ----------------------------------------------------------------------------------


def _decode(file: IO[bytes], max_pixels: int, index: int) -> Image.Image:
    """Decode the first frame of an encoded image, checking its size before decoding pixels."""
    formats = _available_formats()
    try:
        opened = Image.open(file, formats=formats)  # reads only the header
    except Image.DecompressionBombError:
        # Past twice Image.MAX_IMAGE_PIXELS Pillow refuses inside `open`, before we see the size;
        # report it against max_pixels when we can. Otherwise Pillow's limit is the tighter one.
        size = _header_size(file, formats)
        if size is not None:
            _check_size(size, max_pixels, index)
        raise
    with opened as image:
        _check_size(image.size, max_pixels, index)
        image.load()
        _apply_exif_orientation(image)
        return _to_rgb(image)  # a new image, so nothing refers to `file` any more


def _available_formats() -> list[str]:
    # Pillow raises KeyError for a format name it lacks (e.g. AVIF in builds without libavif).
    Image.init()
    return [name for name in SUPPORTED_IMAGE_FORMATS if name in Image.OPEN]


def _header_size(file: IO[bytes], formats: list[str]) -> tuple[int, int] | None:
    """The size a header claims, read without Pillow's bomb check; None if no format reads it.

    Calls the registered plugin factories the way `Image.open` does (Pillow's plugin registry,
    not its documented API), so it is only used to word an error that is raised anyway.
    """
    try:
        file.seek(0)
        prefix = file.read(16)
        for name in formats:
            factory, accept = Image.OPEN[name]
            accepted = accept(prefix) if accept else True
            if accepted and not isinstance(accepted, str):  # a str explains a refusal
                file.seek(0)
                with contextlib.suppress(Exception):
                    return factory(file, "").size
    except Exception:
        pass
    return None


def _apply_exif_orientation(image: Image.Image) -> None:
    try:
        ImageOps.exif_transpose(image, in_place=True)
    except Exception:
        # A malformed EXIF block is common in real photos; viewers then show the stored pixels.
        pass


@contextlib.contextmanager
def _decode_errors(index: int, source: str) -> Iterator[None]:
    """Turn whatever decoding raises into a typed error, and keep Pillow's bomb warning quiet.

    Pillow warns (or raises) past its own Image.MAX_IMAGE_PIXELS; we enforce `max_pixels`
    ourselves instead of changing that process-wide setting. Decoding untrusted data can fail
    in many ways (OSError, SyntaxError, struct.error, ...), all of which mean "corrupt image".
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    except (InvalidInputError, MemoryError):
        raise
    except Image.DecompressionBombError as exc:
        raise ImageTooLargeError(
            f"image {index}: Pillow refuses {source} as a possible decompression bomb: {exc}"
        ) from exc
    except Image.UnidentifiedImageError as exc:
        raise CorruptImageError(
            f"image {index}: cannot identify {source} as an image in a supported format "
            f"({', '.join(SUPPORTED_IMAGE_FORMATS)})"
        ) from exc
    except Exception as exc:
        raise CorruptImageError(
            f"image {index}: cannot decode {source}: {type(exc).__name__}: {exc}"
        ) from exc


def _check_size(size: tuple[int, int], max_pixels: int, index: int) -> None:
    width, height = size
    pixels = width * height
    if pixels == 0:
        raise CorruptImageError(f"image {index}: image is empty ({width}x{height})")
    if pixels > max_pixels:
        raise ImageTooLargeError(
            f"image {index}: {width}x{height} = {pixels} pixels exceeds max_image_pixels={max_pixels}"
        )


# --- mode conversion ---------------------------------------------------------------------------


def _to_rgb(image: Image.Image) -> Image.Image:
    """A new RGB image with `image`'s content; transparency is composited onto white."""
    if image.mode in _HIGH_DEPTH_MODES:
        image = _high_depth_to_gray(image)
    if image.mode == "La":
        return _premultiplied_gray_on_white(image)
    if _has_transparency(image):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")  # also covers CMYK, YCbCr, LAB, HSV, 1, L, P, RGBX


def _has_transparency(image: Image.Image) -> bool:
    # Same test as Image.has_transparency_data (Pillow >= 10.1), spelled out for older Pillow.
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        return True
    return image.mode == "P" and image.palette is not None and image.palette.mode.endswith("A")


def _premultiplied_gray_on_white(image: Image.Image) -> Image.Image:
    # Pillow cannot convert "La" (premultiplied alpha); over white, out = gray + 255 - alpha.
    gray, alpha = (np.asarray(band, dtype=np.int16) for band in image.split())
    composited = np.clip(gray + 255 - alpha, 0, 255).astype(np.uint8)
    return Image.fromarray(composited).convert("RGB")


def _high_depth_to_gray(image: Image.Image) -> Image.Image:
    """Scale 16/32-bit integer or float grayscale linearly to 8-bit "L".

    Pillow's own conversion clips (a 16-bit 40000 becomes 255, a float 0.5 becomes 0). Instead
    the value range that maps onto 0..255 is: 0..65535 for I;16*; for I, 0..255 if the values fit,
    else 0..65535 if they fit, else min(0, lowest)..highest; for F, 0..1 if the values fit, else
    0..255 if they fit, else min(0, lowest)..highest (NaN and inf count as 0). Any "transparency"
    entry of such an image is dropped.
    """
    values = np.asarray(image).astype(np.float32)
    if image.mode == "F":
        values[~np.isfinite(values)] = 0.0
    low, high = _gray_range(image.mode, float(values.min()), float(values.max()))
    scaled = np.rint((values - low) * np.float32(255.0 / (high - low)))
    return Image.fromarray(np.clip(scaled, 0, 255).astype(np.uint8))


def _gray_range(mode: str, lowest: float, highest: float) -> tuple[float, float]:
    if mode.startswith("I;16"):
        return 0.0, 65535.0
    candidates = ((0.0, 1.0), (0.0, 255.0)) if mode == "F" else ((0.0, 255.0), (0.0, 65535.0))
    for low, high in candidates:
        if lowest >= low and highest <= high:
            return low, high
    low = min(0.0, lowest)
    return low, max(highest, low + 1.0)


# --- messages ----------------------------------------------------------------------------------


def _shown_path(path: str | os.PathLike) -> str:
    """The path for error messages, shortened (a str may well be a mistaken base64 blob)."""
    text = repr(os.fspath(path))
    if len(text) > _MAX_SHOWN_PATH:
        text = text[: _MAX_SHOWN_PATH - 3] + "..."
    return f"file {text}"


def _type_name(value: object) -> str:
    cls = type(value)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
