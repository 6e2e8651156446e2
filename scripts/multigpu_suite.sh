#!/usr/bin/env bash
# Multi-GPU suite (issue 6): topology, peer calibration, fa4_a2a Table-3 sweep, MegaMoE
# expert-parallel comparison and multi-process correctness, one process per GPU (torchrun),
# NVLink multicast disabled. MOE_PRECISIONS (default "bf16 w8a8 w4a8") picks the MegaMoE precisions
# of steps 3 and 4. Every step's commands are each bounded by $STEP_TIMEOUT seconds
# (default 590) and write under results/h200xN/ (N = GPU count); a markdown report per step.
#
#   scripts/multigpu_suite.sh [--steps 0,1,2,3,4] [--dry-run] [--quick] [--gpus N] [--out DIR]
#   scripts/multigpu_suite.sh --loopback [--P 4] [--steps ...] [--dry-run] [--full]
#
#   --steps     comma-separated subset of 0 (topology/env), 1 (peer calibration), 2 (fa4_a2a
#               sweep), 3 (megamoe), 4 (correctness); default all
#   --dry-run   print the exact commands, run nothing
#   --quick     smaller grids in every step (smoke test)
#   --gpus N    GPUs to use (default: all that nvidia-smi lists)
#   --loopback  single-GPU dry run: the same entry points in the loopback world, P simulated
#               ranks in one process (default P=4, implies --quick unless --full)
#   --out DIR   results directory (default results/h200xN, or results/h200x1-loopback-P<P>)
#   --tar FILE  at the end (also after failures) pack the results directory into FILE (.tgz),
#               e.g. --tar "$OUT/h200x8-steps04.tgz" to bring it back through the device tool
#
# Entry points: lab modules run with -m (lab.multigpu_envcheck, lab.calibration.peer,
# lab.fa4_a2a.multigpu_sweep, lab.megamoe.multigpu_ep) and scripts/multigpu/{correctness,report}.py,
# with the repository on PYTHONPATH. See docs/multigpu.md and results/README-multigpu.md.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"

steps="0,1,2,3,4"; dry=0; quick=0; full=0; loopback=0; P=4; gpus=""; out=""; tarfile=""
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) steps="${2:?--steps needs a value}"; shift 2 ;;
    --steps=*) steps="${1#*=}"; shift ;;
    --dry-run) dry=1; shift ;;
    --quick) quick=1; shift ;;
    --full) full=1; shift ;;
    --loopback) loopback=1; shift ;;
    --P) P="${2:?--P needs a value}"; shift 2 ;;
    --gpus) gpus="${2:?--gpus needs a value}"; shift 2 ;;
    --out) out="${2:?--out needs a value}"; shift 2 ;;
    --tar) tarfile="${2:?--tar needs a value}"; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "multigpu_suite: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done

# Validate the step list before anything runs.
IFS=',' read -r -a step_list <<< "$steps"
for s in "${step_list[@]}"; do
  case "$s" in 0|1|2|3|4) ;; *) echo "multigpu_suite: bad step '$s' (choose from 0,1,2,3,4)" >&2; exit 2 ;; esac
done
case "$P" in ''|*[!0-9]*) echo "multigpu_suite: --P must be a positive integer, got '$P'" >&2; exit 2 ;; esac
[ "$P" -ge 1 ] || { echo "multigpu_suite: --P must be >= 1" >&2; exit 2; }

# NVLink multicast stays off in every run (issue 6).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUTE_DSL_ARCH=${CUTE_DSL_ARCH:-sm_90a} FLASH_ATTENTION_ARCH=${FLASH_ATTENTION_ARCH:-sm_90}
export PYTHONUNBUFFERED=1
STEP_TIMEOUT=${STEP_TIMEOUT:-590}
# MegaMoE precisions of steps 3 and 4 (each a --precision of lab.megamoe.multigpu_ep / multigpu_checks)
read -r -a moe_precisions <<< "${MOE_PRECISIONS:-bf16 w8a8 w4a8}"

# Python: the GPU host's offline bundle (docs/gpu.md) or the local venv.
if [ -f /tmp/xstage-gpu-env.sh ]; then
  # shellcheck disable=SC1091
  source /tmp/xstage-gpu-env.sh
  PY=python3
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY="$ROOT/.venv/bin/python"
else
  PY=python3
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

# GPU count.
if [ -z "$gpus" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
  fi
  gpus=${gpus:-0}
  if [ "$dry" = 1 ] && [ "$gpus" = 0 ]; then gpus=8; fi   # dry run on a machine without GPUs
fi
case "$gpus" in ''|*[!0-9]*) echo "multigpu_suite: --gpus must be an integer, got '$gpus'" >&2; exit 2 ;; esac

