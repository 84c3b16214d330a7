#!/usr/bin/env bash
# The GPU check: one H200 (or any one CUDA GPU), at most 5 minutes, every part time-boxed.
#
#   bash tools/gpu_check.sh              # on the GPU machine, from the repository root, with .whl/ carried along
#   bash tools/gpu_check.sh --dry-run    # anywhere: print the steps and their time limits, run nothing
#
# 1. preflight   nvidia-smi, python3's torch/triton versions, CUDA visible                          (stops on failure)
# 2. wheels      installs .whl/*.whl (tools/fetch_gpu_wheels.sh fills it) into a target folder       (stops on failure)
# 3. imports     k3train, k3kernels and the training entry point import (torchtitan's scheduler optional: reported);
#                the tiny_cpu config validates on CUDA with model.kernels=triton                       (stops on failure)
# 4. tests       tests/kernels on CUDA (their dtypes, plus bf16 against fp32 references and an MoE step in bf16
#                under torch.cuda.set_sync_debug_mode("error")) and tests/unit/test_kernel_backend.py
# 5. bench       tools/bench_kernels.py: per kernel, max error against the fp32 reference and time against PyTorch
# 5b. attention  tools/gpu_check_attention.py: Gated MLA's CUDA chunk kernel (flex_attention, qk 192 / v 128, bf16)
#                against the dense reference: out, lse, max scores, backward; the chunked layer without host syncs
# 5c. compile    tools/gpu_check_compile.py: each layer kind (KDA over documents with model.kernels=triton, Gated MLA,
#                LatentMoE, dense FFN, AttnRes, MTP) under torch.compile(fullgraph=True), inductor, bf16: forward and
#                backward, no graph break, equal to eager within a bf16 bound; KDA's triton choice against torch
# 6. tiny        20 steps of the tiny_cpu recipe with train.device=cuda (fp32)
# 7. layers      tools/gpu_check_layers.py: one k3_full-shaped layer of each kind (dense FFN, LatentMoE with one rank's
#                7 experts at k3_full's rows per expert, KDA on triton, Gated MLA on flex_attention), bf16, inductor:
#                forward+backward time, achieved TFLOP/s of its declared FLOPs against the dense bf16 peak
#                (k3train.plan.gpus: H200 989.4 TFLOP/s) beside the planner's op-class figure for that layer. It
#                replaced a short run of the `small` preset, whose one MFU figure at small widths these per-layer
#                figures at K3's widths, set against the planner's, supersede
# Parts 4-7 (and 5b, 5c) each report PASS, FAIL or TIMEOUT and the script goes on; it exits 1 if any part failed. Logs go to
# $OUT when set, else /tmp/gpu_check; set GPU_CHECK_LOGS to choose.
# The correctness parts (tests, attention, compile, tiny) and an untimed pass of the layers (warm) run side by side,
# each under its own limit: they are mostly compilation, on the machine's cores; the timed parts (bench, layers) then
# run alone, the layers on the kernels and graphs warm compiled into the on-disk caches. The Triton kernels keep one
# configuration each (K3KERNELS_TUNING=one, k3kernels.tuning): tuning would compile nine per kernel and shape, so
# bench and layers time the untuned kernels. GPU_CHECK_SCALE=150 multiplies every limit by 1.5 (a cold machine).
set -uo pipefail

DRY_RUN=0
[[ "${1:-}" == "--dry-run" || "${1:-}" == "-n" ]] && DRY_RUN=1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1
LOGS="${GPU_CHECK_LOGS:-${OUT:-/tmp/gpu_check}}"
WORK="${GPU_CHECK_WORK:-/tmp/gpu_check_work}"
export SITE="$WORK/site"
export PY="${PYTHON:-python3}"
export K3KERNELS_TUNING="${K3KERNELS_TUNING:-one}"
# Time limits in seconds: the side-by-side parts count once, at the longest (wall 295 s, under the 5-minute budget).
T_PREFLIGHT=15 T_WHEELS=20 T_IMPORTS=25 T_TESTS=120 T_ATTN=120 T_COMPILE=120 T_TINY=120 T_WARM=120 T_BENCH=40
T_LAYERS=75
SCALE="${GPU_CHECK_SCALE:-100}"
for t in T_PREFLIGHT T_WHEELS T_IMPORTS T_TESTS T_ATTN T_COMPILE T_TINY T_WARM T_BENCH T_LAYERS; do
  printf -v "$t" '%d' $(( ${!t} * SCALE / 100 ))
