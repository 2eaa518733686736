"""Compressed draft memory (`models/memory.py`, issue 16): the adaptor's chunk-local update, what
a row attends with a memory view, the distillation objective and the configs refused."""

from __future__ import annotations

import pytest
import torch

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.budget import (CompressedMemory, KVBudget, memory_chunks,
                                       visible_keys)
from kvshot_vllm.models.config import validated
from kvshot_vllm.models.layers import draft_attention
from kvshot_vllm.models.memory import ChunkMemory
from tests.test_config_unit import SMOL
from tests.test_training_unit import tiny_batch, tiny_drafter, tiny_features

# 1 sink block, 2 window blocks; chunks of 2 blocks, 3 slots each
MEMORY = KVBudget(tokens=12, sink_tokens=4, block_size=4,
                  memory=CompressedMemory(chunk_tokens=8, slots=3))


def _random_memory(heads: int, d: int) -> ChunkMemory:
    memory = ChunkMemory(heads, d, MEMORY.memory)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        memory.query.copy_(torch.randn(memory.query.shape, generator=g))
        memory.bias.copy_(torch.randn(memory.bias.shape, generator=g))
    return memory


def test_memory_grows_chunk_by_chunk_as_it_compresses_at_once() -> None:
    """The served memory is updated one completed chunk at a time; that must be what a
    from-scratch compression of the same prefix gives (a chunk's slots see only its chunk)."""
    memory = _random_memory(heads=2, d=8)
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 45, 8, generator=g), torch.randn(1, 2, 45, 8, generator=g)
    at_once = memory(k, v)
    assert at_once[0].shape == (1, 2, 5 * 3, 8)  # 5 whole chunks of 8; the last 5 keys wait
    grown = [memory(k[:, :, i:i + 8], v[:, :, i:i + 8]) for i in range(0, 40, 8)]
    for whole, parts in zip(at_once, zip(*grown)):
        torch.testing.assert_close(whole, torch.cat(parts, dim=2), rtol=0, atol=1e-6)


def test_fresh_memory_slots_are_the_means_of_their_stretches() -> None:
    from kvshot_vllm.models.weights import init_weights

    cfg = validated({"paradigm": "kv", "target": SMOL,
                     "kv_budget": {**MEMORY.model_dump(), "block_size": 4}})
    weights = init_weights(cfg)
    memory = ChunkMemory(1, 64, MEMORY.memory)
    memory.load_state_dict({"query": weights["kv_layers.0.cross.memory.query"][:1],
                            "bias": weights["kv_layers.0.cross.memory.bias"]})
    k, v = torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64)
    k_mem, v_mem = memory(k, v)
    stretches = [[0, 1, 2], [3, 4, 5], [6, 7]]  # i * 3 // 8
    for j, stretch in enumerate(stretches):
        torch.testing.assert_close(v_mem[0, 0, j], v[0, 0, stretch].mean(0), atol=5e-3, rtol=0)
        torch.testing.assert_close(k_mem[0, 0, j], k[0, 0, stretch].mean(0), atol=5e-3, rtol=0)


