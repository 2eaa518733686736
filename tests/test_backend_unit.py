"""Pure logic of the draft metadata builder (shared by the CPU and FlashAttention subclasses)."""

from __future__ import annotations

import torch

from kvshot_vllm.serving.backend import PAD_SLOT, block_layout, write_slots


def test_write_slots_follow_the_block_table() -> None:
    block_size = 16
    table = torch.tensor([[7, 3, 0], [2, 9, 4]])
    # last carried token at position seq_len - 1: 20 -> block 1 of req 0 (3), offset 4;
    # 32 -> block 2 of req 1 (4), offset 0
    slots = write_slots(table, torch.tensor([21, 33]), block_size, max_model_len=48)
    assert slots.tolist() == [3 * 16 + 4, 4 * 16 + 0]


def test_no_write_past_the_model_length() -> None:
    table = torch.tensor([[1, 2]])
    assert write_slots(table, torch.tensor([33]), 16, max_model_len=32).tolist() == [PAD_SLOT]



def test_block_rows_write_consecutive_slots_and_see_their_prefix() -> None:
    """Two requests, k = 3, step-0 key counts 15 and 32 (bonus tokens at positions 14 and 31):
    rows at positions 14..16 and 31..33, both crossing a block boundary; position 33 is past
    the model length, so nothing is written there. The last row of a request sees every key
    up to its own (causal attention gives row j S + j keys)."""
    table = torch.tensor([[5, 8, 0], [1, 2, 6]])
    starts, lens, slots = block_layout(torch.tensor([15, 32], dtype=torch.int32), table, k=3,
                                       block_size=16, max_model_len=33)
    assert starts.tolist() == [0, 3, 6]
    assert lens.tolist() == [17, 34]
    assert slots.tolist() == [5 * 16 + 14, 5 * 16 + 15, 8 * 16 + 0,
                              2 * 16 + 15, 6 * 16 + 0, PAD_SLOT]