done

START=$SECONDS
FAILED=()
SUMMARY=()

say() { printf '\n=== [%3ds] %s\n' "$((SECONDS - START))" "$*"; }
die() { printf '\ngpu_check: FATAL: %s\n' "$*" >&2; exit 2; }

# run_part NAME LIMIT FATAL COMMAND...: runs COMMAND under `timeout`, its output to the screen and $LOGS/NAME.log.
run_part() {
  local name="$1" limit="$2" fatal="$3"; shift 3
  say "$name (limit ${limit}s): $*"
  if (( DRY_RUN )); then SUMMARY+=("$name: (dry run)"); return 0; fi
  rm -f "$WORK/verdict.$name"
  local t0=$SECONDS rc
  if declare -F "$1" >/dev/null; then set -- bash -c "$(declare -f "$1"); $1"; fi  # a function of this script
  if (( ${QUIET_PART:-0} )); then  # a side-by-side part: its log alone, shown once all have ended
    timeout --kill-after=5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
    rc=$?
  else
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
  fi
  local took=$((SECONDS - t0)) verdict=PASS
  if (( rc == 124 || rc == 137 )); then verdict="TIMEOUT after ${limit}s"; elif (( rc != 0 )); then verdict="FAIL (exit $rc)"; fi
  SUMMARY+=("$name: $verdict (${took}s)")
  echo "$name: $verdict (${took}s)" >"$WORK/verdict.$name"
  if [[ "$verdict" != PASS ]]; then
    FAILED+=("$name")
    (( fatal )) && die "$name: $verdict; see $LOGS/$name.log (the parts after it need it)"
  fi
  return 0
}

# side_by_side NAME LIMIT COMMAND...: run_part in the background; `collect` waits for them and gathers verdicts.
SIDE=()
side_by_side() {
  local name="$1"
  say "$name (limit ${2}s, side by side): ${*:3}"
  if (( DRY_RUN )); then SUMMARY+=("$name: (dry run)"); return 0; fi
  QUIET_PART=1 run_part "$1" "$2" 0 "${@:3}" >/dev/null &
  SIDE+=("$name")
}
collect() {
  (( DRY_RUN )) && return 0
  wait
  local name line
  for name in "${SIDE[@]}"; do
    line="$(cat "$WORK/verdict.$name" 2>/dev/null || echo "$name: no verdict")"
    SUMMARY+=("$line")
    [[ "$line" == "$name: PASS"* ]] || FAILED+=("$name")
    say "$line; its log:"
    cat "$LOGS/$name.log" 2>/dev/null | grep -v -e PytestBenchmarkWarning -e 'warner(PytestBenchmarkWarning'
  done
  SIDE=()
}

mkdir -p "$LOGS" "$WORK" || die "cannot create $LOGS or $WORK"
# k3kernels is the kernels/ folder under another name: a link in a folder on PYTHONPATH stands in for the install.
mkdir -p "$WORK/link" && ln -sfn "$REPO/kernels" "$WORK/link/k3kernels"
export PYTHONPATH="$REPO:$WORK/link:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 K3TRAIN_CACHE="$WORK/cache"
unset TRITON_INTERPRET  # the kernels run compiled, on the GPU

