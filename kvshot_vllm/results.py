"""Results files of the bench scripts: the raw numbers as JSON, the table as Markdown, both
written side by side so that every quoted figure has its source and its command."""

from __future__ import annotations

import json
from pathlib import Path


def write_results(out: str | Path, data: dict, lines: list[str]) -> None:
    """`out`.json (data) and `out`.md (lines), and the table on stdout."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
