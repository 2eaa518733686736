"""What training on whole conversations would save over training on one record per turn.

    python bench/multiturn_packing.py --dataset DIR [--max-len 1024] [--ttt-steps 7]
        [--out bench/results/multiturn_packing]

A multi-turn data set (`kvshot data prepare --max-turns N`) holds one record per user turn, its
prompt the conversation so far with the target's own earlier replies. So turn t's sequence
(prompt + reply) usually starts with turn t-1's whole sequence, and the target forward over that
prefix, which live features run for every batch, is repeated once per later turn. One sequence
per conversation with a loss over each of its replies (what speculators and EAGLE train on)
would run the forward once. This counts, over the training split, the tokens of the records
against the tokens of such chains: a record joins its predecessor's chain when its prompt starts
with the predecessor's prompt and reply token for token, else it starts a new chain (not every
one does: a reply cut at max_new_tokens gets an end-of-turn token in the next prompt, and a
reply's text may tokenize otherwise there). The replies, hence the loss tokens, are the same
either way.

The forward is not the whole step: the TTT chain's draft steps after the first run over the rows
from `ttt_steps` before a sequence's first scored position to its end (`ttt.first_scored_row`),
and a conversation's sequence holds its later user turns there, which a record's does not. So
this also counts those rows both ways. Sequences are cut at `max_len` tokens, as training cuts
them. Nothing is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvshot_vllm.data import read_records
from kvshot_vllm.results import write_results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--max-len", type=int, default=1024, help="training's sequence cut")
    ap.add_argument("--ttt-steps", type=int, default=7, help="the chain's draft steps")
    ap.add_argument("--out", default="bench/results/multiturn_packing")
    a = ap.parse_args()
    records = read_records(Path(a.dataset) / "train.jsonl")

    def sequence(r: dict) -> list[int]:
        return r["prompt_token_ids"] + r["response_token_ids"]

    def trained(r: dict) -> int:
        return min(len(sequence(r)), a.max_len)

    def chain_rows(first_prompt: int, end: int) -> int:
        return end - max(0, first_prompt - 1 - a.ttt_steps)

    chains: list[tuple[int, int]] = []  # per chain: its first prompt, its trained tokens
    open_chain: dict[str, tuple[int, dict]] = {}  # conversation -> (chain, its last record)
    chained = 0
    for r in sorted(records, key=lambda r: (r["conversation"], r["turn"])):
        chain, last = open_chain.get(r["conversation"], (None, None))
        before = sequence(last) if last else None
        if before and r["turn"] == last["turn"] + 1 \
                and r["prompt_token_ids"][:len(before)] == before:
            chained += 1
            chains[chain] = (chains[chain][0], trained(r))
        else:
            chain = len(chains)
            chains.append((len(r["prompt_token_ids"]), trained(r)))
        open_chain[r["conversation"]] = (chain, r)

    record_tokens = sum(trained(r) for r in records)
    reply_tokens = sum(trained(r) - len(r["prompt_token_ids"]) for r in records)
    packed_tokens = sum(end for _, end in chains)
    record_rows = sum(chain_rows(len(r["prompt_token_ids"]), trained(r)) for r in records)
    packed_rows = sum(chain_rows(first, end) for first, end in chains)
    command = f"python bench/multiturn_packing.py {' '.join(sys.argv[1:])}"
    lines = [f"Command: `{command}`", "",
             f"{Path(a.dataset).name}, training split: {len(records)} records of "
             f"{len({r['conversation'] for r in records})} conversations; {chained} records "
             f"continue their previous turn's sequence token for token. Sequences cut at "
             f"{a.max_len} tokens; chain rows: those of draft steps 1..{a.ttt_steps - 1}, from "
             f"{a.ttt_steps} before a sequence's first scored position to its end.", "",
             "| sequences | count | tokens the target forward (and draft step 0) runs | "
             "chain rows per later draft step | reply (loss) tokens |", "|---|---|---|---|---|",
             f"| one per record (today) | {len(records)} | {record_tokens} | {record_rows} | "
             f"{reply_tokens} |",
             f"| one per conversation chain | {len(chains)} | {packed_tokens} | {packed_rows} | "
             f"{reply_tokens} |", "",
             f"Per record against per chain: {record_tokens / packed_tokens:.2f}x the forward "
             f"tokens, {record_rows / packed_rows:.2f}x the chain rows of each later draft step."]
    write_results(a.out, {"command": command, "dataset": str(a.dataset),
                          "max_len": a.max_len, "ttt_steps": a.ttt_steps,
                          "records": len(records), "chained_records": chained,
                          "chains": len(chains), "record_tokens": record_tokens,
                          "chain_tokens": packed_tokens, "record_chain_rows": record_rows,
                          "packed_chain_rows": packed_rows, "reply_tokens": reply_tokens}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
