"""Tests for mmengine.multimodal.image_loading."""

from __future__ import annotations

import io
import os
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image, ImageFile

from mmengine.errors import (
    CorruptImageError,
    ImageTooLargeError,
    InvalidInputError,
    UnsupportedImageTypeError,
)
from mmengine.multimodal.image_loading import (
    DEFAULT_MAX_IMAGE_PIXELS,
    image_content_bytes,
    load_image,
)

# A 3x2 picture with distinct pixels, so any transposition or channel mix-up shows.
PIXELS = np.array(
    [[[255, 0, 0], [0, 255, 0], [0, 0, 255]], [[10, 20, 30], [128, 128, 128], [250, 240, 230]]],
    dtype=np.uint8,
)


def encode(image: Image.Image, fmt: str = "PNG", **params) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming_size(width: int, height: int) -> bytes:
    """A tiny, hand-written RGB PNG whose IHDR claims width x height (its pixel data is a stub)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + png_chunk(b"IEND", b"")
    )


def noisy_image(size: tuple[int, int] = (64, 64)) -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def pixel(image: Image.Image, xy: tuple[int, int] = (0, 0)) -> tuple[int, int, int]:
    assert image.mode == "RGB"
    return image.getpixel(xy)


def single_pixel(mode: str, value, **info) -> Image.Image:
    image = Image.new(mode, (1, 1), value)
    image.info.update(info)
    return image


@pytest.fixture
def png_path(tmp_path: Path) -> Path:
    path = tmp_path / "picture.png"
    path.write_bytes(encode(Image.fromarray(PIXELS)))
    return path


# --- every input type gives the same picture ----------------------------------------------------


def test_every_input_type_gives_same_pixels_and_content_bytes(png_path: Path) -> None:
    inputs = {
        "png bytes": png_path.read_bytes(),
        "bytearray": bytearray(png_path.read_bytes()),
        "memoryview": memoryview(png_path.read_bytes()),
        "str path": str(png_path),
        "Path": png_path,
        "PIL": Image.fromarray(PIXELS),
        "lazy PIL": Image.open(png_path),
        "numpy uint8": PIXELS,
        "numpy float": PIXELS.astype(np.float64) / 255.0,
        "numpy float32 non-contiguous": np.ascontiguousarray(PIXELS[::-1] / np.float32(255))[::-1],
        "numpy RGBA opaque": np.dstack([PIXELS, np.full(PIXELS.shape[:2], 255, np.uint8)]),
    }
    expected = b"RGB 3x2\n" + PIXELS.tobytes()
    for name, given_image in inputs.items():
        loaded = load_image(given_image)
        assert loaded.mode == "RGB", name
        assert np.array_equal(np.asarray(loaded), PIXELS), name
        assert image_content_bytes(loaded) == expected, name


def test_gray_array_shapes_agree() -> None:
    gray = np.array([[0, 128], [200, 255]], dtype=np.uint8)
    hw = load_image(gray)
    assert image_content_bytes(hw) == image_content_bytes(load_image(gray[:, :, None]))
    assert image_content_bytes(hw) == image_content_bytes(load_image(gray / 255.0))
    assert np.array_equal(np.asarray(hw), np.repeat(gray[:, :, None], 3, axis=2))


def test_content_bytes_differ_for_different_pictures() -> None:
    base = image_content_bytes(load_image(PIXELS))
    changed = PIXELS.copy()
    changed[1, 2, 0] ^= 1
    assert image_content_bytes(load_image(changed)) != base
    # Same raw bytes, different shape: the size is part of the content.
    reshaped = PIXELS.reshape(3, 2, 3)
    assert image_content_bytes(load_image(reshaped)) != base


def test_result_is_a_new_fully_loaded_image(png_path: Path) -> None:
    given_image = Image.fromarray(PIXELS)
    loaded = load_image(given_image)
    assert loaded is not given_image
    assert not isinstance(load_image(png_path), ImageFile.ImageFile)  # no lazy file-backed image
    array = PIXELS.copy()
    from_array = load_image(array)
    array[:] = 0  # the result must not share memory with the caller's array
    assert np.array_equal(np.asarray(from_array), PIXELS)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to count open files")
def test_path_loading_closes_its_file(tmp_path: Path) -> None:
    frames = [Image.new("RGB", (4, 4), color) for color in ("red", "blue")]
    path = tmp_path / "animated.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:])
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        load_image(path)
        with pytest.raises(CorruptImageError):
            load_image(encode(noisy_image(), "PNG")[:500])
    assert len(os.listdir("/proc/self/fd")) == before


# --- modes --------------------------------------------------------------------------------------


def palette_image(transparency: int | None = None) -> Image.Image:
    image = Image.new("P", (2, 1))
    image.putpalette([200, 10, 20, 30, 40, 50])
    image.putpixel((0, 0), 0)
    image.putpixel((1, 0), 1)
    if transparency is not None:
        image.info["transparency"] = transparency
    return image


def rgba_palette_image() -> Image.Image:
    image = Image.new("P", (2, 1))
    image.putpalette([200, 10, 20, 0, 30, 40, 50, 255], rawmode="RGBA")
    image.putpixel((1, 0), 1)
    return image


MODE_CASES = [
    ("RGB", single_pixel("RGB", (1, 2, 3)), (1, 2, 3)),
    ("RGBA transparent", single_pixel("RGBA", (10, 20, 30, 0)), (255, 255, 255)),
    ("RGBA opaque", single_pixel("RGBA", (10, 20, 30, 255)), (10, 20, 30)),
    ("RGBA half", single_pixel("RGBA", (0, 0, 0, 128)), (127, 127, 127)),
    ("RGBa transparent", single_pixel("RGBa", (0, 0, 0, 0)), (255, 255, 255)),
    ("RGBa opaque", single_pixel("RGBa", (10, 20, 30, 255)), (10, 20, 30)),
    ("RGBX", single_pixel("RGBX", (10, 20, 30, 99)), (10, 20, 30)),
    ("LA transparent", single_pixel("LA", (0, 0)), (255, 255, 255)),
    ("LA opaque", single_pixel("LA", (128, 255)), (128, 128, 128)),
    ("La transparent", single_pixel("La", (0, 0)), (255, 255, 255)),
    ("La half", single_pixel("La", (50, 128)), (177, 177, 177)),
    ("PA transparent", single_pixel("PA", (0, 0)), (255, 255, 255)),
    ("L", single_pixel("L", 128), (128, 128, 128)),
    ("L with transparency", single_pixel("L", 7, transparency=7), (255, 255, 255)),
    ("RGB with transparency", single_pixel("RGB", (1, 2, 3), transparency=(1, 2, 3)), (255, 255, 255)),
    ("1 black", single_pixel("1", 0), (0, 0, 0)),
    ("1 white", single_pixel("1", 1), (255, 255, 255)),
    ("P", palette_image(), (200, 10, 20)),
    ("P transparent index", palette_image(transparency=0), (255, 255, 255)),
    ("P RGBA palette", rgba_palette_image(), (255, 255, 255)),
    ("I;16 scaled", single_pixel("I;16", 40000), (156, 156, 156)),
    ("I;16 max", single_pixel("I;16", 65535), (255, 255, 255)),
    ("I;16B scaled", single_pixel("I;16B", 40000), (156, 156, 156)),
    ("I 8-bit values", single_pixel("I", 200), (200, 200, 200)),
    ("I 16-bit values", single_pixel("I", 40000), (156, 156, 156)),
    ("F unit range", single_pixel("F", 0.5), (128, 128, 128)),
    ("F 0..255 range", single_pixel("F", 200.0), (200, 200, 200)),
    ("CMYK white", single_pixel("CMYK", (0, 0, 0, 0)), (255, 255, 255)),
    ("CMYK cyan", single_pixel("CMYK", (255, 0, 0, 0)), (0, 255, 255)),
    ("CMYK black", single_pixel("CMYK", (0, 0, 0, 255)), (0, 0, 0)),
    ("CMYK mixed", single_pixel("CMYK", (10, 20, 30, 40)), (207, 198, 190)),
    ("YCbCr gray", single_pixel("YCbCr", (128, 128, 128)), (128, 128, 128)),
    ("HSV red", single_pixel("HSV", (0, 255, 255)), (255, 0, 0)),
    ("HSV gray", single_pixel("HSV", (0, 0, 128)), (128, 128, 128)),
]


@pytest.mark.parametrize(("name", "image", "expected"), MODE_CASES, ids=[c[0] for c in MODE_CASES])
def test_mode_converts_to_rgb(name: str, image: Image.Image, expected: tuple[int, int, int]) -> None:
    assert pixel(load_image(image)) == expected


def test_palette_keeps_opaque_entries() -> None:
    assert pixel(load_image(palette_image(transparency=0)), (1, 0)) == (30, 40, 50)
    assert pixel(load_image(rgba_palette_image()), (1, 0)) == (30, 40, 50)


@pytest.mark.parametrize(
    ("lab", "expected"), [((255, 128, 128), (255, 255, 255)), ((0, 128, 128), (0, 0, 0))]
)
def test_lab_converts_colorimetrically(lab: tuple[int, int, int], expected: tuple[int, ...]) -> None:
    got = pixel(load_image(single_pixel("LAB", lab)))
    assert all(abs(g - e) <= 2 for g, e in zip(got, expected)), got


def test_wide_range_int_and_float_are_stretched() -> None:
    ints = Image.fromarray(np.array([[-100, 0, 100]], dtype=np.int32))
    assert ints.mode == "I"
    assert [pixel(load_image(ints), (x, 0))[0] for x in range(3)] == [0, 128, 255]
    floats = Image.fromarray(np.array([[0.0, 500.0, 1000.0, np.nan]], dtype=np.float32))
    assert [pixel(load_image(floats), (x, 0))[0] for x in range(4)] == [0, 128, 255, 0]


def test_sixteen_bit_png_is_scaled_not_clipped() -> None:
    values = np.array([[0, 257 * 100, 65535]], dtype=np.uint16)
    loaded = load_image(encode(Image.fromarray(values)))
    assert [pixel(loaded, (x, 0))[0] for x in range(3)] == [0, 100, 255]


def test_transparent_png_composites_on_white() -> None:
    rgba = np.zeros((1, 2, 4), dtype=np.uint8)
    rgba[0, 1] = (1, 2, 3, 255)
    loaded = load_image(encode(Image.fromarray(rgba)))
    assert np.asarray(loaded).tolist() == [[[255, 255, 255], [1, 2, 3]]]
    assert np.asarray(load_image(rgba)).tolist() == [[[255, 255, 255], [1, 2, 3]]]


# --- EXIF orientation and frames ----------------------------------------------------------------


def with_orientation(image: Image.Image, orientation: int) -> Image.Image:
    exif = Image.Exif()
    exif[0x0112] = orientation
    image.info["exif"] = exif.tobytes()
    return image


def test_exif_orientation_is_applied_to_encoded_images() -> None:
    row = Image.fromarray(np.array([[[255, 0, 0], [0, 0, 255]]], dtype=np.uint8))  # red | blue
    data = encode(row, exif=with_orientation(row.copy(), 6).info["exif"])  # 6: rotate 90 cw to view
    loaded = load_image(data)
    assert loaded.size == (1, 2)
    assert np.asarray(loaded).tolist() == [[[255, 0, 0]], [[0, 0, 255]]]


def test_exif_orientation_is_applied_to_jpeg() -> None:
    wide = Image.new("RGB", (32, 16), "white")
    wide.paste((255, 0, 0), (0, 0, 16, 16))
    exif = Image.Exif()
    exif[0x0112] = 8  # 8: rotate 90 ccw to view, so the red left half ends up at the bottom
    loaded = load_image(encode(wide, "JPEG", exif=exif.tobytes(), quality=95))
    assert loaded.size == (16, 32)
    red, green, blue = pixel(loaded, (8, 24))
    assert red > 200 and green < 50 and blue < 50
    assert min(pixel(loaded, (8, 8))) > 200


def test_pil_input_is_used_as_given_without_exif_rotation() -> None:
    row = with_orientation(Image.fromarray(PIXELS), 6)
    assert load_image(row).size == (3, 2)


def test_animated_image_uses_first_frame(tmp_path: Path) -> None:
    frames = [Image.new("RGB", (4, 4), color) for color in ((255, 0, 0), (0, 0, 255))]
    path = tmp_path / "animated.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=10, loop=0)
    assert Image.open(path).n_frames == 2
    assert pixel(load_image(path)) == (255, 0, 0)


# --- decompression bombs ------------------------------------------------------------------------


def test_huge_header_is_rejected_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    data = png_claiming_size(100_000, 100_000)
    assert len(data) < 200

    def no_decoding(self) -> None:
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    with pytest.raises(ImageTooLargeError) as info:
        load_image(data, image_index=2)
    assert str(info.value) == (
        "image 2: 100000x100000 = 10000000000 pixels exceeds "
        f"max_image_pixels={DEFAULT_MAX_IMAGE_PIXELS}"
    )


def test_huge_header_in_a_file_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "bomb.png"
    path.write_bytes(png_claiming_size(20_000, 20_000))
    with pytest.raises(ImageTooLargeError, match="20000x20000 = 400000000 pixels"):
        load_image(path)


def test_pillow_bomb_limit_is_typed_and_no_warning_leaks() -> None:
    limit_before = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Past Pillow's error threshold: Pillow refuses while opening, even with a huge max_pixels.
        with pytest.raises(ImageTooLargeError, match="^image 0: Pillow refuses .* decompression bomb"):
            load_image(png_claiming_size(100_000, 100_000), max_pixels=10**12)
        # In Pillow's warning band: our own check rejects it, without Pillow's warning.
        with pytest.raises(ImageTooLargeError, match="10000x10000"):
            load_image(png_claiming_size(10_000, 10_000))
    assert [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)] == []
    assert Image.MAX_IMAGE_PIXELS == limit_before


def test_small_max_pixels_rejects_every_input_type(png_path: Path) -> None:
    for given_image in (png_path, png_path.read_bytes(), Image.fromarray(PIXELS), PIXELS):
        with pytest.raises(ImageTooLargeError, match="3x2 = 6 pixels exceeds max_image_pixels=5"):
            load_image(given_image, max_pixels=5)
        assert load_image(given_image, max_pixels=6).size == (3, 2)


def test_zero_size_images_are_corrupt() -> None:
    with pytest.raises(CorruptImageError, match="empty"):
        load_image(Image.new("RGB", (0, 5)))
    with pytest.raises(CorruptImageError, match="empty"):
        load_image(np.zeros((0, 4, 3), dtype=np.uint8))


# --- corrupt data -------------------------------------------------------------------------------


def test_truncated_images_fail() -> None:
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    for fmt in ("PNG", "JPEG"):
        data = encode(noisy_image(), fmt)
        with pytest.raises(CorruptImageError, match="^image 0: cannot decode image bytes"):
            load_image(data[: len(data) // 2])


@pytest.mark.parametrize(
    "data",
    [
        bytes(range(256)) * 4,
        b"",
        bytearray(),
        b"\x89PNG\r\n\x1a\n" + b"\x00" * 40,  # PNG signature, broken IHDR
        png_claiming_size(4, 4)[:33] + b"garbage",  # valid header, pixel data missing
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n",  # EPS: never handed to Ghostscript
    ],
    ids=["random", "empty", "empty bytearray", "broken header", "no pixel data", "eps"],
)
def test_corrupt_bytes_raise_corrupt_image_error(data: bytes) -> None:
    with pytest.raises(CorruptImageError, match="^image 0: "):
        load_image(data)


def test_missing_and_unreadable_paths(tmp_path: Path) -> None:
    missing = tmp_path / "nope.png"
    with pytest.raises(CorruptImageError, match="nope.png") as info:
        load_image(missing)
    assert "No such file" in str(info.value)
    with pytest.raises(CorruptImageError, match=str(tmp_path.name)):
        load_image(tmp_path)  # a directory
    not_image = tmp_path / "notes.txt"
    not_image.write_text("hello")
    with pytest.raises(CorruptImageError, match="cannot identify file .*notes.txt.* as an image"):
        load_image(str(not_image))


def test_truncated_file_on_disk_fails(tmp_path: Path) -> None:
    data = encode(noisy_image(), "PNG")
    path = tmp_path / "cut.png"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptImageError, match="cut.png.*truncated"):
        load_image(path)


# --- unsupported types --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((4, 4, 2), dtype=np.uint8),
        np.zeros((3, 4, 4, 3), dtype=np.uint8),
        np.zeros(4, dtype=np.uint8),
        np.zeros((4, 4, 3), dtype=np.int64),
        np.zeros((4, 4, 3), dtype=np.uint16),
        np.zeros((4, 4), dtype=bool),
        np.zeros((4, 4, 1), dtype=np.int32),
        np.full((4, 4, 3), 2.0),
        np.full((4, 4, 3), -0.1, dtype=np.float32),
        np.full((4, 4, 3), np.nan),
    ],
    ids=["2 channels", "4d", "1d", "int64", "uint16", "bool", "int32 HxWx1", "float > 1", "float < 0", "nan"],
)
def test_bad_arrays_are_unsupported(array: np.ndarray) -> None:
    with pytest.raises(UnsupportedImageTypeError, match=r"^image 1: .*numpy array of shape \(") as info:
        load_image(array, image_index=1)
    assert str(array.dtype) in str(info.value)
    assert str(array.shape) in str(info.value)


def test_channels_first_array_names_its_shape() -> None:
    with pytest.raises(UnsupportedImageTypeError, match=r"shape \(3, 8, 8\).*channels last"):
        load_image(np.zeros((3, 8, 8), dtype=np.uint8))


@pytest.mark.parametrize(
    ("value", "type_name"),
    [(3, "int"), ([[0, 0, 0]], "list"), (None, "NoneType"), (object(), "object")],
)
def test_unsupported_types_are_named(value: object, type_name: str) -> None:
    with pytest.raises(UnsupportedImageTypeError, match=f"^image 0: unsupported image type {type_name};"):
        load_image(value)  # type: ignore[arg-type]


def test_torch_tensor_is_unsupported() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(UnsupportedImageTypeError, match="torch.Tensor"):
        load_image(torch.zeros(4, 4, 3, dtype=torch.uint8))  # type: ignore[arg-type]


# --- error contract -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given_image", "error"),
    [
        (b"not an image", CorruptImageError),
        (png_claiming_size(100_000, 100_000), ImageTooLargeError),
        (np.zeros((2, 2), dtype=np.int32), UnsupportedImageTypeError),
        (1.5, UnsupportedImageTypeError),
    ],
)
def test_errors_are_value_errors_naming_image_and_prompt(given_image: object, error: type) -> None:
    with pytest.raises(error) as info:
        load_image(given_image, image_index=7)  # type: ignore[arg-type]
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, InvalidInputError)
    assert str(err).startswith("image 7: ")
    assert str(err.at_prompt(3)).startswith("prompt 3: image 7: ")


def test_invalid_max_pixels_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_pixels"):
        load_image(PIXELS, max_pixels=0)


# --- property -----------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.uint8, st.tuples(st.integers(1, 8), st.integers(1, 8), st.just(3))))
def test_rgb_arrays_round_trip_exactly(array: np.ndarray) -> None:
    expected = f"RGB {array.shape[1]}x{array.shape[0]}\n".encode() + array.tobytes()
    for given_image in (
        array,
        array / 255.0,
        encode(Image.fromarray(array)),
        Image.fromarray(array),
    ):
        assert image_content_bytes(load_image(given_image)) == expected
