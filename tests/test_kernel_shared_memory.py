"""The GEMM launchers' tiles and pipeline stages fit the device's shared memory: the W4A16 and FP8 weight
GEMMs, the fused MoE's two grouped GEMMs and LoRA's segmented matmul, in fp32, fp16 and bf16, on a
Hopper-class limit (sm_90: 232448 bytes) and a consumer one (sm_86/sm_89: 101376 bytes). The arithmetic runs
anywhere; where Triton ships its NVIDIA toolchain the chosen launches are also compiled for sm_90 and the
shared memory Triton allocates is checked against that arithmetic (test_kernel_cross_compile.py, in the process that
compiles every kernel)."""

from __future__ import annotations

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


def gemm_shared_bytes(tiles: GemmTiles, act_bytes: int, weight_bytes: int, weight_tiles: int = 1) -> int:
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
        assert tiles.shared_bytes == gemm_shared_bytes(tiles, act_bytes, weight_bytes, weight_tiles), name
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
    assert gemm_shared_bytes(old, 4, 12) > SM90_SHARED_MEMORY  # the arithmetic refuses the configuration that failed
    # less shared memory: fewer stages, the tiles kept
    consumer = weight_gemm_tiles(64, 200, 4096, 2, 8, CONSUMER_SHARED_MEMORY)
    assert consumer.num_stages == 2 and consumer.block_k == 64


def test_the_limit_is_read_from_the_device():
    assert shared_memory_limit(torch.device("cpu")) == SM90_SHARED_MEMORY  # none to read: sm_90's
    if torch.cuda.is_available():
        props = triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())
        assert shared_memory_limit(torch.device("cuda")) == props["max_shared_mem"]
