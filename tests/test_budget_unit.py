"""Sparse KV views (`models/budget.py`): which keys a budgeted drafter sees, the same on the
training side (a mask) and the serving side (a shorter block table), and the configs refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.budget import (KVBudget, block_means, dropped_blocks, retrieve,
                                       retrieved_block_table, view_block_table, visible_keys)
from kvshot_vllm.models.config import validated
from kvshot_vllm.models.layers import draft_attention
from kvshot_vllm.serving.checks import check_against_target
from tests.test_config_unit import SMOL

BUDGET = KVBudget(tokens=16, sink_tokens=4, block_size=4)  # 1 sink block, 3 window blocks
# 1 sink block, 2 recent blocks, 2 retrieved blocks
RETRIEVAL = KVBudget(policy="retrieval", tokens=20, sink_tokens=4, block_size=4)


def _blocks_in_view(verified: int, num_keys: int, budget: KVBudget = BUDGET) -> list[int]:
    keys = visible_keys(torch.tensor([verified]), num_keys, budget)[0]
    return sorted({i // budget.block_size for i in keys.nonzero().flatten().tolist()})


def test_streaming_view_is_sink_and_recent_window() -> None:
    # 30 verified keys: blocks 0..7, the last (7) partial; sink block 0, window 5..7
    assert _blocks_in_view(30, 30) == [0, 5, 6, 7]
    # drafted positions past V (here 30..33, block 8) are always in view
    assert _blocks_in_view(30, 34) == [0, 5, 6, 7, 8]
    # a prefix inside the budget is seen whole
    assert _blocks_in_view(16, 19) == [0, 1, 2, 3, 4]
    assert _blocks_in_view(5, 8) == [0, 1]
    # the view moves by whole blocks
    assert _blocks_in_view(32, 32) == [0, 5, 6, 7]
    assert _blocks_in_view(33, 33) == [0, 6, 7, 8]
    with_two_sinks = KVBudget(tokens=16, sink_tokens=8, block_size=4)
    assert _blocks_in_view(40, 40, with_two_sinks) == [0, 1, 8, 9]


@pytest.mark.parametrize("verified", range(1, 80))
def test_view_holds_at_most_the_budget_and_every_draft(verified: int) -> None:
    keys = visible_keys(torch.tensor([verified]), verified + 5, BUDGET)[0]
    assert keys[verified:].all()
    seen = int(keys[:verified].sum())
    assert seen == verified if verified <= BUDGET.tokens - BUDGET.block_size + 1 else (
        BUDGET.tokens - BUDGET.block_size < seen <= BUDGET.tokens)
    assert keys[verified - 1]  # the last verified key, always


def _retrieval_case(verified: torch.Tensor, width: int, seed: int = 0):
    """One query row per request [n, 1, H, d], and its keys [n, KVH, T, d]."""
    g = torch.Generator().manual_seed(seed)
    n, h, kvh, d, bs = len(verified), 4, 2, 8, RETRIEVAL.block_size
    query = torch.randn(n, 1, h, d, generator=g)
    keys = torch.randn(n, kvh, width * bs, d, generator=g)
    return query, keys


def test_retrieval_view_keeps_sink_recent_window_and_the_best_scoring_blocks() -> None:
    # 40 verified keys: blocks 0..9; sink 0, recent window 8..9, gap 1..7 holding 2 retrieved
    verified = torch.tensor([[40]])
    query, keys = _retrieval_case(verified, 12)
    means = block_means(keys, RETRIEVAL)  # blocks 1..11
    scores = torch.einsum("nkd,nkwd->nw", query.view(1, 2, 2, 8).sum(2), means)[0, :7]
    best = sorted((scores.topk(2).indices + 1).tolist())
    chosen = retrieve(query, means, verified, RETRIEVAL)[0]
    assert chosen.tolist() == [best]
    keys_seen = visible_keys(verified[0], 43, RETRIEVAL, chosen)[0]
    blocks = sorted({i // 4 for i in keys_seen.nonzero().flatten().tolist()})
    assert blocks == sorted({0, *best, 8, 9, 10})  # block 10: the drafts past V, always
    # a block's score is its mean key's: raising one gap block's keys along the query moves
    # the choice to it
    worst = int(scores.argmin()) + 1
    keys[0, :, worst * 4:(worst + 1) * 4] += 50 * query[0, 0].view(2, 2, 8).sum(1).unsqueeze(1)
    assert worst in retrieve(query, block_means(keys, RETRIEVAL), verified, RETRIEVAL)[0, 0]


@pytest.mark.parametrize("verified", range(1, 60))
def test_retrieval_view_holds_at_most_the_budget_and_every_draft(verified: int) -> None:
    v = torch.tensor([verified])
    query, keys = _retrieval_case(v, 16, seed=verified)
    chosen = retrieve(query, block_means(keys, RETRIEVAL), v.unsqueeze(1), RETRIEVAL)[0]
    keys_seen = visible_keys(v, verified + 5, RETRIEVAL, chosen)[0]
    assert keys_seen[verified:].all() and keys_seen[verified - 1]
    seen = int(keys_seen[:verified].sum())
    # a prefix whose gap fits the retrieved blocks is seen whole, and no view exceeds the budget
    whole = verified <= RETRIEVAL.tokens - RETRIEVAL.block_size + 1
    assert seen == verified if whole else (RETRIEVAL.tokens - RETRIEVAL.block_size < seen
                                           <= RETRIEVAL.tokens)
    assert seen == verified - int(dropped_blocks(v, RETRIEVAL)) * RETRIEVAL.block_size
    assert ((chosen >= 0).all() or whole) and not (chosen >= RETRIEVAL.sink_blocks + (
        verified // 4 - RETRIEVAL.window_blocks + 1)).any()  # only gap blocks are retrieved


@pytest.mark.parametrize("budget", [BUDGET, RETRIEVAL], ids=["streaming", "retrieval"])
def test_served_block_table_reads_exactly_the_visible_keys(budget: KVBudget) -> None:
    """Key i of a request's view (what vLLM's kernel reads through the view's block table, for
    the view's key count) is the i-th visible key of the full table."""
    torch.manual_seed(0)
    bs, width = budget.block_size, 24
    verified = torch.tensor([1, 12, 16, 17, 30, 47, 80])
    num_keys = verified + 3  # the row carrying draft 2
    table = torch.stack([torch.randperm(1000)[:width] for _ in verified])
    dropped = dropped_blocks(verified, budget)
    view = view_block_table(table, dropped, budget)
    chosen = None
    if budget.policy == "retrieval":
        query, keys = _retrieval_case(verified, width)
        chosen = retrieve(query, block_means(keys, budget), verified.unsqueeze(1),
                          budget).squeeze(1)
        retrieved_block_table(view, table, chosen, budget)
    for r in range(len(verified)):
        n = int(num_keys[r])
        slots = table[r, torch.arange(n) // bs] * bs + torch.arange(n) % bs
        expected = slots[visible_keys(verified[r:r + 1], n, budget,
                                      None if chosen is None else chosen[r:r + 1])[0]]
        view_len = n - int(dropped[r]) * bs
        served = view[r, torch.arange(view_len) // bs] * bs + torch.arange(view_len) % bs
        assert torch.equal(served, expected), r


def test_draft_attention_under_a_budget_ignores_keys_out_of_view() -> None:
    """Changing a key out of a row's view changes nothing for that row, and changes rows that
    see it."""
    torch.manual_seed(0)
    b, t, h, kvh, d = 1, 40, 2, 1, 8
    q = torch.randn(b, t, h, d)
    ctx = (torch.randn(b, kvh, t, d), torch.randn(b, kvh, t, d))
    diag = [(torch.randn(b, t, kvh, d), torch.randn(b, t, kvh, d))]
    out = draft_attention(q, ctx, diag, BUDGET)
    spoiled = (ctx[0].clone(), ctx[1].clone())
    spoiled[0][:, :, 6], spoiled[1][:, :, 6] = 9.0, 9.0  # key 6: block 1
    out2 = draft_attention(q, spoiled, diag, BUDGET)
    sees_6 = visible_keys(torch.arange(1, t + 1), t, BUDGET)[:, 6] & (torch.arange(t) >= 6)
    changed = (out - out2).abs().amax(-1)[0] > 0
    assert torch.equal(changed, sees_6) and sees_6.any() and not sees_6.all()
    # without a budget, every row from 6 on sees key 6
    full = draft_attention(q, ctx, diag) - draft_attention(q, spoiled, diag)
    assert torch.equal(full.abs().amax(-1)[0] > 0, torch.arange(t) >= 6)


@pytest.mark.parametrize("fields, message", [
    ({"paradigm": "kv", "kv_budget": {"tokens": 0, "block_size": 32}},
     "kv_budget.tokens: Input should be greater than 0"),
    ({"paradigm": "kv", "kv_budget": {"tokens": 100, "block_size": 32}},
     "tokens 100 is not a multiple of block_size 32"),
    ({"paradigm": "kv", "kv_budget": {"policy": "oracle", "tokens": 128, "block_size": 32}},
     "kv_budget.policy: Input should be 'streaming'"),
    ({"paradigm": "kv", "kv_budget": {"tokens": 64, "sink_tokens": 32, "block_size": 32}},
     r"the recent window \(32 tokens\) is less than two blocks of 32"),
    ({"paradigm": "kv", "kv_budget": {"policy": "retrieval", "tokens": 96, "block_size": 32}},
     r"a retrieval view of 96 tokens leaves no block to retrieve after its sink \(32\) and "
     r"recent window \(64\)"),
    ({"paradigm": "kv", "kv_budget": {"tokens": 256, "recent_tokens": 64, "block_size": 32}},
     "recent_tokens is the retrieval policy's recent window"),
    ({"paradigm": "hybrid", "kv_budget": {"policy": "retrieval", "tokens": 256,
                                          "block_size": 32, "draft_cache": True}},
     "draft_cache is not implemented for the retrieval policy"),
    ({"paradigm": "hidden", "kv_budget": {"tokens": 128, "block_size": 32}},
     r"kv_budget: a hidden drafter reads no target KV; its budget can only view its own cache "
     r"\(draft_cache: true\)"),
    ({"paradigm": "hidden", "kv_budget": {"tokens": 128, "block_size": 32, "draft_cache": True,
                                          "memory": {"chunk_tokens": 32, "slots": 4}}},
     "kv_budget.memory.caches 'target': a hidden drafter reads no target KV to summarise"),
    ({"paradigm": "kv", "kv_budget": {"tokens": 128, "block_size": 32, "draft_cache": True}},
     "kv_budget.draft_cache: a kv drafter has no cache of its own"),
    ({"paradigm": "hybrid", "num_layers": 2,
      "kv_budget": {"tokens": 128, "block_size": 32, "draft_cache": True}},
     "kv_budget.draft_cache: served exactly for one EAGLE-3 layer, not 2"),
])
def test_bad_budgets_are_refused_by_name(fields, message) -> None:
    with pytest.raises(KVShotError, match=message):
        validated({**fields, "target": SMOL})


def test_serving_refuses_a_budget_the_engine_cannot_give() -> None:
    cfg = validated({"paradigm": "kv", "target": SMOL,
                     "kv_budget": {"tokens": 512, "block_size": 32}})
    hf = SimpleNamespace(hidden_size=576, vocab_size=49152, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rope_parameters={"rope_theta": 1e5}, rms_norm_eps=1e-5,
                         intermediate_size=1536)

    def engine(max_len: int, block_size: int):
        return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, max_model_len=max_len),
                               cache_config=SimpleNamespace(block_size=block_size))

    check_against_target(cfg, engine(2048, 32))
    with pytest.raises(KVShotError, match="kv_budget.tokens 512 is the whole context or more "
                                          r"\(max_model_len 512\)"):
        check_against_target(cfg, engine(512, 32))
    with pytest.raises(KVShotError, match="serve with --block-size 32"):
        check_against_target(cfg, engine(2048, 128))


