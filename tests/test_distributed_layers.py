"""The tensor-parallel layers (mmengine/distributed/): at TP 2 on CPU with gloo, in two rank processes, each
layer's output equals the unsharded nn.Linear / nn.Embedding on the same weights (fp32), the weights read
from a real safetensors file through its slices; a tiny attention + MLP block (column then row) equals the
unsharded block; the KV-head rule (split, replicated, refused) and shapes that do not divide, refused by name.

Ranks are two workers of one MultiprocExecutor for the whole module; construction and loading rules need no
collective and run in this process, with a TensorParallelGroup that only says its rank and size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from mmengine.distributed.checkpoint_slices import CheckpointSlices, load_parameter
from mmengine.distributed.executor import MultiprocExecutor
from mmengine.distributed.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from mmengine.distributed.process_group import TensorParallelGroup, file_address, single_rank_group
from mmengine.distributed.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from mmengine.errors import ConfigError, WeightsMismatchError
from mmengine.models.loader import WeightCheck

TP = 2
HIDDEN, INTER, HEAD, HEADS, KV_HEADS, VOCAB = 16, 24, 4, 4, 2, 37  # VOCAB does not divide: padded to 38
ATOL = 1e-5


class FunctionWorker:
    """A rank that runs the function it is sent with its TP group: `call("run", fn, *args)`."""

    def __init__(self, tp: TensorParallelGroup) -> None:
        self.tp = tp

    def run(self, fn, *args):
        return fn(self.tp, *args)


def fake_rank(rank: int, size: int = TP) -> TensorParallelGroup:
    return TensorParallelGroup(rank, size, torch.device("cpu"))  # construction and loading only: no collective


# -- what the ranks run (top-level, so that they cross to the worker processes by name) --------------------------


def slices(path: str):
    return safe_open(path, framework="pt")


def load(layer: torch.nn.Module, f, prefix: str) -> None:
    for name, param in layer.named_parameters(recurse=False):
        param.weight_loader(param, f.get_slice(f"{prefix}.{name}"))


def rank_column(tp, path, x, gather):
    layer = ColumnParallelLinear(HIDDEN, INTER, bias=True, gather_output=gather, tp=tp, name="up")
    load(layer, slices(path), "up")
    return layer(x)


def rank_row(tp, path, x_full):
    layer = RowParallelLinear(INTER, HIDDEN, bias=True, input_is_parallel=False, tp=tp, name="down")
    load(layer, slices(path), "down")
    return layer(x_full)


def rank_row_quantized(tp, path, x_full, e4m3, scales):
    """The rank's columns of an e4m3 weight in TP 1's Fp8Linear, inside QuantizedRowParallel (distributed/quantized_parallel.py)."""
    from mmengine.distributed.quantized_parallel import QuantizedRowParallel
    from mmengine.layers.quantized_linear import Fp8Linear

    dense = RowParallelLinear(INTER, HIDDEN, bias=True, input_is_parallel=False, tp=tp, name="down")
    load(dense, slices(path), "down")
    size = INTER // tp.size
    e4m3 = e4m3.view(torch.float8_e4m3fn)  # (sent as its bytes)
    quantized = Fp8Linear(e4m3[:, tp.rank * size : (tp.rank + 1) * size], scales, size, None)
    return QuantizedRowParallel(quantized, dense)(x_full)


def rank_merged(tp, path, x):
    layer = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False, tp=tp, name="gate_up")
    f = slices(path)
    layer.weight_loader(layer.weight, f.get_slice("gate.weight"), 0)
    layer.weight_loader(layer.weight, f.get_slice("up.weight"), 1)
    return layer(x)


def rank_embedding(tp, path, ids):
    layer = VocabParallelEmbedding(VOCAB, HIDDEN, tp=tp, name="embed")
    load(layer, slices(path), "embed")
    return layer(ids)


def rank_lm_head(tp, path, h):
    layer = ParallelLMHead(VOCAB, HIDDEN, bias=True, tp=tp, name="lm_head")
    load(layer, slices(path), "lm_head")
    return layer(h)


def rank_collectives(tp):
    mine = torch.full((2, 1), float(tp.rank))
    return tp.broadcast_object({"plan": [1, 2]} if tp.rank == 0 else None), tp.all_gather_last_dim(mine), tp.all_reduce(mine.clone())


def attention(q, k, v, heads: int, kv_heads: int) -> torch.Tensor:
    """Causal attention over [tokens, heads * HEAD], GQA by repeating KV heads; the same math at any TP."""
    tokens = q.shape[0]
    q = q.view(tokens, heads, HEAD).transpose(0, 1)
    k = k.view(tokens, kv_heads, HEAD).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    v = v.view(tokens, kv_heads, HEAD).transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(tokens, heads * HEAD)


class Block(torch.nn.Module):
    """x + o(attn(qkv(norm(x)))), then + down(silu(gate(x)) * up(x)): column-parallel in, row-parallel out; the
    norm's weight is replicated on every rank."""

    # checkpoint name -> (our parameter, its piece): the stacking a model family's loader would spell out
    CHECKPOINT_NAMES = {
        "norm.weight": ("norm", None), "o_proj.weight": ("o.weight", None),
        "gate.weight": ("gate_up.weight", 0), "up.weight": ("gate_up.weight", 1),
        "down.weight": ("down.weight", None), "down.bias": ("down.bias", None),
        **{f"{p}_proj.{kind}": (f"qkv.{kind}", p) for p in "qkv" for kind in ("weight", "bias")},
    }

    def __init__(self, tp: TensorParallelGroup, kv_heads: int) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.empty(HIDDEN), requires_grad=False)
        self.qkv = QKVParallelLinear(HIDDEN, HEAD, HEADS, kv_heads, bias=True, tp=tp, name="qkv")
        self.o = RowParallelLinear(HEADS * HEAD, HIDDEN, bias=False, tp=tp, name="o")
        self.gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False, tp=tp, name="gate_up")
        self.down = RowParallelLinear(INTER, HIDDEN, bias=True, tp=tp, name="down")

    def load(self, checkpoint_dir: str) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor_slice in CheckpointSlices(checkpoint_dir):
            if name in self.CHECKPOINT_NAMES:
                ours, piece = self.CHECKPOINT_NAMES[name]
                load_parameter(params[ours], tensor_slice, piece, name)
                loaded.add(name)
        return loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv.split(self.qkv(F.rms_norm(x, (HIDDEN,), self.norm)))
        x = x + self.o(attention(q, k, v, self.qkv.num_heads_per_rank, self.qkv.num_kv_heads_per_rank))
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def rank_block(tp, path, x, kv_heads):
    block = Block(tp, kv_heads)
    assert block.load(str(Path(path).parent)) == set(Block.CHECKPOINT_NAMES)
    return block(x)


