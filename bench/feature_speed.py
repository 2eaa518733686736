"""Feature extraction throughput: one sequence per target forward against padded batches of
similar lengths (`features.forward_sequences`), side by side in one run, and how far the batched
features are from the one-at-a-time ones.

    python bench/feature_speed.py [--dataset DIR] [--sequences 96] [--rounds 2]
                                  [--batch-tokens 1 2048 4096 8192]
                                  [--out bench/results/feature_speed]

The sequences are every k-th of the training split (so all lengths appear), extracted in shards
of 16 as `extract_features` does, by the bf16 forward that the scale runs use. Settings are
interleaved shard by shard, `--rounds` times, so that machine noise hits all alike; tokens/s
counts real tokens (padding is work that buys nothing). Agreement is against batch_tokens = 1,
the extraction every cached feature set so far was made with: labels (the greedy token, where a
rare near-tie may flip) and stored bf16 values that differ by more than one unit in the last place.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from kvshot_vllm.paths import resolve_data_dir
from kvshot_vllm.results import write_results
from kvshot_vllm.target import target_dir
from kvshot_vllm.training.features import forward_sequences, load_target, sequences
from kvshot_vllm.training.pipeline import feature_spec


def beyond_one_ulp(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of bf16 values of `a` and `b` more than one unit in the last place apart."""
    a, b = a.float(), b.float()
    ulp = torch.maximum(a.abs(), b.abs()).clamp(min=1e-30) * 2.0**-7
    return float(((a - b).abs() > ulp).float().mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", help="default: DATA_DIR/datasets/sharegpt-2k-2turns")
    ap.add_argument("--sequences", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[1, 2048, 4096, 8192])
    ap.add_argument("--out", default="bench/results/feature_speed")
    a = ap.parse_args()
    if 1 not in a.batch_tokens:
        a.batch_tokens = [1, *a.batch_tokens]
    data_dir = resolve_data_dir()
    target = target_dir(data_dir, "float32")
    dataset = Path(a.dataset) if a.dataset else data_dir / "datasets" / "sharegpt-2k-2turns"
    spec = feature_spec(target, forward_dtype="bfloat16")
    every = sequences(dataset, "train", spec.max_len)
    step = max(1, len(every) // a.sequences)
    seqs = [ids for _, ids, _ in every[::step][: a.sequences]]
    shards = [seqs[i:i + spec.shard_size] for i in range(0, len(seqs), spec.shard_size)]
    model = load_target(target, spec, "cpu")
    forward_sequences(model, shards[0][:2], spec)  # warm-up

    seconds = {b: [0.0] * a.rounds for b in a.batch_tokens}
    feats: dict[int, list[dict[str, torch.Tensor]]] = {b: [] for b in a.batch_tokens}
    for r in range(a.rounds):
        for shard in shards:
            for b in a.batch_tokens:
                start = time.perf_counter()
                out = forward_sequences(model, shard, spec, b)
                seconds[b][r] += time.perf_counter() - start
                if r == 0:
                    feats[b] += out
    tokens = sum(len(s) for s in seqs)
    base = statistics.median(tokens / s for s in seconds[1])
    rows = []
    for b in a.batch_tokens:
        tok_s = statistics.median(tokens / s for s in seconds[b])
        labels = torch.cat([f["labels"] for f in feats[b]])
        ref_labels = torch.cat([f["labels"] for f in feats[1]])
        off = {name: statistics.mean(beyond_one_ulp(f[name], g[name])
                                     for f, g in zip(feats[b], feats[1]))
               for name in feats[1][0] if name != "labels"}
        rows.append({"batch_tokens": b, "tokens_per_s": tok_s, "speedup": tok_s / base,
                     "labels_equal": float((labels == ref_labels).float().mean()),
                     "beyond_one_ulp": off})
    command = "python bench/feature_speed.py " + " ".join(sys.argv[1:])
    lines = [f"Feature extraction on {target.name}, bf16 forward, {len(seqs)} training sequences "
             f"of {dataset.name} ({tokens} tokens, {min(map(len, seqs))} to "
             f"{max(map(len, seqs))} each), shards of {spec.shard_size}, median of {a.rounds} "
             f"interleaved rounds.",
             f"Regenerate: `{command.strip()}`", "",
             "| batch tokens (padded) | tokens/s | vs one at a time | labels equal | "
             "aux values > 1 ulp off | K/V values > 1 ulp off |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        kv = [v for k, v in r["beyond_one_ulp"].items() if k[:2] in ("k.", "v.")]
        lines.append(f"| {'1 sequence' if r['batch_tokens'] == 1 else r['batch_tokens']} | "
                     f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | "
                     f"{100 * r['labels_equal']:.2f}% | "
                     f"{100 * r['beyond_one_ulp']['aux']:.3f}% | "
                     f"{100 * max(kv):.3f}% |")
    write_results(a.out, {"command": command, "dataset": str(dataset), "tokens": tokens,
                          "sequences": len(seqs), "rounds": a.rounds, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
