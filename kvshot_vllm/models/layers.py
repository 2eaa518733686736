"""Pure-torch pieces of the drafters whose math must be the same in training and in vLLM."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kvshot_vllm.models.budget import KVBudget, memory_chunks, rows_verified, visible_keys
from kvshot_vllm.models.parallel import ColumnParallel, Linear, RowParallel, fused


class SwiGLU(nn.Module):
    """Llama MLP with the checkpoint names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = ColumnParallel(hidden, intermediate)
        self.up_proj = ColumnParallel(hidden, intermediate)
        self.down_proj = RowParallel(intermediate, hidden)
        self.gate_up_proj: Linear | None = None  # `fuse`

    def fuse(self) -> None:
        """Gate and up projections in one matmul (serving, once the weights are loaded)."""
        self.gate_up_proj = fused(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class GatedDelta(nn.Module):
    """Hybrid merge (KVShot, App. B): a = o_self + gate * W (o_cross - o_self).

    The cross-attention is a correction of the self-attention path, not a replacement; the gate
    is element-wise and shared by all draft steps. gate -> 0 gives back plain EAGLE-3.
    """

    def __init__(self, hidden: int, gate_init: float) -> None:
        super().__init__()
        self.delta_proj = Linear(hidden, hidden)
        self.gate = nn.Parameter(torch.full((hidden,), gate_init))

    def forward(self, o_self: torch.Tensor, o_cross: torch.Tensor) -> torch.Tensor:
        return o_self + self.gate * self.delta_proj(o_cross - o_self)


class RMSNorm(nn.Module):
    """vLLM's RMSNorm: statistics in fp32, weight applied after casting back."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE (Llama, Qwen3; what vLLM applies before caching keys).
    x: [B, T, heads, d]; cos, sin: [B, T, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(2) + rotated * sin.unsqueeze(2)


def draft_attention(q: torch.Tensor, ctx: tuple[torch.Tensor, torch.Tensor],
                    diag: list[tuple[torch.Tensor, torch.Tensor]],
                    budget: KVBudget | None = None,
                    memory: tuple[torch.Tensor, torch.Tensor] | None = None,
                    retrieved: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one draft step, for every row of a sequence at once.

    Row p attends the context keys of rows 0..p (`ctx`: the target's cached K/V, or the
    drafter's own step-0 keys) and, from `diag`, only its own row's keys of this draft chain (the
    K/V it produced at earlier draft steps). That is exactly what a draft row at step j sees in
    vLLM: the verified prefix, then the tokens drafted after it.

    The rows may be the last R of the T context positions (training drops the rows before the
    first one with a loss, `Drafter.chain`): row i is then position T - R + i. Diag entries
    computed for more rows are cut to the same last R.

    With a `budget`, row p sees only the context keys in the view of its p + 1 verified keys
    (`budget.py`); its chain's keys are always in view. With the budget's memory, it also sees
    the `memory` slots of the chunks its view leaves out; with a retrieval budget, the blocks
    `retrieved` for its chain (`budget.retrieve`).

    q: [B, R, H, d]; ctx k, v: [B, KVH, T, d]; diag: list of (k, v) each [B, >= R, KVH, d];
    memory k, v: [B, KVH, M, d], `slots` per chunk after the sink (`memory.ChunkMemory`);
    retrieved: [B, R, C] block indices. Returns [B, R, H * d].
    """
    b, r, h, d = q.shape
    ctx_k, ctx_v = ctx
    kvh, t = ctx_k.shape[1], ctx_k.shape[2]
    diag = [(k[:, -r:], v[:, -r:]) for k, v in diag]
    qg = q.view(b, r, kvh, h // kvh, d).permute(0, 2, 3, 1, 4)  # [B, KVH, G, R, d]
    scale = d**-0.5
    scores = torch.einsum("bkgrd,bksd->bkgrs", qg, ctx_k) * scale  # [B, KVH, G, R, T]
    future = torch.ones(r, t, dtype=torch.bool, device=q.device).triu(t - r + 1)
    if budget is not None:
        verified = rows_verified(t, r, q.device)
        future = future | ~visible_keys(verified, t, budget, retrieved)
    if future.dim() == 3:  # per sequence (retrieval): [B, R, T] -> [B, 1, 1, R, T]
        future = future[:, None, None]
    scores = scores.masked_fill(future, float("-inf"))
    keys, values = [scores], [ctx_v]
    if memory is not None:
        mem_k, mem_v = memory
        chunk = torch.arange(mem_k.shape[2], device=q.device) // budget.memory.slots
        hidden = chunk >= memory_chunks(verified, budget).unsqueeze(-1)  # [R, M]
        keys.append(torch.einsum("bkgrd,bksd->bkgrs", qg, mem_k).mul(scale)
                    .masked_fill(hidden, float("-inf")))
        values.append(mem_v)
    own = [torch.einsum("bkgrd,brkd->bkgr", qg, k).unsqueeze(-1) * scale for k, _ in diag]
    probs = torch.softmax(torch.cat([*keys, *own], dim=-1).float(), dim=-1).to(q.dtype)
    out, start = 0, 0
    for key, value in zip(keys, values):
        out = out + torch.einsum("bkgrs,bksd->bkgrd", probs[..., start:start + key.shape[-1]],
                                 value)
        start += key.shape[-1]
    for i, (_, v) in enumerate(diag):
        out = out + probs[..., start + i, None] * v.permute(0, 2, 1, 3).unsqueeze(2)
    return out.permute(0, 3, 1, 2, 4).reshape(b, r, h * d)


class SelectiveScan(nn.Module):
    """H-Spec's recurrent mixer across the rows of a draft block: a diagonal selective state
    space (Mamba-1's scan, sequential in plain PyTorch) whose initial state is a projection of
    the conditioning hidden state, so that the state carries the target's summary of the prefix
    down the block while attention reads the prefix itself.

    The state is [..., hidden, state_size]; `forward` advances it by one row.
    """

    def __init__(self, hidden: int, state_size: int, eps: float) -> None:
        super().__init__()
        self.state_size = state_size
        self.norm = RMSNorm(hidden, eps)
        self.in_proj = Linear(hidden, 2 * hidden)  # input u, output gate z
        self.x_proj = Linear(hidden, hidden + 2 * state_size)  # step, B, C
        # Initial values: `weights.init_weights` (every drafter weight is initialised there).
        self.A_log = nn.Parameter(torch.zeros(hidden, state_size))
        self.D = nn.Parameter(torch.zeros(hidden))
        self.init_proj = Linear(hidden, hidden * state_size)
        self.out_proj = Linear(hidden, hidden)

    def initial_state(self, cond: torch.Tensor) -> torch.Tensor:
        """cond [..., hidden] -> state [..., hidden, state_size]."""
        return self.init_proj(cond).unflatten(-1, (cond.shape[-1], self.state_size))

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One row: x [..., hidden], state -> (residual update [..., hidden], next state)."""
        h = x.shape[-1]
        u, z = self.in_proj(self.norm(x)).chunk(2, dim=-1)
        step, b, c = self.x_proj(u).split([h, self.state_size, self.state_size], dim=-1)
        step = F.softplus(step).unsqueeze(-1)  # [..., hidden, 1]
        decay = torch.exp(-step * torch.exp(self.A_log))  # in (0, 1): a stable recurrence
        state = decay * state + step * u.unsqueeze(-1) * b.unsqueeze(-2)
        y = (state @ c.unsqueeze(-1)).squeeze(-1) + self.D * u
        return self.out_proj(y * F.silu(z)), state

    def scan(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Every row of a block in order: x [..., rows, hidden], cond [..., hidden] -> the
        residual updates [..., rows, hidden]."""
        state, ys = self.initial_state(cond), []
        for row in x.unbind(-2):
            y, state = self(row, state)
            ys.append(y)
        return torch.stack(ys, dim=-2)
