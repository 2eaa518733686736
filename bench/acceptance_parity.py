"""Do the training-side and the vLLM-side drafters agree? Per-position acceptance in vLLM
against the offline prediction for the same drafter, held-out prompts and k.

For each drafter: vLLM (fp32 target, greedy, ignore_eos, max_tokens = the held-out response's
length, so it regenerates exactly the held-out responses) reports its spec-decode counters; the
training-side drafter simulates the same proposals over the cached held-out features
(`diagnostics.simulated_vllm_counters`). Acceptance at position j = accepted at j / drafts.
A gap above 0.03 means the two drafters differ.

    python bench/acceptance_parity.py NAME=CHECKPOINT ... [--k 3] [--out bench/results/acceptance_parity]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvshot_vllm.engine import engine_settings, make_llm, spec_decode_counters
from kvshot_vllm.models.drafter import load_drafter
from kvshot_vllm.paths import resolve_data_dir
from kvshot_vllm.results import write_results
from kvshot_vllm.target import target_dir
from kvshot_vllm.training.diagnostics import simulated_vllm_counters
from kvshot_vllm.training.pipeline import feature_spec, features_for

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def vllm_counters(target: Path, data_dir: Path, ckpt: Path, paradigm: str, k: int,
                  records: list[dict]) -> tuple[dict, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    spec = {"method": "eagle3", "model": str(ckpt), "num_speculative_tokens": k}
    if paradigm != "hidden":
        spec["disable_padded_drafter_batch"] = True
    llm = make_llm(target, data_dir, dtype="float32", max_model_len=1024,
                   speculative_config=spec, disable_log_stats=False)
    try:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in records],
            [SamplingParams(temperature=0, ignore_eos=True,
                            max_tokens=len(r["response_token_ids"])) for r in records],
            use_tqdm=False)
        counters = {**spec_decode_counters(llm), "engine": engine_settings(llm)}
    finally:
        del llm
    differ = sum(list(o.outputs[0].token_ids) != r["response_token_ids"]
                 for o, r in zip(outs, records))
    return counters, differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+", metavar="NAME=CHECKPOINT")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, help="the first N held-out prompts (default all)")
    ap.add_argument("--dataset", help="default: DATA_DIR/datasets/sharegpt-<fp32 target>")
    ap.add_argument("--out", default="bench/results/acceptance_parity")
    a = ap.parse_args()
    data_dir = resolve_data_dir()
    target = target_dir(data_dir, "float32")
    dataset = Path(a.dataset) if a.dataset else data_dir / "datasets" / f"sharegpt-{target.name}"
    features = features_for(data_dir, target, dataset, "heldout", feature_spec(target))
    wanted = set(features.params["ids"])
    records = [json.loads(line) for line in (dataset / "heldout.jsonl").open()]
    records = [r for r in records if r["id"] in wanted][: a.num_prompts]
    features.keep_only({r["id"] for r in records})

    rows, lines = {}, [
        f"Command: `python bench/acceptance_parity.py {' '.join(sys.argv[1:])}`", "",
        f"Held-out prompts: {len(records)}, k = {a.k}, greedy, fp32. Acceptance at position j "
        "= accepted drafts at j / proposals.", "",
        "| drafter | source | proposals | " + " | ".join(f"pos {j}" for j in range(a.k))
        + " | max gap |", "|---|---|---|" + "---|" * (a.k + 1)]
    for spec in a.checkpoints:
        name, _, path = spec.rpartition("=")
        ckpt = Path(path)
        drafter = load_drafter(ckpt, target).eval()
        offline = simulated_vllm_counters(drafter, features, a.k)
        served, differ = vllm_counters(target, data_dir, ckpt, drafter.cfg.paradigm, a.k, records)
        off_rate = [x / offline["num_drafts"] for x in offline["accepted_per_pos"]]
        vllm_rate = [x / served["num_drafts"] for x in served["num_accepted_tokens_per_pos"]]
        gap = max(abs(x - y) for x, y in zip(off_rate, vllm_rate))
        rows[name] = {"checkpoint": str(ckpt), "offline": offline, "vllm": served,
                      "offline_rate": off_rate, "vllm_rate": vllm_rate, "max_gap": gap,
                      "responses_differing": differ}
        for source, n, rate in (("offline", offline["num_drafts"], off_rate),
                                ("vLLM", served["num_drafts"], vllm_rate)):
            lines.append(f"| {name} | {source} | {n} | " + " | ".join(f"{x:.3f}" for x in rate)
                         + (f" | {gap:.3f} |" if source == "vLLM" else " | |"))
        if differ:
            lines.append(f"| {name} | ({differ} vLLM responses differ from the data set) | "
                         + "|" * (a.k + 1))
    write_results(a.out, {"k": a.k, "prompts": len(records), "drafters": rows}, lines)
    return 0 if all(r["max_gap"] <= 0.03 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
