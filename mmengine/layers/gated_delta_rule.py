"""The gated delta rule over packed sequences, each from its own initial state (Gated DeltaNet's core).

Per token t of a sequence, with q and k l2-normed (q scaled by dk^-1/2), beta in (0, 1) and g <= 0:

    S <- exp(g_t) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T q_t        (S: [dk, dv] per head)

Three ways to compute it, one contract (fp32 states [heads, dk, dv], inputs [tokens, heads, dim]):
- `recurrent`: token by token, the reference (and the decode path, one token per sequence);
- `chunked`: the same recurrence by chunks of `chunk` tokens, the intra-chunk part as matrix products
  through the UT transform (DeltaNet's WY form): (I + tril(diag(beta) K K^T * Gamma, -1)) U = beta V,
  which turns a chunk's sequential updates into triangular solves; PyTorch, for prefill on any device;
- on CUDA with fla-core installed (the `fla` extra), its Triton kernels (`chunk_gated_delta_rule`
  varlen over cu_seqlens with initial and final states, `fused_recurrent_gated_delta_rule` for decode).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

CHUNK = 64


def recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
              state: torch.Tensor) -> torch.Tensor:
    """One sequence token by token: q, k [n, H, dk], v [n, H, dv], beta, g [n, H]; `state` [H, dk, dv]
    is advanced in place. Returns the outputs [n, H, dv] (fp32)."""
    outputs = torch.empty_like(v)
    current = state.clone()
    for t in range(v.shape[0]):
        current = current * g[t].exp()[:, None, None]
        remembered = (current * k[t][:, :, None]).sum(dim=1)  # [H, dv]
        delta = (v[t] - remembered) * beta[t][:, None]
        current = current + k[t][:, :, None] * delta[:, None, :]
        outputs[t] = (current * q[t][:, :, None]).sum(dim=1)
    state.copy_(current)
    return outputs


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
            state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """`recurrent`'s result by chunks: per chunk, two triangular solves and a few matrix products."""
    outputs = torch.empty_like(v)
    s = state.clone()
    for lo in range(0, v.shape[0], chunk):
        hi = min(lo + chunk, v.shape[0])
        qc, kc, vc = (x[lo:hi].transpose(0, 1) for x in (q, k, v))  # [H, c, d]
        bc, gc = beta[lo:hi].transpose(0, 1), g[lo:hi].transpose(0, 1).cumsum(-1)  # [H, c]
        c = hi - lo
        causal = torch.ones(c, c, dtype=torch.bool, device=v.device).tril()
        # decay between positions j <= i of the chunk: exp(G_i - G_j); zero above the diagonal
        gamma = (gc[:, :, None] - gc[:, None, :]).masked_fill(~causal, float("-inf")).exp()
        lower = ((bc[:, :, None] * kc) @ kc.transpose(1, 2) * gamma).tril(-1)
        system = lower + torch.eye(c, dtype=v.dtype, device=v.device)
        u = torch.linalg.solve_triangular(system, bc[:, :, None] * vc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, bc[:, :, None] * kc * gc.exp()[:, :, None], upper=False, unitriangular=True)
        corrected = u - w @ s  # each token's value minus what the chunk's starting state already predicts
        scores = (qc @ kc.transpose(1, 2)) * gamma
        outputs[lo:hi] = ((qc * gc.exp()[:, :, None]) @ s + scores @ corrected).transpose(0, 1)
        last = gc[:, -1:]
        s = s * last.exp()[:, :, None] + (kc * (last - gc).exp()[:, :, None]).transpose(1, 2) @ corrected
    state.copy_(s)
    return outputs


def varlen_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                 initial: torch.Tensor, cu_seqlens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences (sequence i: rows cu_seqlens[i]:cu_seqlens[i + 1], from initial[i]); returns the
    outputs and the final states [N, H, dk, dv] (the inputs are not changed)."""
    out = torch.empty_like(v)
    final = initial.clone()
    for i in range(len(cu_seqlens) - 1):
        lo, hi = cu_seqlens[i], cu_seqlens[i + 1]
        if hi > lo:
            out[lo:hi] = chunked(q[lo:hi], k[lo:hi], v[lo:hi], beta[lo:hi], g[lo:hi], final[i])
    return out, final


def decode_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                 states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of N sequences (inputs [N, H, d], states [N, H, dk, dv]); returns (outputs,
    new states)."""
    s = states * g.exp()[:, :, None, None]
    remembered = (s * k[:, :, :, None]).sum(dim=2)
    s = s + k[:, :, :, None] * ((v - remembered) * beta[:, :, None])[:, :, None, :]
    return (s * q[:, :, :, None]).sum(dim=2), s


VarlenKernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@functools.cache
def fla_kernels() -> tuple[VarlenKernel, VarlenKernel] | None:
    """fla-core's (varlen chunked, decode) as `varlen_torch` / `decode_torch` take them, or None when it
    is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except ImportError:
        return None

    def varlen(q, k, v, beta, g, initial, cu_seqlens):
        cu = torch.tensor(list(cu_seqlens), dtype=torch.long, device=v.device)
        out, final = chunk_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None], scale=1.0,
                                            initial_state=initial, output_final_state=True, cu_seqlens=cu)
        return out[0], final

    def decode(q, k, v, beta, g, states):
        out, final = fused_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None],
                                                      scale=1.0, initial_state=states, output_final_state=True)
        return out[:, 0], final

    return varlen, decode


def kernels_for(device: torch.device) -> tuple[VarlenKernel, VarlenKernel]:
    """fla-core's kernels on CUDA when installed, else the PyTorch ones (CPU, or no fla)."""
    if device.type == "cuda" and fla_kernels() is not None:
        return fla_kernels()
    return varlen_torch, decode_torch
