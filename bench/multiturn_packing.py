"""What training on whole conversations would save over training on one record per turn.

    python bench/multiturn_packing.py --dataset DIR [--out bench/results/multiturn_packing]

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
either way. Nothing is timed.
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
    ap.add_argument("--out", default="bench/results/multiturn_packing")
    a = ap.parse_args()
    records = read_records(Path(a.dataset) / "train.jsonl")

    def sequence(r: dict) -> list[int]:
        return r["prompt_token_ids"] + r["response_token_ids"]

    chain_lengths: list[int] = []  # per chain: its longest (last) sequence's tokens
    open_chain: dict[str, tuple[int, dict]] = {}  # conversation -> (chain, its last record)
    chained = 0
    for r in sorted(records, key=lambda r: (r["conversation"], r["turn"])):
        chain, last = open_chain.get(r["conversation"], (None, None))
        before = sequence(last) if last else None
        if before and r["turn"] == last["turn"] + 1 \
                and r["prompt_token_ids"][:len(before)] == before:
            chained += 1
            chain_lengths[chain] = len(sequence(r))
        else:
            chain = len(chain_lengths)
            chain_lengths.append(len(sequence(r)))
        open_chain[r["conversation"]] = (chain, r)

    record_tokens = sum(len(sequence(r)) for r in records)
    reply_tokens = sum(len(r["response_token_ids"]) for r in records)
    packed_tokens = sum(chain_lengths)
    command = f"python bench/multiturn_packing.py {' '.join(sys.argv[1:])}"
    lines = [f"Command: `{command}`", "",
             f"{Path(a.dataset).name}, training split: {len(records)} records of "
             f"{len({r['conversation'] for r in records})} conversations; {chained} records "
             f"continue their previous turn's sequence token for token.", "",
             "| sequences | count | tokens the target forward runs | reply (loss) tokens |",
             "|---|---|---|---|",
             f"| one per record (today) | {len(records)} | {record_tokens} | {reply_tokens} |",
             f"| one per conversation chain | {len(chain_lengths)} | {packed_tokens} | "
             f"{reply_tokens} |", "",
             f"Forward tokens per record against per chain: {record_tokens / packed_tokens:.2f}x."]
    write_results(a.out, {"command": command, "dataset": str(a.dataset),
                          "records": len(records), "chained_records": chained,
                          "chains": len(chain_lengths), "record_tokens": record_tokens,
                          "chain_tokens": packed_tokens, "reply_tokens": reply_tokens}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
