"""Where kvshot keeps what it builds: the converted target, data sets, features, checkpoints.

Resolution order: an explicit `--data-dir` flag, then `$KVSHOT_DATA_DIR`, then `data/` at the
root of the source checkout (git-ignored), or `./kvshot-data` for a non-editable install.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvshot_vllm.errors import KVShotError

DATA_DIR_ENV = "KVSHOT_DATA_DIR"
REPO_ROOT = Path(__file__).resolve().parents[1]


def default_data_dir() -> Path:
    if (REPO_ROOT / "pyproject.toml").is_file():
        return REPO_ROOT / "data"
    return Path.cwd() / "kvshot-data"


def resolve_data_dir(flag: str | os.PathLike | None = None) -> Path:
    """The data directory, created if needed; a clear error if it cannot be written."""
    raw = flag or os.environ.get(DATA_DIR_ENV)
    path = Path(raw).expanduser() if raw else default_data_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".kvshot-write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise KVShotError(f"data directory {path} is not writable ({exc.strerror or exc})") from None
    return path

