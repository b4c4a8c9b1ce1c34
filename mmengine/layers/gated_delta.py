"""Gated DeltaNet: Qwen3.5's linear-attention layer (three of every four decoder layers), over a packed
step of several requests, each continuing its own live state.

A request's state is a slot in `GatedDeltaStates`: the causal conv's window (the last kernel-1 inputs
of the q/k/v projection) and the recurrent state [value heads, key dim, value dim] in fp32. A step's
new tokens for a request, whatever their number (a prefill chunk, a decode token), continue that
state exactly, so chunked prefill and decode give the tokens of one full pass.

A step may also copy a request's state, as it stands after some of its new tokens, into other slots:
the sparse checkpoints the prefix cache resumes from (kv_cache/recurrent_state.py decides where).
The runner binds each layer's `states` and passes one `RecurrentStep` per step, like the KV cache
and AttentionMetadata of the attention layers.

The delta rule itself is layers/gated_delta_rule.py's: PyTorch (chunked for prefill, one batched update
for a step's decodes) on any device, fla-core's Triton kernels on CUDA where installed. The causal
conv is PyTorch. The parameters are named as transformers names them, so a checkpoint's tensors load
one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mmengine.layers import gated_delta_rule


@dataclass
class GatedDeltaShape:
    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    eps: float = 1e-6

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, element_size: int) -> int:
        """One layer's state for one request: the conv window in the model dtype, the recurrent state in fp32."""
        return self.conv_dim * (self.conv_kernel - 1) * element_size + self.num_value_heads * self.key_head_dim * self.value_head_dim * 4

    @classmethod
    def of(cls, text_config: object) -> GatedDeltaShape:
        """The shape a transformers Qwen3.5 text config gives its linear-attention layers."""
        c = text_config
        return cls(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                   c.linear_value_head_dim, c.linear_conv_kernel_dim, c.rms_norm_eps)


@dataclass
class RecurrentStep:
    """One step's requests as the linear-attention layers see them (host lists, packed order): request
    i owns tokens query_start_loc[i]:query_start_loc[i + 1] and continues the state in slots[i]; after
    its first n new tokens, for each (n, slot) in saves[i], its state is copied into that slot."""

    query_start_loc: list[int]
    slots: list[int]
    saves: list[list[tuple[int, int]]] = field(default_factory=list)
    # Requests whose tokens run one at a time, as decodes do (speculative decoding's verify steps: a state
    # after each token, and the same arithmetic as decoding them one by one)
    stepwise: frozenset[int] = frozenset()
    # A decode CUDA graph's step: every row is one request's one token, in the slots this device buffer
    # holds (rewritten before each replay; padding rows use a scratch slot); the host lists are unused.
    decode_slots: torch.Tensor | None = None
    # A verify CUDA graph's step (runner/verify_graphs.py), as device buffers rewritten before each replay:
    # rows [q, R] (request r's j-th token's row, or a padding row), slots [q, R] (its live slot, or the
    # scratch slot where it has no j-th token) and saves [q - 1, R] (where its state after j + 1 tokens is
    # kept: a draft slot, or the scratch slot). The host lists are unused.
    graph_columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def saves_of(self, index: int) -> list[tuple[int, int]]:
        return self.saves[index] if index < len(self.saves) else []


