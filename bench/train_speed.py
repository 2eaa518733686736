"""Training throughput: fp32 against bf16 autocast, and cached features against computing them
on the fly, side by side on the cached training features of the embedded target.

    python bench/train_speed.py [--paradigm hidden] [--steps 6] [--out bench/results/train_speed]

Per setting: the median seconds per TTT step (batch of 4 sequences, 7 draft steps) over
`--steps` steps after one warm-up step, and tokens per second. "features on the fly" adds the
target forward that would produce the batch's features (timed separately with the same model
and sequences) to each step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvshot_vllm.engine import cpu_has_native_bf16
from kvshot_vllm.paths import resolve_data_dir
from kvshot_vllm.results import write_results
from kvshot_vllm.target import target_dir
from kvshot_vllm.training.features import target_forward
from kvshot_vllm.training.pipeline import drafter_config, feature_spec, features_for, train_config
from kvshot_vllm.training.ttt import Trainer, batch_order, ttt_loss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--paradigm", default="hidden", choices=["hidden", "kv", "hybrid"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default="bench/results/train_speed")
    a = ap.parse_args()
    data_dir = resolve_data_dir()
    target = target_dir(data_dir, "float32")
    dataset = data_dir / "datasets" / f"sharegpt-{target.name}"
    spec = feature_spec(target)
    features = features_for(data_dir, target, dataset, "train", spec)
    cfg = train_config("full", steps=a.steps + 1)
    trainer = Trainer(Path(tempfile.mkdtemp()), drafter_config(
        target, cfg, paradigm=a.paradigm), cfg, target, features)
    dcfg = trainer.drafter.cfg
    batches = [batch_order(len(features), cfg, s) for s in range(a.steps + 1)]

    def step_time(batch: list[int], autocast: bool) -> float:
        feats, labels, trainable = features.batch(batch, dcfg.kv_layers, dcfg.uses_aux_hidden)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = ttt_loss(trainer.drafter, feats, labels, trainable, cfg, trainer.t2d)
        loss.backward()
        trainer.drafter.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def feature_time(batch: list[int]) -> float:
        start = time.perf_counter()
        for i in batch:
            target_forward(model, features.item(i)["input_ids"].tolist(), spec)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"fp32": [], "bf16 autocast": [], "target forward": []}
    for s, batch in enumerate(batches):  # interleaved, so that machine noise hits all alike
        measured = (step_time(batch, False), step_time(batch, True), feature_time(batch))
        if s > 0:
            for key, t in zip(times, measured):
                times[key].append(t)
    tokens = statistics.median(sum(features.length(i) for i in b) for b in batches[1:])
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = {"fp32, cached features": med["fp32"],
            "bf16 autocast, cached features": med["bf16 autocast"],
            "fp32, features on the fly": med["fp32"] + med["target forward"]}
    lines = [f"Command: `python bench/train_speed.py {' '.join(sys.argv[1:])}`", "",
             f"{a.paradigm} drafter, batch of {cfg.batch_size} sequences (median {tokens:.0f} "
             f"tokens), {cfg.ttt_steps} TTT steps, {a.steps} measured steps, interleaved. "
             f"CPU native bf16: {cpu_has_native_bf16()}.", "",
             "| setting | s/step (median) | tokens/s | vs fp32 cached |", "|---|---|---|---|"]
    for name, t in rows.items():
        lines.append(f"| {name} | {t:.2f} | {tokens / t:.0f} | {rows['fp32, cached features'] / t:.2f}x |")
    write_results(a.out, {"paradigm": a.paradigm, "tokens_per_batch": tokens, "times": times,
                          "median_s": med, "native_bf16": cpu_has_native_bf16()}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
