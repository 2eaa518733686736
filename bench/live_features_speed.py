"""Live features (`kvshot train --features live`): the target forward of a training batch with
the output head over every position against over the trained positions only
(`batched_forward(label_rows=...)`, what `LiveFeatures.batch` does), side by side in one run.

    python bench/live_features_speed.py --dataset DIR [--batches 12] [--rounds 2]
                                        [--out bench/results/live_features_speed]

The batches are `--batches` of the `full` preset's (8 sequences from length buckets), spread
evenly over one pass of the set, run by the bf16 target that the scale runs use; the two
settings alternate batch by batch, `--rounds` times, so that machine noise hits both alike. Per
batch: the median time of each over the rounds. Also checked: the labels at the trained
positions agree (a rare bf16 near-tie may flip: the head runs over another number of rows).
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
from kvshot_vllm.training.features import batched_forward
from kvshot_vllm.training.pipeline import feature_spec, features_for, train_config
from kvshot_vllm.training.schedule import batch_order


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/live_features_speed")
    a = ap.parse_args()
    data_dir = resolve_data_dir()
    target = target_dir(data_dir, "float32")
    live = features_for(data_dir, target, Path(a.dataset), "train",
                        feature_spec(target, forward_dtype="bfloat16"), live=True)
    cfg = train_config("full")
    lengths = [live.length(i) for i in range(len(live))]
    one_pass = len(live) // cfg.batch_size
    batches = [batch_order(lengths, cfg, k * one_pass // a.batches) for k in range(a.batches)]

    batched_forward(live.model, live.inputs(batches[0])[0], live.spec)  # warm-up
    times = {"every position": [[] for _ in batches], "trained positions": [[] for _ in batches]}
    agree = total = 0
    for _ in range(a.rounds):
        for b, batch in enumerate(batches):
            ids, _, trainable = live.inputs(batch)
            start = time.perf_counter()
            every = batched_forward(live.model, ids, live.spec)
            times["every position"][b].append(time.perf_counter() - start)
            start = time.perf_counter()
            trained = batched_forward(live.model, ids, live.spec, label_rows=trainable)
            times["trained positions"][b].append(time.perf_counter() - start)
            agree += int((every["labels"][trainable] == trained["labels"][trainable]).sum())
            total += int(trainable.sum())

    tokens = sum(lengths[i] for batch in batches for i in batch)
    trained_share = sum(lengths[i] - live.prompt_length(i) for batch in batches
                        for i in batch) / tokens
    seconds = {name: sum(statistics.median(t) for t in per_batch)
               for name, per_batch in times.items()}
    base = seconds["every position"]
    command = f"python bench/live_features_speed.py {' '.join(sys.argv[1:])}"
    lines = [f"Command: `{command}`", "",
             f"The bf16 target forward of {len(batches)} of the `full` preset's batches of "
             f"{Path(a.dataset).name} spread over one pass (8 sequences each, {tokens} "
             f"tokens, {trained_share:.0%} of them response), {a.rounds} rounds, the two "
             f"settings alternating batch by batch; the median of the rounds per batch, "
             f"summed.", "",
             "| output head over | seconds | tokens/s | speed vs every position |",
             "|---|---|---|---|"]
    for name, s in seconds.items():
        lines.append(f"| {name} | {s:.2f} | {tokens / s:.0f} | {base / s:.2f}x |")
    lines += ["", f"Labels at the trained positions equal: {agree}/{total} ({agree / total:.4%})."]
    write_results(a.out, {"command": command, "dataset": str(a.dataset), "tokens": tokens,
                          "response_share": trained_share, "seconds": seconds,
                          "per_batch_s": times, "labels_agree": [agree, total]}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