class GatedDeltaStates:
    """The states of one linear-attention layer, by slot: the live state of each running request and
    the checkpoints kept for prefix hits (the runner lays the slots out; this holds the tensors)."""

    def __init__(self, shape: GatedDeltaShape, num_slots: int, device: torch.device, dtype: torch.dtype) -> None:
        self.conv = torch.zeros(num_slots, shape.conv_dim, shape.conv_kernel - 1, device=device, dtype=dtype)
        self.recurrent = torch.zeros(num_slots, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim,
                                     device=device, dtype=torch.float32)

    def reset(self, slot: int) -> None:
        """A new request in `slot` starts from nothing."""
        self.conv[slot].zero_()
        self.recurrent[slot].zero_()

    def copy(self, source: int, target: int) -> None:
        self.conv[target].copy_(self.conv[source])
        self.recurrent[target].copy_(self.recurrent[source])

    @property
    def bytes_per_slot(self) -> int:
        return (self.conv[0].numel() * self.conv.element_size()) + (self.recurrent[0].numel() * self.recurrent.element_size())


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, then gated by silu(z) (in fp32, as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * x32.to(dtype)) * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, shape: GatedDeltaShape) -> None:
        super().__init__()
        self.shape = s = shape
        self.in_proj_qkv = nn.Linear(s.hidden_size, s.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(s.hidden_size, s.value_dim, bias=False)
        self.in_proj_b = nn.Linear(s.hidden_size, s.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(s.hidden_size, s.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(s.conv_dim, s.conv_dim, kernel_size=s.conv_kernel, groups=s.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(s.num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_value_heads))
        self.norm = GatedRMSNorm(s.value_head_dim, s.eps)
        self.out_proj = nn.Linear(s.value_dim, s.hidden_size, bias=False)
        self.states: GatedDeltaStates | None = None  # bound by the runner

    def forward(self, hidden: torch.Tensor, step: RecurrentStep) -> torch.Tensor:
        """hidden [tokens, hidden_size], packed as `step` says; the bound states advance in place.

        Single-token requests (decodes) advance together in one batched update. The others run in
        rounds: round r takes every request's r-th stretch (its new tokens split at its save points),
        all of them in one varlen call from their slots' states, then copies the saved states."""
        assert self.states is not None, "recurrent states not bound"
        s, states = self.shape, self.states
        mixed = self.in_proj_qkv(hidden)
        z = self.in_proj_z(hidden).view(-1, s.num_value_heads, s.value_head_dim)
        beta = self.in_proj_b(hidden).sigmoid().float()  # in the model dtype first, as transformers rounds it
        decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(hidden).float() + self.dt_bias)
        out = torch.empty(hidden.shape[0], s.num_value_heads, s.value_head_dim, device=hidden.device, dtype=hidden.dtype)
        varlen, decode = gated_delta_rule.kernels_for(hidden.device)
        starts = step.query_start_loc
        if step.graph_columns is not None:
            decodes = []
            self._graph_columns(mixed, beta, decay, out, step.graph_columns, decode)
        elif step.decode_slots is not None:  # a graph step: no host values, no saves (the runner copies after)
            decodes = []
            self._decode_rows(mixed, beta, decay, out, torch.arange(hidden.shape[0], device=hidden.device), step.decode_slots, decode)
        else:  # always batched, so a request's decode is computed alike whatever else is in the step
            decodes = [i for i in range(len(step.slots)) if starts[i + 1] - starts[i] == 1]
            if decodes:
                rows = torch.tensor([starts[i] for i in decodes], device=hidden.device)
                slots = torch.tensor([step.slots[i] for i in decodes], device=hidden.device)
                self._decode_rows(mixed, beta, decay, out, rows, slots, decode)
                for i in decodes:
                    for _, target in step.saves_of(i):  # a decode saves after its one token
                        states.copy(step.slots[i], target)
        if step.stepwise:
            self._stepwise_rows(mixed, beta, decay, out, step, decode)
        for stretches in _rounds(step, set(decodes) | step.stepwise):
            qkv = torch.cat([self._conv(mixed[lo:hi], states.conv[slot]) for lo, hi, slot, _ in stretches])
            rows = torch.cat([torch.arange(lo, hi, device=hidden.device) for lo, hi, _, _ in stretches])
            cu = [0]
            for lo, hi, _, _ in stretches:
                cu.append(cu[-1] + hi - lo)
            slots = torch.tensor([slot for _, _, slot, _ in stretches], device=hidden.device)
            outputs, finals = varlen(*self._heads(qkv), beta.index_select(0, rows), decay.index_select(0, rows),
                                     states.recurrent.index_select(0, slots), cu)
            states.recurrent.index_copy_(0, slots, finals.float())
            out.index_copy_(0, rows, outputs.to(hidden.dtype))
            for _, _, slot, target in stretches:
                if target is not None:
                    states.copy(slot, target)
        normed = self.norm(out.reshape(-1, s.value_head_dim), z.reshape(-1, s.value_head_dim))
        return self.out_proj(normed.view(hidden.shape[0], s.value_dim))

    def _stepwise_rows(self, mixed: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor, out: torch.Tensor,
                       step: RecurrentStep, decode: gated_delta_rule.VarlenKernel) -> None:
        """The stepwise requests' tokens as decodes: their j-th tokens together, then each save after j + 1."""
        starts, device = step.query_start_loc, mixed.device
        longest = max(starts[i + 1] - starts[i] for i in step.stepwise)
        for j in range(longest):
            batch = [i for i in sorted(step.stepwise) if starts[i] + j < starts[i + 1]]
            rows = torch.tensor([starts[i] + j for i in batch], device=device)
            slots = torch.tensor([step.slots[i] for i in batch], device=device)
            self._decode_rows(mixed, beta, decay, out, rows, slots, decode)
            for i in batch:
                for n, target in step.saves_of(i):
                    if n == j + 1:
                        self.states.copy(step.slots[i], target)

    def _graph_columns(self, mixed: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor, out: torch.Tensor,
                       columns: tuple[torch.Tensor, torch.Tensor, torch.Tensor], decode: gated_delta_rule.VarlenKernel) -> None:
        """A verify graph's tokens as decodes, as _stepwise_rows runs them: every request's j-th token
        together, then each state after j + 1 tokens copied where the columns say."""
        rows, slots, saves = columns
        states = self.states
        for j in range(rows.shape[0]):
            self._decode_rows(mixed, beta, decay, out, rows[j], slots[j], decode)
            if j < saves.shape[0]:
                states.conv.index_copy_(0, saves[j], states.conv.index_select(0, slots[j]))
                states.recurrent.index_copy_(0, saves[j], states.recurrent.index_select(0, slots[j]))

    def _decode_rows(self, mixed: torch.Tensor, beta: torch.Tensor, decay: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
                     slots: torch.Tensor, decode: gated_delta_rule.VarlenKernel) -> None:
        """One token each for the requests at `rows` (in `slots`), batched; writes their outputs into `out`."""
        states = self.states
        qkv = self._conv_decode(mixed.index_select(0, rows), slots)
        outputs, new_states = decode(*self._heads(qkv), beta.index_select(0, rows), decay.index_select(0, rows),
                                     states.recurrent.index_select(0, slots))
        states.recurrent.index_copy_(0, slots, new_states.float())
        out.index_copy_(0, rows, outputs.to(out.dtype))

    def _conv(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """The causal depthwise conv (then silu) of one request's new inputs x [n, conv_dim], continuing
        `window` [conv_dim, kernel - 1], which then holds the last kernel - 1 inputs."""
        joined = torch.cat([window, x.transpose(0, 1).to(window.dtype)], dim=-1)  # [conv_dim, kernel - 1 + n]
        window.copy_(joined[:, -window.shape[-1]:])
        conv = F.conv1d(joined.unsqueeze(0).to(self.conv1d.weight.dtype), self.conv1d.weight, groups=self.shape.conv_dim)
        return F.silu(conv[0]).transpose(0, 1).to(x.dtype)  # [n, conv_dim]

    def _conv_decode(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """_conv of one token for each of several requests (x [n, conv_dim], request j in slots[j])."""
        window = self.states.conv.index_select(0, slots)  # [n, conv_dim, kernel - 1]
        joined = torch.cat([window, x[:, :, None].to(window.dtype)], dim=-1)  # [n, conv_dim, kernel]
        self.states.conv.index_copy_(0, slots, joined[:, :, 1:])
        conv = F.conv1d(joined.to(self.conv1d.weight.dtype), self.conv1d.weight, groups=self.shape.conv_dim)  # [n, conv_dim, 1]
        return F.silu(conv[:, :, 0]).to(x.dtype)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's output [n, conv_dim] as fp32 query (l2-normed, scaled), key (l2-normed) and value,
        each [n, value heads, dim]: every q/k head serves `group` consecutive value heads."""
        s = self.shape
        query, key, value = torch.split(qkv.float(), [s.key_dim, s.key_dim, s.value_dim], dim=-1)
        group = s.num_value_heads // s.num_key_heads
        query = _l2norm(query.view(-1, s.num_key_heads, s.key_head_dim)).repeat_interleave(group, dim=1) * s.key_head_dim**-0.5
        key = _l2norm(key.view(-1, s.num_key_heads, s.key_head_dim)).repeat_interleave(group, dim=1)
        return query, key, value.view(-1, s.num_value_heads, s.value_head_dim)


def _rounds(step: RecurrentStep, skip: set[int]) -> list[list[tuple[int, int, int, int | None]]]:
    """The step's multi-token work as rounds of (first row, end row, slot, slot to save into after it):
    round r holds each request's r-th stretch, so a request's stretches run in order."""
    rounds: list[list[tuple[int, int, int, int | None]]] = []
    starts = step.query_start_loc
    for i, slot in enumerate(step.slots):
        if i in skip or starts[i + 1] == starts[i]:
            continue
        saves = step.saves_of(i)
        bounds = [0, *(n for n, _ in saves), starts[i + 1] - starts[i]]
        targets = [*(target for _, target in saves), None]
        for r, target in enumerate(targets):
            if bounds[r + 1] == bounds[r]:  # nothing after the last save point
                continue
            if r == len(rounds):
                rounds.append([])
            rounds[r].append((starts[i] + bounds[r], starts[i] + bounds[r + 1], slot, target))
    return rounds


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
