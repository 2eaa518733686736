"""How well does the harness's prompt sample stand for the held-out split? vLLM's acceptance
length as simulated offline (`diagnostics.simulated_vllm_counters`, which
`bench/acceptance_parity.py` holds to vLLM's counters) over four samples of the held-out split:
the first N prompts (what `kvshot bench --requests N` sends at c = 1) or all of them, each cut to
M generated tokens (`--max-output-tokens M`) or whole.

    python bench/served_sample.py NAME=CHECKPOINT ... --dataset DIR [--k 3] [--num-prompts 16]
        [--max-output-tokens 128] [--forward-dtype bfloat16] [--out bench/results/served_sample]

The held-out features are those `kvshot diagnose` reads (extracted when missing). Nothing is
timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvshot_vllm.data import read_records
from kvshot_vllm.models.drafter import load_drafter
from kvshot_vllm.paths import resolve_data_dir
from kvshot_vllm.results import write_results
from kvshot_vllm.target import target_dir
from kvshot_vllm.training.diagnostics import (acceptance_length, counters, proposal_hits,
                                              served_proposals)
from kvshot_vllm.training.pipeline import feature_spec, features_for, sequence_limit


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+", metavar="NAME=CHECKPOINT")
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-output-tokens", type=int, default=128)
    ap.add_argument("--forward-dtype", default="bfloat16",
                    help="the features' forward dtype, as `kvshot diagnose --forward-dtype`")
    ap.add_argument("--out", default="bench/results/served_sample")
    a = ap.parse_args()
    data_dir, dataset = resolve_data_dir(), Path(a.dataset)
    target = target_dir(data_dir, "float32")
    features = features_for(data_dir, target, dataset, "heldout",
                            feature_spec(target, max_len=sequence_limit(dataset),
                                         forward_dtype=a.forward_dtype))
    # the harness's first N prompts: the first N held-out records with a response
    sent = [r["id"] for r in read_records(dataset / "heldout.jsonl")
            if r["response_token_ids"]][:a.num_prompts]
    position = {sid: i for i, sid in enumerate(features.params["ids"])}
    first = {position[sid] for sid in sent if sid in position}
    samples = {f"first {a.num_prompts}, {a.max_output_tokens} tokens": (first, a.max_output_tokens),
               f"first {a.num_prompts}, whole responses": (first, None),
               f"all {len(features)}, {a.max_output_tokens} tokens": (None, a.max_output_tokens),
               f"all {len(features)}, whole responses": (None, None)}

    rows: dict[str, dict] = {}
    for spec in a.checkpoints:
        name, _, path = spec.rpartition("=")
        drafter = load_drafter(Path(path), target).eval()
        proposals: dict[str, list[int]] = {sample: [] for sample in samples}
        for i, hits in proposal_hits(drafter, features, a.k):
            prompt, length = features.prompt_length(i), features.length(i)
            for sample, (only, max_new) in samples.items():
                if only is None or i in only:
                    end = length if max_new is None else min(length, prompt + max_new)
                    proposals[sample] += served_proposals(hits, prompt, end)
        rows[name or path] = {"checkpoint": path, "samples": {
            sample: counters(p, a.k) for sample, p in proposals.items()}}

    command = f"python bench/served_sample.py {' '.join(sys.argv[1:])}"
    lines = [f"Command: `{command}`", "",
             f"{dataset.name}, held-out split, k = {a.k}: vLLM's acceptance length (1 + accepted "
             "drafts / proposals) simulated for greedy generation of each sample's responses.",
             "", "| drafter | " + " | ".join(samples) + " |", "|" + "---|" * (len(samples) + 1)]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{acceptance_length(c):.3f} ({c['num_drafts']} proposals)"
            for c in row["samples"].values()) + " |")
    write_results(a.out, {"command": command, "dataset": str(dataset), "k": a.k,
                          "num_prompts": a.num_prompts,
                          "max_output_tokens": a.max_output_tokens, "drafters": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
