"""Sparse KV views (`models/budget.py`): which keys a budgeted drafter sees, the same on the
training side (a mask) and the serving side (a shorter block table), and the configs refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvshot_vllm.errors import KVShotError
from kvshot_vllm.models.budget import (KVBudget, left_out_blocks, view_block_table,
                                       visible_keys)
from kvshot_vllm.models.config import validated
from kvshot_vllm.models.layers import draft_attention
from kvshot_vllm.serving.checks import check_against_target
from tests.test_config_unit import SMOL

BUDGET = KVBudget(tokens=16, sink_tokens=4, block_size=4)  # 1 sink block, 3 window blocks


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


def test_served_block_table_reads_exactly_the_visible_keys() -> None:
    """Key i of a request's view (what vLLM's kernel reads through the view's block table, for
    the view's key count) is the i-th visible key of the full table."""
    torch.manual_seed(0)
    bs, width = BUDGET.block_size, 24
    verified = torch.tensor([1, 12, 16, 17, 30, 47, 80])
    num_keys = verified + 3  # the row carrying draft 2
    table = torch.stack([torch.randperm(1000)[:width] for _ in verified])
    gap = left_out_blocks(verified, BUDGET)
    view = view_block_table(table, gap, BUDGET)
    for r in range(len(verified)):
        n = int(num_keys[r])
        slots = table[r, torch.arange(n) // bs] * bs + torch.arange(n) % bs
        expected = slots[visible_keys(verified[r:r + 1], n, BUDGET)[0]]
        view_len = n - int(gap[r]) * bs
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
     "leave less than two blocks"),
    ({"paradigm": "hidden", "kv_budget": {"tokens": 128, "block_size": 32}},
     "kv_budget: a hidden drafter reads no target KV"),
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
                          "--kv-budgets: tokens 64 leave less than two blocks of 32")
    assert_one_line_error(run_kvshot("diagnose", "x=y", "--kv-budgets", "128+mine"),
                          "--kv-budgets takes TOKENS or TOKENS+own, got 128+mine")


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
