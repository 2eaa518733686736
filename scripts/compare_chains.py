"""Is a refactor behaviour-free? The training-side draft chains (what `kvshot diagnose`, the
learning curve and training compute) of real drafters on real held-out sequences, saved from one
checkout and compared bit for bit with another's.

    cd OLD_CHECKOUT && python /path/to/scripts/compare_chains.py save old.pt DRAFTER...
    cd NEW_CHECKOUT && python scripts/compare_chains.py save new.pt DRAFTER...
    python scripts/compare_chains.py compare old.pt new.pt

DRAFTER is NAME=CHECKPOINT; the code under test is the `kvshot_vllm` that the current directory
imports. Target: DATA_DIR's float32 SmolLM2; sequences: the first held-out records of
`--dataset` (default DATA_DIR/datasets/sharegpt-2k-2turns), cut to 400 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))  # the checkout under test, not this file's


def save(out: Path, drafters: dict[str, Path], dataset: Path, records: int, steps: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from kvshot_vllm.models.drafter import TargetFeatures, load_drafter
    from kvshot_vllm.paths import resolve_data_dir
    from kvshot_vllm.target import target_dir
    from kvshot_vllm.training.features import FeatureSpec, target_forward

    target = target_dir(resolve_data_dir(), "float32")
    lines = (dataset / "heldout.jsonl").read_text().splitlines()[:records]
    sequences = [(r["prompt_token_ids"] + r["response_token_ids"])[:400]
                 for r in map(json.loads, lines)]
    model = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    chains = {}
    with torch.no_grad():
        for name, ckpt in drafters.items():
            drafter = load_drafter(ckpt, target).eval()
            cfg = drafter.cfg
            spec = FeatureSpec(aux_layers=tuple(cfg.aux_layers), kv_layers=tuple(cfg.kv_layers),
                               max_len=1024, dtype="float32")
            for i, ids in enumerate(sequences):
                f, n = target_forward(model, ids, spec), len(ids)
                kv = {layer: (f[f"k.{layer}"][:n].transpose(0, 1)[None],
                              f[f"v.{layer}"][:n].transpose(0, 1)[None])
                      for layer in cfg.kv_layers}
                feats = TargetFeatures(torch.tensor([ids]), f["aux"][None, :n], kv)
                chains[f"{name}.{i}"] = torch.stack(
                    [drafter.lm_head(x[0]) for x in drafter.chain(feats, steps)])
    torch.save(chains, out)
    print(f"{out}: {len(chains)} chains of {steps} steps")


def compare(a: Path, b: Path) -> bool:
    import torch

    old, new = torch.load(a), torch.load(b)
    same = sorted(old) == sorted(new) and all(torch.equal(old[k], new[k]) for k in old)
    diff = [k for k in old if k in new and not torch.equal(old[k], new[k])]
    print(f"{len(old)} chains: {'bit-identical' if same else f'differ: {diff or sorted(set(old) ^ set(new))}'}")
    return same


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save")
    s.add_argument("out", type=Path)
    s.add_argument("drafters", nargs="+", help="NAME=CHECKPOINT")
    s.add_argument("--dataset", type=Path)
    s.add_argument("--records", type=int, default=3)
    s.add_argument("--steps", type=int, default=7)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    a = ap.parse_args()
    if a.cmd == "compare":
        sys.exit(0 if compare(a.a, a.b) else 1)
    from kvshot_vllm.paths import resolve_data_dir

    dataset = a.dataset or resolve_data_dir() / "datasets" / "sharegpt-2k-2turns"
    save(a.out, {n: Path(p) for n, p in (d.split("=", 1) for d in a.drafters)}, dataset,
         a.records, a.steps)


if __name__ == "__main__":
    main()