# ---- 1. preflight ------------------------------------------------------------------------------------------------
preflight() {
  command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: this is not a GPU machine"; return 1; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || return 1
  "$PY" - <<'EOF'
import sys
import torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
if not torch.cuda.is_available():
    sys.exit("torch does not see a CUDA device")
print(f"device: {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError as e:
    sys.exit(f"triton does not import: {e}")
EOF
}
run_part preflight "$T_PREFLIGHT" 1 preflight

# ---- 2. wheels ---------------------------------------------------------------------------------------------------
wheels() {
  shopt -s nullglob
  local whl=(.whl/*.whl)
  if (( ${#whl[@]} == 0 )); then
    echo "no wheels in .whl/: run tools/fetch_gpu_wheels.sh on a machine with network, then carry .whl"
    return 1
  fi
  printf '  %s\n' "${whl[@]##*/}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${whl[@]}"
}
run_part wheels "$T_WHEELS" 1 wheels

# ---- 3. imports --------------------------------------------------------------------------------------------------
imports() {
  "$PY" - <<'EOF'
import importlib
import sys
for name in ("hydra", "omegaconf", "k3kernels.kda", "k3kernels.situ", "k3kernels.moe_permute",
             "k3train.train.trainer", "k3train.train.cli"):
    try:
        importlib.import_module(name)
    except Exception as e:
        sys.exit(f"import {name} failed: {type(e).__name__}: {e}")
try:  # optional: the trainer falls back to k3train.optim.schedule without it
    importlib.import_module("torchtitan.components.optimizer.lr_scheduler")
    print("torchtitan's scheduler imports")
except Exception as e:
    print(f"torchtitan's scheduler does not import ({type(e).__name__}: {e}); the trainer uses k3train.optim.schedule")
from k3train.config import load_config
cfg = load_config("tiny_cpu", ["train.device=cuda", "model.kernels=triton"])
print("imports ok; tiny_cpu validates on CUDA with model.kernels=triton")
EOF
}
run_part imports "$T_IMPORTS" 1 imports

# ---- 4-6. the correctness parts, side by side ----------------------------------------------------------------------
XDIST=()  # the kernels compile on the CPU: spread the test files over processes where pytest-xdist is there
(( DRY_RUN )) || { "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n 6); }
# 4. kernel tests on CUDA
# -v names each test as it ends (a part stopped at its limit prints no summary); -rfE --tb=short: why each failed
side_by_side tests "$T_TESTS" "$PY" -m pytest -v -rfE --tb=short -p no:cacheprovider "${XDIST[@]}" tests/kernels \
  tests/unit/test_kernel_backend.py
# 5b. Gated MLA's chunk kernel
side_by_side attention "$T_ATTN" "$PY" tools/gpu_check_attention.py
# 5c. compiled layers and the KDA kernel choices
side_by_side compile "$T_COMPILE" "$PY" tools/gpu_check_compile.py
# 6. tiny_cpu on the GPU, 20 steps
COMMON=(train.resume=never train.eval_interval=0 train.checkpoint_interval=0 train.checkpoint_at_end=false
        logging=local logging.progress_bar=false logging.tensorboard=false logging.console_interval=5)
side_by_side tiny "$T_TINY" "$PY" -m k3train.train --config-name tiny_cpu train.device=cuda train.steps=20 \
  "${COMMON[@]}" train.run_dir="$WORK/runs/tiny"
# 7a. the layers once, untimed: compiles their Triton kernels and inductor graphs into the on-disk caches (Triton's,
# inductor's FX graph cache), so part 7 times them with warm caches
side_by_side warm "$T_WARM" "$PY" tools/gpu_check_layers.py --iters 1 --budget $((T_WARM - 7))
collect

# ---- 5. kernel benchmark (alone: it times) -------------------------------------------------------------------------
run_part bench "$T_BENCH" 0 "$PY" tools/bench_kernels.py --json "$LOGS/bench_kernels.json"

# ---- 7. K3-shaped layers: achieved TFLOP/s beside the planner's -----------------------------------------------------
# --profile mla: Gated MLA's top kernels (the first H200 run measured it at a twelfth of its planned rate)
run_part layers "$T_LAYERS" 0 "$PY" tools/gpu_check_layers.py --budget $((T_LAYERS - 7)) --profile mla

# ---- summary -----------------------------------------------------------------------------------------------------
say "summary (${SECONDS}s in all)"
printf '  %s\n' "${SUMMARY[@]}"
if (( ! DRY_RUN )); then
  if [[ -f "$LOGS/tiny.log" ]]; then
    echo "  tiny: $(grep -m1 -o 'kernels [a-z]* (model.kernels=[a-z]*)' "$LOGS/tiny.log"); \
$(grep -m1 -o 'peak [0-9,.]* GFLOP/s' "$LOGS/tiny.log")"
    echo "  tiny last step: $(grep 'tok/s' "$LOGS/tiny.log" | tail -1)"
  fi
  [[ -f "$LOGS/layers.log" ]] && sed -n '/^layer /,/^gpu_check_layers:/p' "$LOGS/layers.log" | sed 's/^/  /'
fi
if (( ${#FAILED[@]} )); then
  echo "gpu_check: FAILED: ${FAILED[*]} (logs in $LOGS)"
  exit 1
fi
echo "gpu_check: all parts passed (logs in $LOGS)"
