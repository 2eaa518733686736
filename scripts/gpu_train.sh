#!/usr/bin/env bash
# Data at scale and drafter training on one GPU machine that has PyTorch and transformers but no
# vLLM and no network (the lent H200 of /work/.library/device), from the bundle of
# scripts/gpu_bundle.py. What it writes comes back through $OUT (files of at most 16 MB).
#
#   scripts/gpu_train.sh stash                 check and keep the .device/ files this call carried
#   scripts/gpu_train.sh data                  target from the GGUF, then the regenerated data set
#   scripts/gpu_train.sh train NAME...         train drafters side by side on the GPU, ship each
#   scripts/gpu_train.sh out NAME...           the shipped drafters, curves, data manifest -> $OUT
#
# Every stage is resumable: the data set and the runs continue where a killed call stopped.
# Sizes come from the environment (defaults: the run that made the shipped drafters):
#   NUM_PROMPTS (5120) training conversations, 2 user turns each (the bundle's 10,000
#   conversations hold 5,295 that fit the prompt budget); STEPS (per drafter, below);
#   NUM_HELDOUT (100); BATCH (32) sequences per step; LR (2e-3); TRAIN_BUDGET_S (none: seconds
#   a training call may take before its runs save and stop); DEVICE (cuda; cpu: a dry run).
#
# One lease is 15 minutes of device time, a call at most 10, and the machine goes back after
# 30 s idle, taking everything with it. So: every call back to back, prepared beforehand, each
# well inside its timeout (docs/training-at-scale.md, "Training on a lent GPU", has the calls and what they took).
set -euo pipefail
cd "$(dirname "$0")/.."

WORK=${KVSHOT_GPU_WORK:-/tmp/kvshot-gpu}
STASH=$WORK/stash
export KVSHOT_DATA_DIR=$WORK/data
export PYTHONPATH=$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
KVSHOT="$PY -m kvshot_vllm.cli"
TARGET=$KVSHOT_DATA_DIR/targets/SmolLM2-135M-Instruct-bfloat16
NUM_PROMPTS=${NUM_PROMPTS:-5120}
DATA=$KVSHOT_DATA_DIR/datasets/sharegpt-gpu-$NUM_PROMPTS-2turns
RUNS=$KVSHOT_DATA_DIR/runs
BATCH=${BATCH:-32}
LR=${LR:-2e-3}
DEVICE=${DEVICE:-cuda}

# name -> drafter options; hybrid warm-starts from hidden's checkpoint (trained first)
declare -A OPTIONS=(
  [hidden]="--paradigm hidden"
  [kv]="--paradigm kv --num-layers 1"
  [block]="--paradigm block"
  [hybrid]="--paradigm hybrid --init $RUNS/hidden/checkpoint"
)
declare -A STEPS_OF=([hidden]=${STEPS_HIDDEN:-${STEPS:-600}} [kv]=${STEPS_KV:-${STEPS:-600}}
                     [block]=${STEPS_BLOCK:-${STEPS:-600}} [hybrid]=${STEPS_HYBRID:-${STEPS:-300}})

stage=${1:?stage: stash, data, train or out}; shift

case $stage in
stash)
  mkdir -p "$STASH"
  (cd .device && grep -F -f <(ls -1 gguf.part* sharegpt-*.json.gz wheels/*.whl 2>/dev/null) \
      SHA256SUMS | sha256sum -c --quiet -)
  cp -r .device/. "$STASH/"
  if ls "$STASH"/wheels/*.whl >/dev/null 2>&1 && [ ! -d "$WORK/site" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" \
      "$STASH"/wheels/*.whl
  fi
  ls "$STASH"
  ;;
data)
  if [ ! -f "$TARGET/config.json" ]; then
    n=$(ls "$STASH"/gguf.part* | wc -l)
    (cd "$STASH" && grep -F gguf.part SHA256SUMS | sha256sum -c --quiet -)
    cat $(for i in $(seq 0 $((n - 1))); do echo "$STASH/gguf.part$i"; done) \
      > "$WORK/SmolLM2-135M-Instruct.Q4_1.gguf"
    $KVSHOT target prepare --dtype bfloat16 --gguf "$WORK/SmolLM2-135M-Instruct.Q4_1.gguf" \
      --no-check
  fi
  zcat "$STASH/sharegpt-2turns.json.gz" > "$WORK/sharegpt-2turns.json"
  $KVSHOT data prepare --engine transformers --target "$TARGET" \
    --sharegpt "$WORK/sharegpt-2turns.json" --num-prompts "$NUM_PROMPTS" \
    --num-heldout "${NUM_HELDOUT:-100}" --max-turns 2 --max-prompt-tokens 768 --max-new-tokens 256 \
    --chunk-size "${CHUNK:-768}" --out "$DATA"
  ;;
train)
  names=("$@") pids=()
  for name in "${names[@]}"; do
    steps=${STEPS_OF[$name]}
    mkdir -p "$RUNS/$name"
    # TRAIN_BUDGET_S: stopped by SIGTERM, a run saves its state; `train` again continues it.
    ${TRAIN_BUDGET_S:+timeout -s TERM "$TRAIN_BUDGET_S"} $KVSHOT train ${OPTIONS[$name]} --target "$TARGET" --dataset "$DATA" --device "$DEVICE" \
      --features live --forward-dtype bfloat16 --preset full --steps "$steps" \
      --batch-size "$BATCH" --lr "$LR" --snapshot-every $(( (steps + 3) / 4 )) \
      --checkpoint-every 50 --out "$RUNS/$name" > "$RUNS/$name/train.log" 2>&1 &
    pids+=($!)
  done
  status=0
  for i in "${!pids[@]}"; do
    name=${names[$i]}
    if wait "${pids[$i]}"; then
      tail -1 "$RUNS/$name/metrics.jsonl"
      $KVSHOT ship "$RUNS/$name" --name "$name" --out "$WORK/ship/$name" || status=1
    else
      status=1
      echo "== $name failed:"; tail -c 3000 "$RUNS/$name/train.log" | tr '\r' '\n' | tail -8
    fi
  done
  exit $status
  ;;
out)
  : "${OUT:?OUT is where the files go back}"
  mkdir -p "$WORK/pack"
  for name in "$@"; do
    cp "$RUNS/$name/metrics.jsonl" "$WORK/ship/$name/metrics.jsonl"
    $KVSHOT curve "$RUNS/$name" --device "$DEVICE" --out "$WORK/ship/$name/curve" \
      > "$RUNS/$name/curve.log" 2>&1 || tail -3 "$RUNS/$name/curve.log"
  done
  cp "$DATA/manifest.json" "$DATA/engine.json" "$WORK/ship/" 2>/dev/null || true
  gzip -c "$DATA/heldout.jsonl" > "$WORK/ship/heldout.jsonl.gz"
  tar -C "$WORK/ship" -cf "$WORK/pack/out.tar" "$@" manifest.json engine.json heldout.jsonl.gz
  (cd "$WORK/pack" && rm -f out.tar.part* && split -b 15M -d out.tar out.tar.part)
  cp "$WORK/pack"/out.tar.part* "$OUT/"
  ls -la "$OUT"
  ;;
*)
  echo "unknown stage $stage" >&2; exit 2 ;;
esac