def test_a_row_attends_sink_its_left_out_chunks_memory_and_the_window() -> None:
    """Against a hand-built softmax per row over exactly the keys it should see."""
    torch.manual_seed(0)
    b, t, h, kvh, d = 1, 44, 2, 1, 8
    q = torch.randn(b, t, h, d)
    ctx = (torch.randn(b, kvh, t, d), torch.randn(b, kvh, t, d))
    diag = [(torch.randn(b, t, kvh, d), torch.randn(b, t, kvh, d))]
    memory = _random_memory(kvh, d)(ctx[0][:, :, 4:], ctx[1][:, :, 4:])
    out = draft_attention(q, ctx, diag, MEMORY, memory)
    verified = torch.arange(1, t + 1)
    chunks = memory_chunks(verified, MEMORY)
    assert chunks.max() == 4 and chunks.min() == 0
    exact = visible_keys(verified, t, MEMORY)
    for p in range(t):
        keys = [ctx[0][0, 0, : p + 1][exact[p, : p + 1]], memory[0][0, 0, : 3 * chunks[p]],
                diag[0][0][0, p]]
        values = [ctx[1][0, 0, : p + 1][exact[p, : p + 1]], memory[1][0, 0, : 3 * chunks[p]],
                  diag[0][1][0, p]]
        # every verified key is in the exact view or in a summarised chunk, never both
        assert int(exact[p, : p + 1].sum()) + 8 * int(chunks[p]) == p + 1
        k, v = torch.cat(keys), torch.cat(values)
        want = torch.softmax(q[0, p] @ k.T * d**-0.5, dim=-1) @ v  # [h, d]
        torch.testing.assert_close(out[0, p], want.flatten(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("paradigm, caches, spoil", [
    ("kv", "target", "target"),
    ("hybrid", "target", "target"),
    ("hybrid", "draft", "own"),
    ("hybrid", "both", "own"),
])
def test_memory_keeps_what_a_plain_view_drops(paradigm: str, caches: str, spoil: str) -> None:
    """A change to a key left out of a row's view (the target's, or the drafter's own key from
    its input at that position) reaches that row through the memory of its chunk, and does not
    without the memory."""
    budget = {**MEMORY.model_dump(), "draft_cache": paradigm == "hybrid",
              "memory": {**MEMORY.memory.model_dump(), "caches": caches}}
    t = 40
    rows = slice(30, None)  # their views leave out chunk 0 (keys 4..11)

    def last_rows(view: dict, spoiled: bool) -> torch.Tensor:
        drafter = tiny_drafter(paradigm, kv_budget=view)
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if name.endswith("memory.query"):
                    p.normal_()
        feats = tiny_features(drafter, t)
        if spoiled and spoil == "target":
            for k, v in feats.target_kv.values():
                k[:, :, 6], v[:, :, 6] = 5.0, 5.0
        elif spoiled:
            feats.aux_hidden[:, 6] = 5.0
        with torch.no_grad():
            return drafter.chain(feats, 2)[-1][0, rows]

    assert not torch.equal(last_rows(budget, False), last_rows(budget, True))
    plain = {**budget, "memory": None}
    assert torch.equal(last_rows(plain, False), last_rows(plain, True))


@pytest.mark.parametrize("caches, adaptors", [
    ("target", ["cross.memory.bias", "cross.memory.query"]),
    ("draft", ["layers.0.self_attn.memory.bias", "layers.0.self_attn.memory.query"]),
])
def test_adaptors_sit_on_the_caches_the_memory_summarises(caches: str, adaptors: list) -> None:
    from kvshot_vllm.models.drafter import expected_shapes

    cfg = validated({"paradigm": "hybrid", "target": SMOL,
                     "kv_budget": {**MEMORY.model_dump(), "draft_cache": True,
                                   "memory": {**MEMORY.memory.model_dump(), "caches": caches}}})
    shapes = expected_shapes(cfg)
    assert sorted(n for n in shapes if ".memory." in n) == adaptors
    kv_heads = 3 * len(cfg.kv_layers) if caches == "target" else 3  # per sampled layer
    assert shapes[adaptors[1]] == (kv_heads, 3, 64) and shapes[adaptors[0]] == (3, 8)


def test_distillation_trains_only_the_memory_towards_the_full_view() -> None:
    from kvshot_vllm.training.ttt import TrainConfig, ttt_loss

    drafter = tiny_drafter("kv", kv_budget=MEMORY.model_dump()).train()
    feats, labels, trainable, t2d = tiny_batch(drafter)
    cfg = TrainConfig(steps=1, ttt_steps=3, objective="distill", train="memory")
    loss, accs = ttt_loss(drafter, feats, labels, trainable, cfg, t2d)
    assert loss > 0 and len(accs) == 3
    loss.backward()
    grads = {n: p.grad for n, p in drafter.named_parameters()}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if ".memory." in n)
    # the teacher runs without gradient: only the student's path reaches the weights, and a view
    # that holds the whole sequence is its own teacher
    whole = tiny_drafter("kv", kv_budget={**MEMORY.model_dump(), "tokens": 40})
    assert float(ttt_loss(whole, feats, labels, trainable, cfg, t2d)[0].detach()) == pytest.approx(0.0,
                                                                                          abs=1e-6)


@pytest.mark.parametrize("fields, message", [
    ({"memory": {"chunk_tokens": 8, "slots": 8}}, "slots 8 must be fewer than chunk_tokens 8"),
    ({"memory": {"chunk_tokens": 6, "slots": 2}}, "chunk_tokens 6 is not a multiple of "
                                                  "block_size 4"),
    ({"memory": {"chunk_tokens": 8, "slots": 2, "caches": "draft"}},
     "summarises the drafter's own cache, which only a view with draft_cache reads"),
])
def test_bad_memories_are_refused_by_name(fields, message) -> None:
    with pytest.raises(KVShotError, match=message):
        validated({"paradigm": "kv", "target": SMOL,
                   "kv_budget": {"tokens": 12, "block_size": 4, **fields}})


def test_distillation_needs_a_frozen_teacher() -> None:
    from kvshot_vllm.training.pipeline import train_config

    with pytest.raises(KVShotError, match="set train 'memory'"):
        train_config("quick", objective="distill")


def test_a_memory_view_needs_the_adaptor_it_was_trained_with() -> None:
    drafter = tiny_drafter("kv")
    feats = tiny_features(drafter, 40)
    with drafter.viewing(MEMORY), pytest.raises(KVShotError, match="needs a drafter trained "
                                                                    "with that memory"):
        drafter.chain(feats, 1)


@pytest.mark.parametrize("memory, tp, refusal", [
    ({"chunk_tokens": 64, "slots": 4}, 1, "chunk_tokens must be the block size 32"),
    ({"chunk_tokens": 32, "slots": 4}, 2, "not served under tensor parallelism"),
])
def test_serving_refuses_a_memory_it_cannot_serve(memory: dict, tp: int, refusal: str) -> None:
    from types import SimpleNamespace

    from kvshot_vllm.serving.checks import check_against_target

    cfg = validated({"paradigm": "hybrid", "target": SMOL,
                     "kv_budget": {"tokens": 128, "block_size": 32, "draft_cache": True,
                                   "memory": memory}})
    hf = SimpleNamespace(hidden_size=576, vocab_size=49152, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rope_parameters={"rope_theta": 1e5}, rms_norm_eps=1e-5,
                         intermediate_size=1536)
    engine = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, max_model_len=2048),
                             cache_config=SimpleNamespace(block_size=32),
                             parallel_config=SimpleNamespace(tensor_parallel_size=tp))
    with pytest.raises(KVShotError, match=refusal):
        check_against_target(cfg, engine)
    check_against_target(cfg.model_copy(update={"kv_budget": cfg.kv_budget.model_copy(
        update={"memory": None})}), engine)  # the same drafter without the memory is served


