"""The kernels compile for real GPUs (sm_80 and sm_90, fp16 and bf16) with the launchers' own
choices, checked without a GPU: Triton's compiler and ptxas run on the CPU. Also compiled here, in the same process:
the GEMM launches of test_kernel_shared_memory.py, for sm_90 under each shared-memory limit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from test_kernel_shared_memory import gemm_shared_bytes

from mmengine.kernels.common import GemmTiles

NVIDIA_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(not (NVIDIA_TOOLS / "cuobjdump").exists(), reason="this Triton build ships no NVIDIA toolchain")
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills(compiled):
    assert compiled["cross_compile_status"] == 0, compiled["output"]
    rows = compiled["resources"]
    kernels = {"_store_kv_kernel", "_prefill_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_merge_kernel",
               "_rotary_kv_kernel", "_rms_norm_kernel", "_silu_and_mul_kernel", "_shared_prefix_kernel", "_merge_prefix_kernel",
               "_segmented_matmul_kernel", "_gate_up_kernel", "_down_kernel", "_w4a16_kernel", "_fp8_gemm_kernel"}
    # (the FP8-weight GEMM on sm_80 is the one reading the weights' bits: e4m3 needs sm_89)
    assert {(r["kernel"], r["arch"]) for r in rows} == {(k, a) for k in kernels for a in (80, 90)}
    assert {r["case"].split()[0] for r in rows} == {"bf16", "fp16"}
    for r in rows:
        assert r["registers"] > 0 and r["local_bytes"] == 0, r
    prefill = {r["arch"]: r for r in rows if r["kernel"] == "_prefill_kernel" and r["case"].startswith("bf16")}
    assert prefill[90]["constexprs"]["GROUP"] == 8
    # On tensor cores, Hopper's warpgroup MMA on sm_90, with K/V tiles prefetched asynchronously.
    assert prefill[90]["mma"] == "wgmma" and prefill[80]["mma"] == "mma"
    assert prefill[90]["async_copy"] and prefill[90]["shared_bytes"] > 0
    # The decoder's fused ops: rotary with the K/V store compiled in, RMSNorm alone and with the residual add.
    assert all(r["constexprs"]["STORE_KV"] for r in rows if r["kernel"] == "_rotary_kv_kernel")
    assert {r["constexprs"]["HAS_RESIDUAL"] for r in rows if r["kernel"] == "_rms_norm_kernel"} == {False, True}
    # LoRA's segmented matmul: the shrink and the accumulating expand, each on tensor cores.
    lora = [r for r in rows if r["kernel"] == "_segmented_matmul_kernel"]
    assert {r["constexprs"]["ACCUMULATE"] for r in lora} == {False, True} and all(r["mma"] in ("mma", "wgmma") for r in lora)
    # The fused MoE MLP's grouped GEMMs, on tensor cores too.
    moe = [r for r in rows if r["kernel"] in ("_gate_up_kernel", "_down_kernel", "_w4a16_kernel", "_fp8_gemm_kernel")]
    assert moe and all(r["mma"] in ("mma", "wgmma") for r in moe)  # (and the W4A16 and FP8 GEMMs)
    # The FP8 KV cache: the quantizing stores (e4m3 on sm_90; its bits, converted in integer arithmetic, on sm_80)
    fp8 = [r for r in rows if r["constexprs"].get("FP8")]
    assert {(r["kernel"], r["arch"]) for r in fp8} == {(k, a) for k in ("_store_kv_kernel", "_rotary_kv_kernel") for a in (80, 90)}


def test_capturing_launches_refuses_interpreted_kernels(monkeypatch):
    from mmengine.kernels.cross_compile import capture_launches

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"), capture_launches():
        pass


CASCADE_SHAPES = [(32, 32), (28, 4)]  # (query heads, KV heads)
# One process for every compile of this file (and the launches it records): the kernels must be real JIT functions, not
# interpreted as in this one; a launch compiled twice (alike in two checks) is compiled once.
COMPILES = """
import json, sys, numpy as np, torch
from unittest import mock
from mmengine.kernels import cross_compile, fused_moe, lora, weight_gemm
from mmengine.kernels.cascade_attention import cascade_prefix_attention
from mmengine.kernels.cross_compile import capture_launches, compile_launch, specialization
from mmengine.kernels.fp8_gemm import fp8_matmul
from mmengine.kernels.w4a16 import w4a16_matmul
from mmengine.layers.cascade import CascadeGroup, CascadeMetadata, layout_cascade, tokens_per_tile