if [ "$loopback" = 1 ]; then
  world=(--world loopback --P "$P")
  launch=("$PY")
  [ "$full" = 1 ] || quick=1
  out=${out:-results/h200x1-loopback-P$P}
  if [ "$dry" = 0 ] && [ "$gpus" -lt 1 ]; then
    echo "multigpu_suite: --loopback needs one CUDA GPU (nvidia-smi lists none)" >&2; exit 2
  fi
else
  if [ "$dry" = 0 ] && [ "$gpus" -lt 2 ]; then
    echo "multigpu_suite: needs >= 2 GPUs (found $gpus); use --loopback for the single-GPU dry run" >&2; exit 2
  fi
  world=(--world torch-symm --P "$gpus")
  launch=("$PY" -m torch.distributed.run --standalone --nproc-per-node="$gpus")
  out=${out:-results/h200x$gpus}
fi
q=(); [ "$quick" = 1 ] && q=(--quick)

failed=()
run() {  # run NAME CMD...: print, then (unless dry run) execute with a time bound and a log
  local name=$1; shift
  printf '+'; printf ' %q' "$@"; printf '\n'
  [ "$dry" = 1 ] && return 0
  mkdir -p "$out/logs"
  timeout --kill-after=20 "$STEP_TIMEOUT" "$@" 2>&1 | tee "$out/logs/$name.log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ]; then
    echo "multigpu_suite: $name failed (exit $rc; 124 = over ${STEP_TIMEOUT}s)" >&2
    failed+=("$name:$rc")
  fi
  return 0
}
shell_to() {  # shell_to FILE CMD...: capture a command's output into a file (printed in a dry run)
  local file=$1; shift
  printf '+'; printf ' %q' "$@"; printf ' > %q\n' "$file"
  [ "$dry" = 1 ] && return 0
  mkdir -p "$(dirname "$file")"
  "$@" > "$file" 2>&1 || echo "(exit $?)" >> "$file"
}
report() { run "report-$1" "$PY" scripts/multigpu/report.py --dir "$out" --steps "$1"; }

echo "# multigpu_suite: out=$out gpus=$gpus loopback=$loopback P=$P quick=$quick steps=$steps"
echo "# export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
[ "$dry" = 1 ] || mkdir -p "$out"

for s in "${step_list[@]}"; do
  case "$s" in
    0)
      shell_to "$out/topology/topo.txt" nvidia-smi topo -m
      shell_to "$out/topology/clocks.txt" nvidia-smi -q -d CLOCK
      shell_to "$out/topology/nvlink.txt" nvidia-smi nvlink --status
      run step0-envcheck "${launch[@]}" -m lab.multigpu_envcheck "${world[@]}" --out "$out/topology"
      report topology ;;
    1)
      run step1-calibration "${launch[@]}" -m lab.calibration.peer "${world[@]}" "${q[@]}" \
        --no-progress --out "$out/calibration"
      report calibration ;;
    2)
      prof=(); pj="$out/calibration/profile-h200-nvlink-peer.json"
      [ -f "$pj" ] && prof=(--profile "$pj")
      run step2-fa4_a2a "${launch[@]}" -m lab.fa4_a2a.multigpu_sweep "${world[@]}" "${q[@]}" "${prof[@]}" \
        --out "$out/fa4_a2a"
      report fa4_a2a ;;
    3)
      run step3-megamoe "${launch[@]}" -m lab.megamoe.multigpu_ep "${world[@]}" "${q[@]}" \
        --precision "${moe_precisions[@]}" --out "$out/megamoe"
      report megamoe ;;
    4)
      run step4-correctness-fa4 "${launch[@]}" scripts/multigpu/correctness.py "${world[@]}" "${q[@]}" \
        --kernels fa4 --stem correctness-fa4 --out "$out/correctness"
      run step4-correctness-megamoe "${launch[@]}" scripts/multigpu/correctness.py "${world[@]}" "${q[@]}" \
        --kernels megamoe --precision "${moe_precisions[@]}" --stem correctness-megamoe --out "$out/correctness"
      report correctness ;;
  esac
done
run report-all "$PY" scripts/multigpu/report.py --dir "$out"
if [ -n "$tarfile" ]; then
  printf '+ tar czf %q -C %q %q\n' "$tarfile" "$(dirname "$out")" "$(basename "$out")"
  [ "$dry" = 1 ] || tar czf "$tarfile" -C "$(dirname "$out")" "$(basename "$out")" \
    || { echo "multigpu_suite: tar failed" >&2; failed+=("tar"); }
fi

if [ "${#failed[@]}" -gt 0 ]; then
  echo "multigpu_suite: FAILED: ${failed[*]} (logs in $out/logs)" >&2
  exit 1
fi
[ "$dry" = 1 ] || echo "multigpu_suite: done; results and report.md in $out"
