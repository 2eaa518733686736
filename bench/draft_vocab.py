"""Which draft vocabulary size (issue 13, item 3): coverage of the target's tokens against the
lm_head's time.

A drafter proposes only tokens of its draft vocabulary (EAGLE-3's d2t: the most frequent tokens
of the target's training responses, `ttt.draft_vocabulary`). Coverage, the share of the target's
held-out response tokens inside it, bounds every position's acceptance; the lm_head's time
grows with its rows. For each size: held-out coverage, and the median time of the lm_head's
matmul in the serving dtype for 1 and 16 rows (one draft pass at concurrency 1 and 16), against
the full vocabulary's.

    python bench/draft_vocab.py [--dataset DIR] [--sizes 2048 4096 8192 16384 32768 49152]
        [--out bench/results/draft_vocab]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def token_counts(path: Path, vocab_size: int) -> torch.Tensor:
    """How often each token occurs in the responses of a data set file."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    with path.open() as f:
        for line in f:
            ids = torch.tensor(json.loads(line)["response_token_ids"], dtype=torch.long)
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def median_ms(fn, repeats: int = 200) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    from kvshot_vllm.engine import default_dtype
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.results import write_results
    from kvshot_vllm.target import prepare_target

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", help="default: DATA_DIR/datasets/sharegpt-2k-2turns")
    ap.add_argument("--sizes", type=int, nargs="+",
                    default=[2048, 4096, 8192, 16384, 32768, 49152])
    ap.add_argument("--out", default="bench/results/draft_vocab")
    a = ap.parse_args()

    data_dir = resolve_data_dir()
    dataset = Path(a.dataset) if a.dataset else data_dir / "datasets" / "sharegpt-2k-2turns"
    dtype = default_dtype()
    target, _ = prepare_target(data_dir, dtype)
    cfg = json.loads((target / "config.json").read_text())
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    train = token_counts(dataset / "train.jsonl", vocab)
    heldout = token_counts(dataset / "heldout.jsonl", vocab)
    order = train.argsort(descending=True)
    torch_dtype = getattr(torch, dtype)
    rows = []
    for size in a.sizes:
        kept = order[:size]
        coverage = float(heldout[kept].sum()) / float(heldout.sum())
        weight = torch.randn(size, hidden, dtype=torch_dtype)
        times = {}
        for n in (1, 16):
            x = torch.randn(n, hidden, dtype=torch_dtype)
            times[n] = median_ms(lambda: torch.nn.functional.linear(x, weight))
        rows.append({"size": size, "heldout_coverage": coverage,
                     "lm_head_ms": {str(n): t for n, t in times.items()}})
        print(size, f"{coverage:.4f}", times, flush=True)

    full = next((r for r in rows if r["size"] == vocab), rows[-1])
    command = " ".join(["python", *sys.argv])
    lines = [f"Draft vocabulary size: held-out coverage against lm_head time, {target.name}, "
             f"{dtype}, torch threads {torch.get_num_threads()}.",
             f"Regenerate: `{command}`", "",
             f"Vocabulary chosen from the training responses of `{dataset.name}` "
             f"({int(train.sum())} tokens); coverage: share of its held-out response tokens "
             f"({int(heldout.sum())}) inside it, an upper bound on acceptance at every position. "
             f"lm_head: median ms of one matmul for 1 and 16 rows; ratio to the "
             f"{full['size']}-token vocabulary's.", "",
             "| draft vocabulary | held-out coverage | lm_head ms, 1 row | ratio | "
             "lm_head ms, 16 rows | ratio |", "|---|---|---|---|---|---|"]
    for r in rows:
        t, f = r["lm_head_ms"], full["lm_head_ms"]
        lines.append(f"| {r['size']} | {r['heldout_coverage']:.4f} | {t['1']:.3f} | "
                     f"{t['1'] / f['1']:.2f} | {t['16']:.3f} | {t['16'] / f['16']:.2f} |")
    write_results(a.out, {"command": command, "dataset": str(dataset), "dtype": dtype,
                          "rows": rows}, lines)


if __name__ == "__main__":
    main()
