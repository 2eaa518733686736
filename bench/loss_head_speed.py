"""The TTT loss head on a CPU, as it was and as it is, side by side in one run: per draft step
of a training step, lm_head over the scored rows, the hits (the draft equals the target's
token) and the hard cross-entropy over the draft vocabulary, forward and backward, under bf16
autocast, on a real batch: the shipped hidden-only drafter's 7-step chain over a data set's
sequences.

- before (to commit 90af0d0): the rows whose target is outside the draft vocabulary cut out of
  the logits by a boolean index, the cross-entropy under autocast on the upcast logits, argmax
  for the hits;
- after (`ttt.chain_predictions`, `ttt.hard_cross_entropy`): those rows ignored by the same
  fp32 cross-entropy (`ignore_index`), max's indices for the hits.

Both give the same loss and hits (checked here); the script reports milliseconds per training
step for each, the median of interleaved repeats.

    python bench/loss_head_speed.py --dataset DIR [--split heldout] [--batch 8] [--repeats 5]
        [--out bench/results/loss_head_speed]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvshot_vllm.models.drafter import load_drafter
from kvshot_vllm.paths import resolve_data_dir
from kvshot_vllm.results import write_results
from kvshot_vllm.target import target_dir
from kvshot_vllm.training.pipeline import feature_spec, features_for
from kvshot_vllm.training.ttt import first_scored_row, hard_cross_entropy, shifted

DRAFTER = Path("drafters/smollm2-135m-instruct/hidden")
STEPS = 7


def before(drafter, h, target, t2d):
    logits = drafter.lm_head(h)
    hit = drafter.target_ids(logits.argmax(-1)) == target
    draft_label = t2d[target]
    keep = draft_label >= 0
    return F.cross_entropy(logits[keep].float(), draft_label[keep]), hit


def after(drafter, h, target, t2d):
    logits = drafter.lm_head(h)
    hit = drafter.target_ids(logits.max(-1).indices) == target
    return hard_cross_entropy(logits, target, t2d), hit


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--split", default="heldout")
    ap.add_argument("--batch", type=int, default=8, help="sequences of the training step")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/loss_head_speed")
    a = ap.parse_args()
    data_dir = resolve_data_dir()
    target = target_dir(data_dir, "float32")
    features = features_for(data_dir, target, Path(a.dataset), a.split, feature_spec(target))
    drafter = load_drafter(DRAFTER, target)
    t2d = drafter.draft_ids()

    batch = list(range(min(a.batch, len(features))))
    feats, labels, trainable = features.batch(batch, drafter.cfg.kv_layers,
                                              drafter.cfg.uses_aux_hidden)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        chain = drafter.chain(feats, STEPS, first_scored_row(trainable, STEPS))
    heads = []  # per draft step: the scored rows' chain outputs and their targets
    for j, normed in enumerate(chain):
        mask = shifted(trainable, 1 + j, False)[:, -normed.shape[1]:]
        heads.append((normed[mask], shifted(labels, 1 + j)[:, -normed.shape[1]:][mask]))

    def training_step(head) -> tuple[float, list[torch.Tensor]]:
        start, results = time.perf_counter(), []
        for h, target_ids in heads:
            h = h.detach().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, hit = head(drafter, h, target_ids, t2d)
            loss.backward()
            results += [loss.detach(), hit]
        drafter.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) * 1e3, results

    heads_by_name = {"before": before, "after": after}
    _, ref = training_step(before)
    _, got = training_step(after)
    for x, y in zip(ref, got):
        torch.testing.assert_close(x, y)
    times: dict[str, list[float]] = {name: [] for name in heads_by_name}
    for _ in range(a.repeats):
        for name, head in heads_by_name.items():
            times[name].append(training_step(head)[0])
    ms = {name: statistics.median(t) for name, t in times.items()}
    rows = sum(h.shape[0] for h, _ in heads)
    command = f"python bench/loss_head_speed.py {' '.join(sys.argv[1:])}"
    lines = [f"Command: `{command}`", "",
             f"The shipped hidden-only drafter's {STEPS}-step chain over {len(batch)} sequences "
             f"of {Path(a.dataset).name} ({a.split}): {rows} scored rows over the {STEPS} steps, "
             f"draft vocabulary {drafter.cfg.draft_vocab_size}, bf16 autocast, {torch.get_num_threads()} threads. "
             f"Milliseconds per training step for lm_head, hits and cross-entropy, forward and "
             f"backward: median of {a.repeats} interleaved repeats. Same losses and hits.", "",
             "| loss head | ms per step | vs before |", "|---|---|---|"]
    lines += [f"| {name} | {m:.0f} | {ms['before'] / m:.2f}x |" for name, m in ms.items()]
    write_results(a.out, {"command": command, "rows": rows, "batch": len(batch),
                          "threads": torch.get_num_threads(), "ms": times, "median_ms": ms},
                  lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
