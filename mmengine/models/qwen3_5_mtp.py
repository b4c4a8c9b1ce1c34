"""Qwen3.5's multi-token-prediction head (`mtp.*` in the published checkpoints): the draft model of
speculative decoding with method "mtp" (runner/head_drafter.py drives it).

At position j the head reads the target's final hidden state there (after its norm) and the embedding of
the token at j+1 (an image placeholder's is its picture's), and predicts the token at j+2:

    x = fc(cat(pre_fc_norm_embedding(embed(t[j+1])), pre_fc_norm_hidden(h[j])))
    x = a gated full-attention decoder layer of the target's shape (mixture of experts on Qwen3.5-MoE)
    logits = lm_head(norm(x))        # the target's embeddings and LM head: the checkpoint has no others

Its layer attends over K/V of its own, kept in the paged KV cache as one more attention layer under the
request's block tables and positions (position j, as the target's row j). Chained, the head's own output
at j stands for h[j+1] and the draft token for t[j+2]. The layout is vLLM's (`Qwen3_5MultiTokenPredictor`);
with several `mtp.layers`, draft step i runs layer i mod their number.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

from mmengine.layers.attention import Attention, AttentionMetadata
from mmengine.layers.norm import ZeroCenteredRMSNorm
from mmengine.layers.rotary import RotaryStep
from mmengine.models.llama import gate_up_shard_shapes, load_with_gate_up_shards


class MultiTokenPredictor(nn.Module):
    def __init__(self, config: PretrainedConfig, num_layers: int, make_layer: Callable[[], nn.Module]) -> None:
        """`make_layer`: one of the target's gated full-attention decoder layers (models/qwen3_5.py's)."""
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps)
        self.layers = nn.ModuleList(make_layer() for _ in range(num_layers))
        self.norm = ZeroCenteredRMSNorm(hidden, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotary: RotaryStep, metadata: AttentionMetadata,
                draft_step: int, fused: bool) -> torch.Tensor:
        """The head's final hidden states (after its norm) for rows of (next token's embedding, hidden state)."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x, residual = self.layers[draft_step % len(self.layers)](x, None, rotary, metadata, fused)
        return self.norm(x, residual)[0]

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """One checkpoint tensor named relative to `mtp.`; False if the name is unknown."""
        return "rotary_emb" in name.split(".") or load_with_gate_up_shards(self, name, tensor)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return gate_up_shard_shapes(self.named_parameters())
