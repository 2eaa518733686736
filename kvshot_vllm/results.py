"""Results files of the bench scripts: the raw numbers as JSON, the table as Markdown, both
written side by side so that every quoted figure has its source and its command. Both name the
CPU they were measured on, because ratios differ between these machines (AMX or not)."""

from __future__ import annotations

import json
from pathlib import Path

from kvshot_vllm.engine import cpu_info


def machine_line(cpu: dict) -> str:
    return f"Machine: {cpu['model']}, {cpu['cores']} cores, ISA {' '.join(cpu['isa']) or '-'}."


def write_results(out: str | Path, data: dict, lines: list[str]) -> None:
    """`out`.json (data and the machine) and `out`.md (lines and the machine), and the table on
    stdout."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cpu = cpu_info()
    out.with_suffix(".json").write_text(json.dumps({**data, "machine": cpu}, indent=2))
    lines = [*lines, "", machine_line(cpu)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
