"""The GEMM launchers' tiles and pipeline stages fit the device's shared memory: the W4A16 and FP8 weight
GEMMs, the fused MoE's two grouped GEMMs and LoRA's segmented matmul, in fp32, fp16 and bf16, on a
Hopper-class limit (sm_90: 232448 bytes) and a consumer one (sm_86/sm_89: 101376 bytes). The arithmetic runs
anywhere; where Triton ships its NVIDIA toolchain the chosen launches are also compiled for sm_90 and the
shared memory Triton allocates is checked against that arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from mmengine.kernels.common import SM90_SHARED_MEMORY, GemmTiles, shared_memory_limit
from mmengine.kernels.fused_moe import moe_tiles
from mmengine.kernels.lora import lora_tiles
from mmengine.kernels.weight_gemm import weight_gemm_tiles

CONSUMER_SHARED_MEMORY = 101376
LIMITS = [pytest.param(SM90_SHARED_MEMORY, id="sm90"), pytest.param(CONSUMER_SHARED_MEMORY, id="consumer")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
NVIDIA_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _bytes(tiles: GemmTiles, act_bytes: int, weight_bytes: int, weight_tiles: int = 1) -> int:
    """The dot's operands (activation tile and weight tiles in the activations' dtype) once, and per stage
    past the first every tile one K step loads: the activations and the weights as stored."""
    a = tiles.block_m * tiles.block_k
    b = weight_tiles * tiles.block_k * tiles.block_n
    return (a + b) * act_bytes + (tiles.num_stages - 1) * (a * act_bytes + b * weight_bytes)


def _configs(dtype: torch.dtype, limit: int) -> list[tuple[str, GemmTiles, int, int, int]]:
    """(name, tiles, activation bytes, weight bytes loaded per element, weight tiles) of each launcher, for
    decode- and prefill-shaped row counts over a 4096 x 11008 projection."""
    e = dtype.itemsize
    int4 = 4 + 2 * e  # the int32 word re-read per nibble, a scale and a zero point (in the activations' dtype)
    fp8 = 1 + 4  # e4m3 and an fp32 scale
    configs = []
    for m in (1, 17, 64, 1000):
        configs += [(f"w4a16 m={m}", weight_gemm_tiles(m, 4096, 11008, e, int4, limit), e, int4, 1),
                    (f"fp8 m={m}", weight_gemm_tiles(m, 4096, 11008, e, fp8, limit), e, fp8, 1),
                    (f"lora shrink m={m}", lora_tiles(m, 48, 4096, e, e, limit), e, e, 1),
                    (f"lora expand m={m}", lora_tiles(m, 4096, 48, e, e, limit), e, e, 1)]
    for name, weight_bytes in (("dense", e), ("fp8", fp8), ("int4", int4)):
        configs += [(f"moe gate_up {name}", moe_tiles(512, 4096, e, weight_bytes, limit, weight_tiles=2), e, weight_bytes, 2),
                    (f"moe down {name}", moe_tiles(4096, 512, e, weight_bytes, limit, weight_tiles=1), e, weight_bytes, 1)]
    return configs


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_gemm_launch_fits_the_shared_memory(dtype, limit):
    for name, tiles, act_bytes, weight_bytes, weight_tiles in _configs(dtype, limit):
        assert tiles.shared_bytes == _bytes(tiles, act_bytes, weight_bytes, weight_tiles), name
        assert 1 <= tiles.num_stages and tiles.shared_bytes <= limit, (name, tiles)
        if limit == SM90_SHARED_MEMORY:
            assert tiles.num_stages >= 2, (name, tiles)  # fp32 too keeps its loads pipelined on Hopper


def test_fp32_takes_half_the_k_tile_and_keeps_the_stages_of_16_bit():
    """What failed on an H200: the fp32 W4A16 GEMM in 64 x 128 x 64 tiles and 3 stages wanted 262144 bytes
    (the int4 words, scales and zeros are buffered per stage too). fp32 now takes K tiles of 32."""
    fp32 = weight_gemm_tiles(64, 200, 4096, 4, 12, SM90_SHARED_MEMORY)
    bf16 = weight_gemm_tiles(64, 200, 4096, 2, 8, SM90_SHARED_MEMORY)
    assert (fp32.block_k, bf16.block_k) == (32, 64) and fp32.num_stages == bf16.num_stages == 3
    old = GemmTiles(64, 128, 64, 3, 0)
    assert _bytes(old, 4, 12) > SM90_SHARED_MEMORY  # the arithmetic refuses the configuration that failed
    # less shared memory: fewer stages, the tiles kept
    consumer = weight_gemm_tiles(64, 200, 4096, 2, 8, CONSUMER_SHARED_MEMORY)
    assert consumer.num_stages == 2 and consumer.block_k == 64


def test_the_limit_is_read_from_the_device():
    assert shared_memory_limit(torch.device("cpu")) == SM90_SHARED_MEMORY  # none to read: sm_90's
    if torch.cuda.is_available():
        props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
        assert shared_memory_limit(torch.device("cuda")) == props["max_shared_mem"]


COMPILE_LAUNCHES = """
import json, sys, torch
from unittest import mock
from mmengine.kernels import fused_moe, lora, weight_gemm
from mmengine.kernels.cross_compile import capture_launches, compile_launch
from mmengine.kernels.fp8_gemm import fp8_matmul
from mmengine.kernels.w4a16 import w4a16_matmul

