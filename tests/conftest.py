"""Shared fixtures: the real embedded target (converted once per data dir and reused), its data
directory, and a helper to run the `kvshot` CLI as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvshot_vllm.engine import EAGER_ENV, configure_vllm_env
from kvshot_vllm.paths import resolve_data_dir
from kvshot_vllm.target import prepare_target

KVSHOT = [sys.executable, "-m", "kvshot_vllm.cli"]

# Engines start eager here unless a test asks for vLLM's compiled path (enforce_eager=False):
# compiling costs about a minute per engine start on 2 cores (tests/test_plugin.py
# test_lossless_compiled serves the compiled path).
os.environ.setdefault(EAGER_ENV, "1")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = resolve_data_dir()
    configure_vllm_env(path)
    return path


@pytest.fixture(scope="session")
def target_fp32(data_dir: Path) -> Path:
    return prepare_target(data_dir, dtype="float32")[0]


@pytest.fixture(scope="session")
def target_bf16(data_dir: Path) -> Path:
    return prepare_target(data_dir, dtype="bfloat16")[0]


def run_kvshot(*args: str, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*KVSHOT, *args], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **kwargs.pop("env", {})}, **kwargs,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    """A user error: exit code 2, one line on stderr that says what is wrong, no traceback."""
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    last = err.splitlines()[-1]
    assert last.startswith("kvshot: error:") and needle in last, last
