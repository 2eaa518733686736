"""Hybrid drafter (KVShot): EAGLE-3, whose first attention gets a cross-attention over the
target's cached K/V merged by the gated delta rule (`layers.GatedDelta`). Warm-starts from a
hidden-only checkpoint: the EAGLE-3 weights are kept, the cross branch and gate are fresh."""

from __future__ import annotations

from kvshot_vllm.models.config import DrafterConfig
from kvshot_vllm.models.drafter import AttentionFactory, DraftContext
from kvshot_vllm.models.hidden import Attend, Hidden
from kvshot_vllm.models.layers import GatedDelta
from kvshot_vllm.models.registry import register_paradigm


@register_paradigm("hybrid", reads_target_kv=True, uses_aux_hidden=True, self_attention=True)
class Hybrid(Hidden):
    """Hybrid (KVShot): EAGLE-3 plus a gated cross-attention correction over target KV."""

    def build(self, model, cfg: DrafterConfig, attention: AttentionFactory) -> None:
        super().build(model, cfg, attention)
        h = cfg.target.hidden_size
        model.cross = attention.cross_attention(2 * h, cfg.kv_layers)
        model.merge = GatedDelta(h, cfg.gate_init)

    def attend(self, model, ctx: DraftContext) -> Attend:
        """Layer 0's self-attention output merged with its cross-attention's over target K/V."""
        attend = super().attend(model, ctx)

        def attend_corrected(i, attn, x):
            out = attend(i, attn, x)
            return model.merge(out, ctx.attend(model.cross, x)) if i == 0 else out

        return attend_corrected