def test_draft_side_bytes_count_own_keys_in_view_and_memory_slots() -> None:
    """Per request at 100 verified keys, bf16 K/V of 1 KV head x 8 (tiny: 2 KV heads x 8 dims,
    32 bytes a key): the hybrid's own cache is all 100 keys without a view; with the view, its
    exact keys plus 3 slots per summarised chunk; summarised target caches add their slots."""
    key = 2 * 2 * 8 * 2  # K and V, 2 KV heads of 8 dims, bf16
    # 100 keys: sink block 0, gap of 22 blocks -> 11 chunks summarised (keys 4..91), exact
    # sink 4 + window 92..99 = 12 keys, 33 slots
    hybrid = tiny_drafter("hybrid")
    assert hybrid.draft_side_bytes(100) == 100 * key
    own = {**MEMORY.model_dump(), "draft_cache": True,
           "memory": {**MEMORY.memory.model_dump(), "caches": "draft"}}
    assert tiny_drafter("hybrid", kv_budget=own).draft_side_bytes(100) == (12 + 33) * key
    plain = tiny_drafter("hybrid", kv_budget={**own, "memory": None})
    assert plain.draft_side_bytes(100) == 12 * key
    # a KV-only drafter holds nothing of its own; a target memory adds each sampled layer's slots
    assert tiny_drafter("kv").draft_side_bytes(100) == 0
    kv = tiny_drafter("kv", kv_budget=MEMORY.model_dump())
    assert kv.draft_side_bytes(100) == 33 * key * len(kv.cfg.kv_layers)


def test_block_summaries_are_made_once_per_block_and_remade_after_a_write() -> None:
    """The served memory's store (`BlockSummaries`): a block is summarised the first time a
    read needs it, read again from the store, and summarised again once a slot of it is
    written; padding entries (-1) are never summarised."""
    from kvshot_vllm.serving.backend import BlockSummaries

    made: list[list[int]] = []
    version = torch.zeros(8)  # what a block's summary is made of: how often it was written

    def summarise(blocks: torch.Tensor) -> torch.Tensor:
        made.append(sorted(blocks.tolist()))
        return torch.stack([blocks.float(), version[blocks]], dim=-1)

    store = BlockSummaries()
    first = store.read("memory", 8, torch.tensor([[1, 2], [2, -1]]), summarise)
    assert made == [[1, 2]]
    assert first[0].tolist() == [[1.0, 0.0], [2.0, 0.0]]
    store.read("memory", 8, torch.tensor([[2, 1]]), summarise)
    assert made == [[1, 2]]  # nothing stale: no block summarised
    version[2] = 1
    store.invalidate(torch.tensor([2 * 4 + 3, -1]), block_size=4)  # a slot of block 2; padding
    again = store.read("memory", 8, torch.tensor([[1, 2, 5]]), summarise)
    assert made[-1] == [2, 5]
    assert again[0].tolist() == [[1.0, 0.0], [2.0, 1.0], [5.0, 0.0]]