# -- the unsharded reference, the checkpoint, the ranks ------------------------------------------------------


def reference_block(w: dict[str, torch.Tensor], x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    normed = F.rms_norm(x, (HIDDEN,), w["norm.weight"])
    q = F.linear(normed, w["q_proj.weight"], w["q_proj.bias"])
    k = F.linear(normed, w["k_proj.weight"], w["k_proj.bias"])
    v = F.linear(normed, w["v_proj.weight"], w["v_proj.bias"])
    x = x + F.linear(attention(q, k, v, HEADS, kv_heads), w["o_proj.weight"])
    return x + F.linear(F.silu(F.linear(x, w["gate.weight"])) * F.linear(x, w["up.weight"]), w["down.weight"], w["down.bias"])


def checkpoint_tensors(kv_heads: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.3

    return {
        "up.weight": rand(INTER, HIDDEN), "up.bias": rand(INTER), "gate.weight": rand(INTER, HIDDEN),
        "down.weight": rand(HIDDEN, INTER), "down.bias": rand(HIDDEN),
        "embed.weight": rand(VOCAB, HIDDEN), "lm_head.weight": rand(VOCAB, HIDDEN), "lm_head.bias": rand(VOCAB),
        "q_proj.weight": rand(HEADS * HEAD, HIDDEN), "q_proj.bias": rand(HEADS * HEAD),
        "k_proj.weight": rand(kv_heads * HEAD, HIDDEN), "k_proj.bias": rand(kv_heads * HEAD),
        "v_proj.weight": rand(kv_heads * HEAD, HIDDEN), "v_proj.bias": rand(kv_heads * HEAD),
        "o_proj.weight": rand(HIDDEN, HEADS * HEAD), "norm.weight": 1 + rand(HIDDEN),
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, tuple[str, dict[str, torch.Tensor]]]:
    """kv heads -> (a safetensors file, its tensors): 2 KV heads split over 2 ranks, 1 replicated on both."""
    out = {}
    for kv_heads in (KV_HEADS, 1):
        tensors = checkpoint_tensors(kv_heads, seed=kv_heads)
        path = tmp_path_factory.mktemp("tp") / f"kv{kv_heads}.safetensors"
        save_file(tensors, str(path))
        out[kv_heads] = (str(path), tensors)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    rendezvous = file_address(tmp_path_factory.mktemp("rendezvous") / "store")  # no TCP port to race for
    with MultiprocExecutor(FunctionWorker, TP, rendezvous=rendezvous, torch_threads=1) as executor:
        yield executor


def inputs(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# -- at TP 2 in two processes --------------------------------------------------------------------------------


@pytest.mark.parametrize("gather", [True, False])
def test_column_parallel_equals_linear(ranks, checkpoints, gather):
    path, w = checkpoints[KV_HEADS]
    x = inputs(5, HIDDEN)
    expected = F.linear(x, w["up.weight"], w["up.bias"])
    outs = ranks.call("run", rank_column, path, x, gather)
    if gather:
        for out in outs:
            torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)
    else:
        assert [o.shape[-1] for o in outs] == [INTER // TP] * TP
        torch.testing.assert_close(torch.cat(outs, dim=-1), expected, atol=ATOL, rtol=0)


def test_row_parallel_equals_linear_with_the_bias_once(ranks, checkpoints):
    path, w = checkpoints[KV_HEADS]
    x = inputs(5, INTER)
    expected = F.linear(x, w["down.weight"], w["down.bias"])
    for out in ranks.call("run", rank_row, path, x):
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_a_quantized_row_parallel_layer_all_reduces_then_adds_the_bias_once(ranks, checkpoints):
    """FP8 weights per channel, each rank's columns through the FP8 GEMM (the Triton interpreter here), the input
    narrowed to the rank's share: the all-reduced sum plus the bias once equals the dequantized linear."""
    path, w = checkpoints[KV_HEADS]
    scales = w["down.weight"].abs().amax(dim=1, keepdim=True) / 448
    e4m3 = (w["down.weight"] / scales).to(torch.float8_e4m3fn)
    x = inputs(5, INTER)
    expected = F.linear(x, e4m3.float() * scales, w["down.bias"])
    for out in ranks.call("run", rank_row_quantized, path, x, e4m3.view(torch.uint8), scales):
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_merged_column_splits_each_piece(ranks, checkpoints):
    path, w = checkpoints[KV_HEADS]
    x = inputs(3, HIDDEN)
    gate, up = F.linear(x, w["gate.weight"]), F.linear(x, w["up.weight"])
    half = INTER // TP
    for rank, out in enumerate(ranks.call("run", rank_merged, path, x)):
        expected = torch.cat([gate[:, rank * half:(rank + 1) * half], up[:, rank * half:(rank + 1) * half]], dim=-1)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_vocab_parallel_embedding_equals_embedding(ranks, checkpoints):
    path, w = checkpoints[KV_HEADS]
    ids = torch.tensor([[0, 5, 18, 19, 36], [36, 20, 1, 18, 19]])  # both ranks' ranges, their edges, the last token
    expected = F.embedding(ids, w["embed.weight"])
    for out in ranks.call("run", rank_embedding, path, ids):
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_parallel_lm_head_gathers_the_logits(ranks, checkpoints):
    path, w = checkpoints[KV_HEADS]
    h = inputs(4, HIDDEN)
    expected = F.linear(h, w["lm_head.weight"], w["lm_head.bias"])
    for out in ranks.call("run", rank_lm_head, path, h):
        assert out.shape == (4, VOCAB)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kv_heads", [KV_HEADS, 1], ids=["kv-split", "kv-replicated"])
def test_attention_and_mlp_block_equals_the_unsharded_block(ranks, checkpoints, kv_heads):
    path, w = checkpoints[kv_heads]
    x = inputs(6, HIDDEN)
    expected = reference_block(w, x, kv_heads)
    for out in ranks.call("run", rank_block, path, x, kv_heads):
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_the_group_broadcasts_gathers_and_reduces(ranks):
    for obj, gathered, reduced in ranks.call("run", rank_collectives):
        assert obj == {"plan": [1, 2]}
        torch.testing.assert_close(gathered, torch.tensor([[0.0, 1.0], [0.0, 1.0]]))
        torch.testing.assert_close(reduced, torch.full((2, 1), 1.0))


# -- construction and loading rules (no collective: in this process) ------------------------------------------


class RecordingSlice:
    """A safetensors slice that remembers which rows were asked of it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.reads: list[tuple] = []

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index):
        self.reads.append(index)
        return self.tensor[index]


def test_a_rank_reads_only_its_rows_of_a_slice(checkpoints):
    _, w = checkpoints[KV_HEADS]
    for rank in range(TP):
        column = ColumnParallelLinear(HIDDEN, INTER, tp=fake_rank(rank), name="up")
        recorded = RecordingSlice(w["up.weight"])
        column.weight_loader(column.weight, recorded)
        half = INTER // TP
        assert recorded.reads == [(slice(rank * half, (rank + 1) * half),)]
        row = RowParallelLinear(INTER, HIDDEN, tp=fake_rank(rank), name="down")
        recorded = RecordingSlice(w["down.weight"])
        row.weight_loader(row.weight, recorded)
        assert recorded.reads == [(slice(None), slice(rank * half, (rank + 1) * half))]


def test_slices_pass_the_checkpoint_check_by_their_whole_shape(checkpoints):
    path, w = checkpoints[KV_HEADS]
    expected = {name: tuple(tensor.shape) for name, tensor in w.items()}
    source = CheckpointSlices(Path(path).parent)
    check = WeightCheck(expected, source)
    for name, tensor_slice in source:
        check.accept(name, name, tensor_slice)
    check.finish()
    expected["down.weight"] = (HIDDEN, INTER + 2)
    source = CheckpointSlices(Path(path).parent)
    with pytest.raises(WeightsMismatchError, match=rf"kv{KV_HEADS}\.safetensors: tensor 'down.weight' has shape \[16, 24\], expected \[16, 26\]"):
        for name, tensor_slice in source:
            WeightCheck(expected, source).accept(name, name, tensor_slice)


def test_at_tp_1_the_layers_are_plain_layers_without_torch_distributed(checkpoints):
    path, w = checkpoints[KV_HEADS]
    block = Block(single_rank_group(), KV_HEADS)  # no group was ever initialised in this process
    block.load(str(Path(path).parent))
    x = inputs(6, HIDDEN)
    torch.testing.assert_close(block(x), reference_block(w, x, KV_HEADS), atol=ATOL, rtol=0)
    assert not torch.distributed.is_initialized()


def test_kv_heads_split_when_tp_divides_them(checkpoints):
    path, w = checkpoints[KV_HEADS]
    for rank in range(TP):
        layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, tp=fake_rank(rank), name="qkv")
        assert (layer.num_heads_per_rank, layer.num_kv_heads_per_rank, layer.kv_replicas) == (2, 1, 1)
        with safe_open(path, framework="pt") as f:
            layer.weight_loader(layer.weight, f.get_slice("k_proj.weight"), "k")
        k = layer.weight[layer.q_size:layer.q_size + layer.kv_size]
        torch.testing.assert_close(k, w["k_proj.weight"][rank * HEAD:(rank + 1) * HEAD], atol=0, rtol=0)


def test_kv_heads_replicated_when_tp_exceeds_them():
    for rank in range(4):
        layer = QKVParallelLinear(HIDDEN, HEAD, 8, 2, tp=fake_rank(rank, 4), name="qkv")
        assert (layer.num_heads_per_rank, layer.num_kv_heads_per_rank, layer.kv_replicas) == (2, 1, 2)
        full_k = torch.arange(2 * HEAD * HIDDEN, dtype=torch.float32).view(2 * HEAD, HIDDEN)
        layer.weight_loader(layer.weight, full_k, "k")
        head = rank // 2  # ranks 0, 1 hold KV head 0; ranks 2, 3 KV head 1
        torch.testing.assert_close(layer.weight[layer.q_size:layer.q_size + HEAD], full_k[head * HEAD:(head + 1) * HEAD])


def test_kv_heads_refused_when_neither_divides():
    with pytest.raises(ConfigError, match=r"layers\.0\.qkv.*num_key_value_heads=3.*tensor_parallel_size=2"):
        QKVParallelLinear(HIDDEN, HEAD, 6, 3, tp=fake_rank(0), name="layers.0.qkv")
    with pytest.raises(ConfigError, match=r"num_key_value_heads=2.*tensor_parallel_size=3"):
        QKVParallelLinear(HIDDEN, HEAD, 6, 2, tp=fake_rank(0, 3), name="qkv")


@pytest.mark.parametrize("make, words", [
    (lambda tp: ColumnParallelLinear(HIDDEN, 25, tp=tp, name="mlp.up"), r"mlp\.up: output_size=25 .*tensor_parallel_size=2"),
    (lambda tp: RowParallelLinear(25, HIDDEN, tp=tp, name="mlp.down"), r"mlp\.down: input_size=25 .*tensor_parallel_size=2"),
    (lambda tp: MergedColumnParallelLinear(HIDDEN, [24, 25], tp=tp, name="gate_up"), r"gate_up: output_sizes\[1\]=25 "),
    (lambda tp: QKVParallelLinear(HIDDEN, HEAD, 5, 1, tp=tp, name="attn.qkv"), r"attn\.qkv: num_attention_heads=5 "),
], ids=["column", "row", "merged", "qkv-heads"])
def test_shapes_that_do_not_divide_are_refused_by_name(make, words):
    with pytest.raises(ConfigError, match=words):
        make(fake_rank(0))


def test_a_weight_loader_takes_the_whole_tensor_a_shard_or_a_slice(checkpoints):
    path, w = checkpoints[KV_HEADS]
    full = w["down.weight"]
    for rank in range(TP):
        shard = full[:, rank * INTER // TP:(rank + 1) * INTER // TP]
        for loaded in (full, shard.clone(), safe_open(path, framework="pt").get_slice("down.weight")):
            layer = RowParallelLinear(INTER, HIDDEN, tp=fake_rank(rank), name="down")
            layer.weight_loader(layer.weight, loaded)
            torch.testing.assert_close(layer.weight, shard, atol=0, rtol=0)
    layer = RowParallelLinear(INTER, HIDDEN, tp=fake_rank(0), name="layers.3.down")
    with pytest.raises(WeightsMismatchError, match=r"layers\.3\.down: dimension 1 .* is 5"):
        layer.weight_loader(layer.weight, torch.zeros(HIDDEN, 5))


def test_a_fused_checkpoint_tensor_is_split_piece_by_piece(checkpoints):
    path, w = checkpoints[KV_HEADS]
    fused = torch.cat([w["gate.weight"], w["up.weight"]])
    half = INTER // TP
    for rank in range(TP):
        layer = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False, tp=fake_rank(rank), name="gate_up")
        layer.weight_loader(layer.weight, fused)
        expected = torch.cat([w["gate.weight"][rank * half:(rank + 1) * half], w["up.weight"][rank * half:(rank + 1) * half]])
        torch.testing.assert_close(layer.weight, expected, atol=0, rtol=0)


def test_the_vocabulary_is_padded_to_split():
    layers = [VocabParallelEmbedding(VOCAB, HIDDEN, tp=fake_rank(rank), name="embed") for rank in range(TP)]
    assert [(l.vocab_start, l.vocab_end, l.num_embeddings_per_rank) for l in layers] == [(0, 19, 19), (19, 37, 19)]
    full = torch.randn(VOCAB, HIDDEN)
    for layer in layers:
        layer.weight_loader(layer.weight, full)
    torch.testing.assert_close(layers[1].weight[:18], full[19:], atol=0, rtol=0)
    assert not layers[1].weight[18:].any()  # the padding row
