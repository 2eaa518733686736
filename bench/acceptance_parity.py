"""Do the training-side and the vLLM-side drafters agree? Per-position acceptance in vLLM
against the offline prediction for the same drafter, held-out prompts and k.

Both sides score the same text: vLLM first regenerates the held-out responses without
speculation (fp32 target, greedy, ignore_eos, max_tokens = the held-out response's length), and
the features of that text (fp32) are what the training-side drafter simulates vLLM's proposals
over (`diagnostics.simulated_vllm_counters`). The data set's own responses, made by another
engine or dtype, would differ from it wherever a near-tie flips. Then each drafter is served
on the same prompts and reports its spec-decode counters; its responses must equal the
reference (greedy speculation is lossless; the count of those that do not is reported, fp32
near-ties can flip with the batch's shape). Acceptance at position j = accepted at j / drafts.
A gap above 0.03 means the two drafters differ.

    python bench/acceptance_parity.py NAME=CHECKPOINT ... [--k 3] [--out bench/results/acceptance_parity]
"""

from __future__ import annotations

import argparse
import hashlib
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


def greedy_responses(target: Path, data_dir: Path, records: list[dict],
                     speculative_config: dict | None = None) -> tuple[list[list[int]], dict]:
    """Each record's prompt continued greedily by an fp32 engine for as many tokens as its
    response has, and the engine's spec-decode counters and settings."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = make_llm(target, data_dir, dtype="float32", max_model_len=1024,
                   speculative_config=speculative_config, disable_log_stats=False)
    try:
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in records],
            [SamplingParams(temperature=0, ignore_eos=True,
                            max_tokens=len(r["response_token_ids"])) for r in records],
            use_tqdm=False)
        counters = {**(spec_decode_counters(llm) if speculative_config else {}),
                    "engine": engine_settings(llm)}
    finally:
        del llm
    return [list(o.outputs[0].token_ids) for o in outs], counters


def reference_dataset(data_dir: Path, dataset: Path, records: list[dict],
                      responses: list[list[int]]) -> Path:
    """A held-out split of `records` with vLLM's `responses`, named by a digest of its tokens
    so that features cached for other text are never reused."""
    rows = [{"id": r["id"], "prompt_token_ids": r["prompt_token_ids"],
             "response_token_ids": resp} for r, resp in zip(records, responses)]
    text = "".join(json.dumps(row) + "\n" for row in rows)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    out = data_dir / "datasets" / f"{dataset.name}-vllm-fp32-{digest}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout.jsonl").write_text(text)
    return out


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
    records = [json.loads(line) for line in (dataset / "heldout.jsonl").open()]
    records = [r for r in records if len(r["response_token_ids"]) >= 2][: a.num_prompts]
    reference, _ = greedy_responses(target, data_dir, records)
    features = features_for(data_dir, target,
                            reference_dataset(data_dir, dataset, records, reference),
                            "heldout", feature_spec(target))
    kept = set(features.params["ids"])
    records, reference = zip(*[(r, resp) for r, resp in zip(records, reference)
                               if r["id"] in kept])
    differ_from_data = sum(resp != r["response_token_ids"] for r, resp in zip(records, reference))

    rows, lines = {}, [
        f"Command: `python bench/acceptance_parity.py {' '.join(sys.argv[1:])}`", "",
        f"Held-out prompts: {len(records)} of {dataset}, k = {a.k}, greedy, fp32. Both sides "
        f"score vLLM's own greedy text ({differ_from_data} of its responses differ from the data "
        "set's). Acceptance at position j = accepted drafts at j / proposals.", "",
        "| drafter | source | proposals | " + " | ".join(f"pos {j}" for j in range(a.k))
        + " | max gap |", "|---|---|---|" + "---|" * (a.k + 1)]
    for spec in a.checkpoints:
        name, _, path = spec.rpartition("=")
        ckpt = Path(path)
        drafter = load_drafter(ckpt, target).eval()
        offline = simulated_vllm_counters(drafter, features, a.k)
        spec = {"method": "eagle3", "model": str(ckpt), "num_speculative_tokens": a.k}
        if drafter.cfg.paradigm != "hidden":
            spec["disable_padded_drafter_batch"] = True
        responses, served = greedy_responses(target, data_dir, list(records), spec)
        differ = sum(x != y for x, y in zip(responses, reference))
        off_rate = [x / offline["num_drafts"] for x in offline["accepted_per_pos"]]
        vllm_rate = [x / served["num_drafts"] for x in served["num_accepted_tokens_per_pos"]]
        gap = max(abs(x - y) for x, y in zip(off_rate, vllm_rate))
        rows[name] = {"checkpoint": str(ckpt), "offline": offline, "vllm": served,
                      "offline_rate": off_rate, "vllm_rate": vllm_rate, "max_gap": gap,
                      "responses_differing_from_no_speculation": differ}
        for source, n, rate in (("offline", offline["num_drafts"], off_rate),
                                ("vLLM", served["num_drafts"], vllm_rate)):
            lines.append(f"| {name} | {source} | {n} | " + " | ".join(f"{x:.3f}" for x in rate)
                         + (f" | {gap:.3f} |" if source == "vLLM" else " | |"))
        if differ:
            lines.append(f"| {name} | ({differ} responses differ from no speculation's) | "
                         + "|" * (a.k + 1))
    write_results(a.out, {"k": a.k, "prompts": len(records),
                          "responses_differing_from_data_set": differ_from_data,
                          "drafters": rows}, lines)
    return 0 if all(r["max_gap"] <= 0.03 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
