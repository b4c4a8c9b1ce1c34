"""Deterministic, structured test images in any PIL mode and size."""

from __future__ import annotations

import numpy as np
import PIL.Image
import PIL.ImageDraw


def make_test_image(seed: int, size: tuple[int, int] = (48, 40), mode: str = "RGB") -> PIL.Image.Image:
    """A deterministic, structured (non-constant) image of `size` = (width, height) in any PIL `mode`.

    A seed-dependent colour gradient with a few rectangles and ellipses on top; modes with an alpha band
    (RGBA, LA, ...) get a non-constant alpha and CMYK a non-zero K band, so conversions are exercised.
    """
    rng = np.random.default_rng(seed)
    width, height = size
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    u, v = xs / max(width - 1, 1), ys / max(height - 1, 1)
    start, end, cross = (rng.uniform(0, 255, 3).astype(np.float32) for _ in range(3))
    rgb = start * (1 - u[..., None]) + end * u[..., None] + (cross - 128) * (v[..., None] - 0.5)
    img = PIL.Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8), "RGB")
    draw = PIL.ImageDraw.Draw(img)
    for _ in range(4):
        x0, x1 = sorted(int(x) for x in rng.integers(0, width, 2))
        y0, y1 = sorted(int(y) for y in rng.integers(0, height, 2))
        fill = tuple(int(c) for c in rng.integers(0, 256, 3))
        shape = draw.rectangle if rng.random() < 0.5 else draw.ellipse
        shape((x0, y0, x1 + 1, y1 + 1), fill=fill)
    if mode == "CMYK":  # PIL's RGB->CMYK leaves K at 0; separate properly so all four bands carry signal
        rgb01 = np.asarray(img, dtype=np.float32) / 255
        k = 1 - rgb01.max(axis=-1, keepdims=True)
        cmy = (1 - rgb01 - k) / np.maximum(1 - k, 1e-6)
        return PIL.Image.fromarray(np.round(np.concatenate([cmy, k], -1) * 255).astype(np.uint8), "CMYK")
    if "A" in PIL.Image.new(mode, (1, 1)).getbands():
        alpha = (64 + 191 * np.abs(np.sin(3 * u + 2 * v + seed))).astype(np.uint8)
        img.putalpha(PIL.Image.fromarray(alpha, "L"))
    return img if img.mode == mode else img.convert(mode)