def cascade_specializations(heads, kv_heads):
    dim, block = 128, 16
    cache = torch.empty(2, 8, block, kv_heads, dim, dtype=torch.bfloat16)
    query = torch.empty(8, heads, dim, dtype=torch.bfloat16)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    keys = []
    for splits in (1, 2, 4, 16):
        layout = layout_cascade([CascadeGroup([0, 1], 2)], np.array([1, 7]), np.array([40, 33]), np.zeros((2, 4), dtype=np.int64),
                                block, tokens_per_tile(heads, kv_heads), splits)
        with capture_launches() as launches:
            cascade_prefix_attention(query, cache, CascadeMetadata.from_layout(layout, torch.device("cpu")), tables, 0.1,
                                     query.clone(), torch.empty(8, heads))
        keys.append([repr(specialization(launch)) for launch in launches])
    return keys

def gemm_launches(dtype):
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

def gemm_rows():
    rows = []
    for limit in (232448, 101376):
        with mock.patch.object(fused_moe, "shared_memory_limit", lambda device: limit), \\
             mock.patch.object(lora, "shared_memory_limit", lambda device: limit), \\
             mock.patch.object(weight_gemm, "shared_memory_limit", lambda device: limit):
            for dtype in (torch.float32, torch.bfloat16):
                for launch in gemm_launches(dtype):
                    compiled, constexprs = compile_launch(launch, 90)
                    rows.append({"kernel": launch.name, "limit": limit, "act_bytes": dtype.itemsize, "shared": compiled.metadata.shared,
                                 "tiles": [constexprs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")] + [launch.kwargs["num_stages"]]})
    return rows

report, toolchain = sys.argv[1], sys.argv[2] == "1"
found = {"cascade": {f"{heads}-{kv_heads}": cascade_specializations(heads, kv_heads) for heads, kv_heads in %r}}
if toolchain:
    found["cross_compile_status"] = cross_compile.main(["--quick", "--json", report])
    found["gemm"] = gemm_rows()
print(json.dumps(found))
""" % (CASCADE_SHAPES,)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, triton_cache_dir) -> dict:
    """In one process (the kernels real JIT functions): for each shape of CASCADE_SHAPES, what the cascade kernels'
    launches compile at 1, 2, 4 and 16 splits; where Triton ships its NVIDIA toolchain, `cross_compile --quick`'s
    report and status and the GEMM launches chosen under each shared-memory limit, compiled for sm_90."""
    report = tmp_path_factory.mktemp("cross-compile") / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(triton_cache_dir)
    toolchain = (NVIDIA_TOOLS / "cuobjdump").exists() and (NVIDIA_TOOLS / "ptxas").exists()
    result = subprocess.run([sys.executable, "-c", COMPILES, str(report), "1" if toolchain else "0"], env=env,
                            capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    found["output"] = result.stdout[-3000:]
    if toolchain:
        found["resources"] = json.loads(report.read_text())
    return found


@pytest.mark.parametrize("heads,kv_heads", CASCADE_SHAPES)
def test_the_cascade_kernels_compile_once_for_every_split_count(compiled, heads, kv_heads):
    """The split count a step picks changes the partial states' strides; those are not specialized
    on, so the kernels warm-up compiled serve every count and none compiles on the request path."""
    keys = compiled["cascade"][f"{heads}-{kv_heads}"]
    assert len(keys[0]) == 2 and all(k == keys[0] for k in keys), "a split count changes what the cascade kernels compile"


@pytest.mark.skipif(not (NVIDIA_TOOLS / "ptxas").exists(), reason="this Triton build ships no NVIDIA toolchain")
def test_compiled_for_sm90_the_gemm_launches_take_no_more_than_the_arithmetic(compiled):
    """test_kernel_shared_memory.py's launches (the W4A16 and FP8 GEMMs, the fused MoE's two and LoRA's, prefill-shaped)
    chosen under each limit in fp32 and bf16: Triton's own allocation at most the arithmetic's, so within the limit."""
    rows = compiled["gemm"]
    for row in rows:
        e = row["act_bytes"]
        weight_bytes, weight_tiles = {"_w4a16_kernel": (4 + 2 * e, 1), "_fp8_gemm_kernel": (5, 1), "_gate_up_kernel": (4 + 2 * e, 2),
                                      "_down_kernel": (4 + 2 * e, 1), "_segmented_matmul_kernel": (e, 1)}[row["kernel"]]
        estimate = gemm_shared_bytes(GemmTiles(*row["tiles"], shared_bytes=0), e, weight_bytes, weight_tiles)
        assert 0 < row["shared"] <= estimate <= row["limit"], row
    assert len({(r["kernel"], r["limit"]) for r in rows}) == 5 * 2
