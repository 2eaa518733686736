"""Block-parallel drafter (H-Spec): KV-only layers over the target's cached K/V, conditioned on
the target's hidden state at the last verified position only, optionally with H-Spec's recurrent
mixer (`ssm_state_size` > 0: a `SelectiveScan` after each layer's attention, its initial state a
projection of that hidden state, scanning down the block's rows).

A proposal is a block of k rows at positions V .. V+k-1 (V: verified length): row 0 carries the
bonus token, rows 1.. a learned mask embedding; every row adds fc(aux hidden states of position
V-1). Row j attends the target's K/V of the prefix and the K/V of block rows 0..j, so no row
depends on another row's drafted token: the whole block is one causal pass, which is how vLLM
serves it (`serving.drafter`: the block is computed in draft pass 0). It keeps no K/V of its own
across proposals.

Trained block-wise: in `Drafter.chain` every position p is an anchor, and step j is block row j
of the block anchored at p, all anchors at once.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from kvshot_vllm.models.config import DrafterConfig
from kvshot_vllm.models.drafter import AttentionFactory
from kvshot_vllm.models.kv_only import KVOnly
from kvshot_vllm.models.registry import register_paradigm


@register_paradigm("block", reads_target_kv=True, uses_aux_hidden=True, self_attention=False,
                   one_block=True)
class Block(KVOnly):
    """Block-parallel (H-Spec): a whole proposal in one pass over target KV."""

    def build(self, model, cfg: DrafterConfig, attention: AttentionFactory) -> None:
        super().build(model, cfg, attention)
        model.mask_embed = nn.Parameter(torch.zeros(cfg.target.hidden_size))

    def row_embeds(self, model, j, embeds):
        return embeds if j == 0 else model.mask_embed.expand_as(embeds)

    def forward(self, model, embeds, hidden, ctx):
        out, _ = super().forward(model, embeds + hidden, hidden, ctx)
        return out, hidden  # every row of the block sees the same conditioning
