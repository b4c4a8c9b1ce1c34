"""The kernels compile for real GPUs (sm_80 and sm_90, fp16 and bf16) with the launchers' own
choices, checked without a GPU: Triton's compiler and ptxas run on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

NVIDIA_TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@pytest.mark.skipif(not (NVIDIA_TOOLS / "cuobjdump").exists(), reason="this Triton build ships no NVIDIA toolchain")
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills(tmp_path, triton_cache_dir):
    report = tmp_path / "resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # kernels must be real JIT functions
    env["TRITON_CACHE_DIR"] = str(triton_cache_dir)
    result = subprocess.run(
        [sys.executable, "-m", "mmengine.kernels.cross_compile", "--quick", "--json", str(report)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(report.read_text())
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
CASCADE_LAUNCHES = """
import json, numpy as np, torch
from mmengine.kernels.cascade_attention import cascade_prefix_attention
from mmengine.kernels.cross_compile import capture_launches, specialization
from mmengine.layers.cascade import CascadeGroup, CascadeMetadata, layout_cascade, tokens_per_tile

def specializations(heads, kv_heads):
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

print(json.dumps({f"{heads}-{kv_heads}": specializations(heads, kv_heads) for heads, kv_heads in %r}))
""" % (CASCADE_SHAPES,)


@pytest.fixture(scope="module")
def cascade_specializations() -> dict[str, list[list[str]]]:
    """For each shape of CASCADE_SHAPES, what the cascade kernels' launches compile at 1, 2, 4 and 16 splits, recorded
    in one process for all (the kernels must be real JIT functions: not in this one, whose interpreter is on)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", CASCADE_LAUNCHES], env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("heads,kv_heads", CASCADE_SHAPES)
def test_the_cascade_kernels_compile_once_for_every_split_count(cascade_specializations, heads, kv_heads):
    """The split count a step picks changes the partial states' strides; those are not specialized
    on, so the kernels warm-up compiled serve every count and none compiles on the request path."""
    keys = cascade_specializations[f"{heads}-{kv_heads}"]
    assert len(keys[0]) == 2 and all(k == keys[0] for k in keys), "a split count changes what the cascade kernels compile"
