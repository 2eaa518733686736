"""Training throughput, side by side in one run: today's settings against the faster ones, and
cached features against computing them on the fly.

    python bench/train_speed.py [--dataset DIR] [--paradigm hidden] [--steps 8]
                                [--out bench/results/train_speed]

Settings (TrainConfig fields): fp32 or bf16 autocast; the chain over every row, or only over the
rows a draft step scores (`loss_rows_only`, what multi-turn prompts make worth it); batches of
random lengths or from length buckets (`bucket`). Each setting trains the same drafter from the
same weights on its own batch order (the full preset's, batch of 4 sequences, 7 TTT steps) and
is timed for `--steps` steps after one warm-up, the settings interleaved step by step so that
machine noise hits all alike. tokens/s counts every token of the batch's sequences, as today's
figures do; loss tokens/s counts the response positions that are trained.

"target forward" is what features computed on the fly would add per step: the fp32 (and bf16
autocast) transformers forward of the same batch, batched and right-padded. The feature store's
bytes per token come from the extraction manifest.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvshot_vllm.models.registry import paradigm_names
from kvshot_vllm.paths import resolve_data_dir
from kvshot_vllm.results import write_results
from kvshot_vllm.target import target_dir
from kvshot_vllm.training.pipeline import drafter_config, feature_spec, features_for, train_config
from kvshot_vllm.training.schedule import batch_order
from kvshot_vllm.training.ttt import Trainer, ttt_loss

SETTINGS = {  # name -> TrainConfig overrides
    "fp32, every row, random batches": dict(autocast=False, loss_rows_only=False, bucket=1),
    "bf16, every row, random batches": dict(autocast=True, loss_rows_only=False, bucket=1),
    "bf16, loss rows, random batches": dict(autocast=True, loss_rows_only=True, bucket=1),
    "bf16, every row, length buckets": dict(autocast=True, loss_rows_only=False, bucket=32),
    "bf16, loss rows, length buckets": dict(autocast=True, loss_rows_only=True, bucket=32),
}
BASELINE = "bf16, every row, random batches"  # today's default where bf16 is native


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", help="default: DATA_DIR/datasets/sharegpt-<fp32 target>")
    ap.add_argument("--paradigm", default="hidden", choices=paradigm_names())
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default="bench/results/train_speed")
    a = ap.parse_args()
    data_dir = resolve_data_dir()
    target = target_dir(data_dir, "float32")
    dataset = Path(a.dataset) if a.dataset else data_dir / "datasets" / f"sharegpt-{target.name}"
    spec = feature_spec(target)
    features = features_for(data_dir, target, dataset, "train", spec)
    lengths = [features.length(i) for i in range(len(features))]
    store = json.loads((features.path / "manifest.json").read_text())

    trainers, orders = {}, {}
    for name, overrides in SETTINGS.items():
        cfg = train_config("full", steps=a.steps + 1, **overrides)
        trainers[name] = Trainer(Path(tempfile.mkdtemp()), drafter_config(
            target, cfg, paradigm=a.paradigm), cfg, target, features)
        orders[name] = [batch_order(lengths, cfg, s) for s in range(a.steps + 1)]

    def step_time(name: str, batch: list[int]) -> tuple[float, int, int]:
        trainer = trainers[name]
        dcfg, cfg = trainer.drafter.cfg, trainer.cfg
        feats, labels, trainable = features.batch(batch, dcfg.kv_layers, dcfg.uses_aux_hidden)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
            loss, _ = ttt_loss(trainer.drafter, feats, labels, trainable, cfg, trainer.t2d)
        loss.backward()
        trainer.opt.step()
        trainer.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start, sum(lengths[i] for i in batch), int(trainable.sum())

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()

    def forward_time(batch: list[int], autocast: bool) -> tuple[float, int, int]:
        n = max(lengths[i] for i in batch)
        ids = torch.zeros(len(batch), n, dtype=torch.long)
        for r, i in enumerate(batch):
            ids[r, : lengths[i]] = features.item(i)["input_ids"].long()
        start = time.perf_counter()
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16,
                                                    enabled=autocast):
            model(ids, output_hidden_states=True, use_cache=True)
        return time.perf_counter() - start, sum(lengths[i] for i in batch), 0

    timed = {**{name: [] for name in SETTINGS}, "target forward fp32": [],
             "target forward bf16 autocast": []}
    for s in range(a.steps + 1):
        measured = {name: step_time(name, orders[name][s]) for name in SETTINGS}
        measured["target forward fp32"] = forward_time(orders[BASELINE][s], False)
        measured["target forward bf16 autocast"] = forward_time(orders[BASELINE][s], True)
        if s > 0:  # the first step warms up
            for name, m in measured.items():
                timed[name].append(m)
        print(f"step {s}: " + ", ".join(f"{k} {v[0]:.2f}s" for k, v in measured.items()),
              flush=True)

    rows = {}
    for name, ms in timed.items():
        seconds = sum(m[0] for m in ms)
        rows[name] = {"seconds": seconds, "tokens_per_s": sum(m[1] for m in ms) / seconds,
                      "loss_tokens_per_s": sum(m[2] for m in ms) / seconds,
                      "steps": [list(m) for m in ms]}
    base = rows[BASELINE]["tokens_per_s"]
    command = f"python bench/train_speed.py {' '.join(sys.argv[1:])}"
    bytes_per_token = store["bytes"] / store["tokens"]
    lines = [f"Command: `{command}`", "",
             f"{a.paradigm} drafter, {len(features)} training sequences of {dataset.name} "
             f"(median length {sorted(lengths)[len(lengths) // 2]}), batch of 4, 7 TTT steps, "
             f"{a.steps} measured steps per setting, interleaved.", "",
             "| setting | tokens/s | loss tokens/s | tokens/s vs today's bf16 |",
             "|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | "
                     f"{r['loss_tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x |"
                     if name in SETTINGS else
                     f"| {name} (features on the fly would add this) | "
                     f"{r['tokens_per_s']:.0f} | - | - |")
    lines += ["", f"Feature store: {bytes_per_token:.0f} bytes per token (bf16: aux hidden "
              f"states of {len(spec.aux_layers)} layers, K/V of {len(spec.kv_layers)}), "
              f"{store['bytes'] / 2**20:.0f} MiB for {store['tokens']} tokens."]
    write_results(a.out, {"command": command, "paradigm": a.paradigm,
                          "dataset": str(dataset), "sequences": len(features),
                          "settings": SETTINGS, "baseline": BASELINE, "rows": rows,
                          "feature_bytes_per_token": bytes_per_token}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