def test_cli_refuses_bad_views_before_reading_data() -> None:
    from tests.conftest import assert_one_line_error, run_kvshot

    assert_one_line_error(run_kvshot("train", "--paradigm", "kv", "--multi-view", "100:1"),
                          "multi_view: tokens 100 is not a multiple of block_size 32")
    assert_one_line_error(run_kvshot("train", "--paradigm", "kv", "--multi-view", "256"),
                          "--multi-view takes TOKENS:PROBABILITY pairs")
    assert_one_line_error(run_kvshot("diagnose", "x=y", "--kv-budgets", "64"),
                          "--kv-budgets: the recent window (32 tokens) is less than two")
    assert_one_line_error(run_kvshot("diagnose", "x=y", "--kv-budgets", "128+mine"),
                          "--kv-budgets takes TOKENS, TOKENS+own or TOKENS+retrieval, got "
                          "128+mine")


def test_a_viewed_draft_cache_hides_the_hybrids_own_distant_keys() -> None:
    """With `draft_cache`, a hybrid's self-attention reads the view of its own step-0 keys: a
    change to the drafter's input at a position out of a row's view leaves that row's drafts
    alone, which it does not without `draft_cache` (the cross view alone)."""
    from transformers import LlamaConfig

    from kvshot_vllm.models.config import TargetSpec
    from kvshot_vllm.models.drafter import Drafter, TargetFeatures
    from kvshot_vllm.models.weights import init_weights

    hf = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=50)
    g = torch.Generator().manual_seed(0)
    t = 40
    kv = {layer: (torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g))
          for layer in (0, 3)}
    ids = torch.randint(0, 50, (1, t), generator=g)
    aux = torch.randn(1, t, 3 * 32, generator=g)
    spoiled = aux.clone()
    spoiled[:, 6] = 5.0  # the drafter's own key at position 6, in block 1

    def last_rows(draft_cache: bool, aux: torch.Tensor) -> torch.Tensor:
        budget = {"tokens": 16, "sink_tokens": 4, "block_size": 4, "draft_cache": draft_cache}
        cfg = validated({"paradigm": "hybrid", "target": TargetSpec.from_hf_config(hf, "tiny"),
                         "kv_layers": [0, 3], "kv_budget": budget})
        drafter = Drafter(cfg, hf, torch.randn(50, 32, generator=torch.Generator()))
        drafter.load_checkpoint_weights(init_weights(cfg, seed=1, std=0.3))
        with torch.no_grad():
            return drafter.chain(TargetFeatures(ids, aux, kv), 2)[-1][0, 20:]

    # rows 20.. verify 21.. keys: block 1 (keys 4..7) is out of their view
    assert torch.equal(last_rows(True, aux), last_rows(True, spoiled))
    assert not torch.equal(last_rows(False, aux), last_rows(False, spoiled))