def launches(dtype):
    x = torch.empty(64, 1024, dtype=dtype)
    scales = torch.empty(8, 512, dtype=dtype)
    gate_up_scales, down_scales = torch.empty(4, 8, 1024, dtype=dtype), torch.empty(4, 4, 1024, dtype=dtype)
    segments = [torch.tensor(v, dtype=torch.int32) for v in ([0], [64], [0])]
    with capture_launches() as recorded:
        w4a16_matmul(x, torch.empty(128, 512, dtype=torch.int32), scales, scales, 128)
        fp8_matmul(x, torch.empty(512, 1024, dtype=torch.float8_e4m3fn), torch.empty(512, 8), 128)
        fused_moe.fused_moe(x, torch.empty(4, 128, 1024, dtype=torch.int32), torch.empty(4, 64, 1024, dtype=torch.int32),
                            torch.full((64, 2), 0.5, dtype=dtype), torch.arange(128).remainder(4).view(64, 2),
                            gate_up_scales, down_scales, 128, gate_up_scales, down_scales)
        lora.segmented_matmul(x, torch.empty(1, 4096, 1024, dtype=dtype), torch.empty(64, 4096, dtype=dtype), *segments, 64, False)
    return recorded

rows = []
for limit in (232448, 101376):
    with mock.patch.object(fused_moe, "shared_memory_limit", lambda device: limit), \\
         mock.patch.object(lora, "shared_memory_limit", lambda device: limit), \\
         mock.patch.object(weight_gemm, "shared_memory_limit", lambda device: limit):
        for dtype in (torch.float32, torch.bfloat16):
            for launch in launches(dtype):
                compiled, constexprs = compile_launch(launch, 90)
                rows.append({"kernel": launch.name, "limit": limit, "act_bytes": dtype.itemsize, "shared": compiled.metadata.shared,
                             "tiles": [constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")] + [launch.kwargs["num_stages"]]})
json.dump(rows, sys.stdout)
"""


@pytest.mark.skipif(not (NVIDIA_TOOLS / "ptxas").exists(), reason="this Triton build ships no NVIDIA toolchain")
def test_compiled_for_sm90_the_launches_take_no_more_than_the_arithmetic(triton_cache_dir):
    """Triton's own allocation for the launches chosen under each limit (fp32 and bf16, prefill-shaped): at
    most the arithmetic's, so within the limit."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the kernels must be real JIT functions
    env["TRITON_CACHE_DIR"] = str(triton_cache_dir)  # (shared with the cross-compile test: two launches are alike)
    result = subprocess.run([sys.executable, "-c", COMPILE_LAUNCHES], env=env, capture_output=True, text=True, timeout=900,
                            check=False)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    for row in rows:
        e = row["act_bytes"]
        weight_bytes, weight_tiles = {"_w4a16_kernel": (4 + 2 * e, 1), "_fp8_gemm_kernel": (5, 1), "_gate_up_kernel": (4 + 2 * e, 2),
                                      "_down_kernel": (4 + 2 * e, 1), "_segmented_matmul_kernel": (e, 1)}[row["kernel"]]
        estimate = _bytes(GemmTiles(*row["tiles"], shared_bytes=0), e, weight_bytes, weight_tiles)
        assert 0 < row["shared"] <= estimate <= row["limit"], row
    assert len({(r["kernel"], r["limit"]) for r in rows}) == 5 * 2
