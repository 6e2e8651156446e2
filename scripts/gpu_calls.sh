#!/usr/bin/env bash
# The GPU host's work, cut into calls that each fit a 10-minute per-command limit (docs/gpu.md, "On a
# remote runner with per-command limits"). Prepare on a CPU machine, then run each call on the GPU host
# after `bash .gpuwheels/b/install.sh` (or `source /tmp/xstage-gpu-env.sh` on the same machine):
#
#   scripts/gpu_calls.sh prepare          CPU: wheels (.gpuwheels/a, b, x), the K-loop A/B trees (.kc/), DeepGEMM (.dgb/);
#                                         WHEELS_PREPARE / DEEPGEMM_DIR name the bundles' builder and folder,
#                                         DGN_BUNDLE the NVFP4 fork's built package (docs/gpu.md)
#   scripts/gpu_calls.sh precompile       CPU: the ab, ab_w4a8, sweep_w4a8 and ncu calls' fused kernels into .kcache/<call>
#   scripts/gpu_calls.sh suite   OUT      GPU: `tests -m gpu` (kernels compiled by 12 processes, then one process)
#   scripts/gpu_calls.sh ab      OUT      GPU: the full tile's K-loop orders in isolation (wgmma_rate), then the W8A8
#                                         K-loop A/B, main against the trees in .kc/ (P 8 and 1)
#   scripts/gpu_calls.sh ab_w4a8 OUT      GPU: the W4A8 swapped half tiles (.kc/swapped): their GPU tests, then A/B
#   scripts/gpu_calls.sh w4a8    OUT      GPU: the WGMMA-rate variants, then the W4A8 bench with DeepGEMM
#   scripts/gpu_calls.sh nvfp4   OUT      GPU: our W4A8 and W8A8 kernels against the fork's SM90 NVFP4 Mega MoE
#   scripts/gpu_calls.sh ncu     OUT      GPU: our W8A8 kernel and DeepGEMM's two GEMMs under ncu (P 8), side by side
#   scripts/gpu_calls.sh sweep_w4a8 OUT   GPU: issue 42's X-Stage cells, 24 per world (P 1 2 4 8, 2048 / 4096 tokens,
#                                         three routings); SWEEP_FROM=<its sweep_w4a8.json> continues an unfinished one
#
# In the issues' order; each takes up to about 9 minutes, so a 30-minute device session fits three of them.
# carry: suite [.gpuwheels/b .gpuwheels/x .xstage_commit]; ab [.kc/lean .kc/turns .kc/stagger .xstage_commit];
# ab_w4a8 [.kc/swapped .xstage_commit]; w4a8, nvfp4 and ncu [.dgb .xstage_commit]; sweep_w4a8 [.xstage_commit]; with ab,
# ab_w4a8, sweep_w4a8 and ncu also .kcache/<call>
# when precompiled (2 MB each: a carried cache is used, else /tmp/kcache). Each step is bounded (STEP_TIMEOUT
# seconds, default 280) and logs to OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?usage: scripts/gpu_calls.sh prepare|precompile|suite|ab|ab_w4a8|w4a8|nvfp4|sweep_w4a8|ncu [OUT]}
out=${2:-${OUT:-/tmp/gpu_calls}}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: some calls run in another tree
# the GPU calls share compiled kernels; a cache precompiled on a CPU for this call is found (the file names hash the
# compile environment, so the arch is set as on the CPU)
export CUTE_DSL_ARCH=${CUTE_DSL_ARCH:-sm_90a}
if [ -d ".kcache/$cmd" ]; then export XSTAGE_KERNEL_CACHE=${XSTAGE_KERNEL_CACHE:-$PWD/.kcache/$cmd}
else export XSTAGE_KERNEL_CACHE=${XSTAGE_KERNEL_CACHE:-/tmp/kcache}; fi
# the K-loop experiments of docs/moe-core.md section 5 and the W4A8 swapped half tiles of docs/w4a8.md (each
# reverted on main until timed)
AB_TREES=(lean=e11115d turns=ab46bd5 stagger=3e363f6)
W4A8_TREE=swapped=ff668d5
# ncu: the tensor pipe, issue slots and bank conflicts next to the sections' numbers
# (l1tex__data_pipe_lsu_wavefronts_mem_shared reads n/a on driver 580; results/h200/megamoe/ncu_p8)
NCU_METRICS=sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,\
l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,smsp__inst_executed.sum
# issue 42's X-Stage cells: 24 per world
SWEEP_W4A8=(--preset reduced --shapes deepseek-v4-flash --P 1 2 4 8 --tokens 2048 4096 --routing balanced skewed1 skewed2
  --precision w4a8 --worlds loopback loopback+host --no-trace)

ab_trees_args() {  # main and the K-loop experiments' trees as megamoe_ab_trees.py --tree options, into trees[]
  trees=(--tree main=.)
  for spec in "${AB_TREES[@]}"; do trees+=(--tree "${spec%%=*}=.kc/${spec%%=*}"); done
}

nvcc_home() {  # DeepGEMM's JIT compiles with nvcc: the toolkit it belongs to
  dirname "$(dirname "$(readlink -f "$(which nvcc)")")"
}

bounded() {  # NAME CMD...: run CMD with the step timeout, its output in OUT/NAME.log and its tail here
  local name=$1; shift
  timeout "${STEP_TIMEOUT:-280}" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc"; tail -n 15 "$out/$name.log"
  return 0
}

case $cmd in
prepare)
  git rev-parse HEAD > .xstage_commit
  for ignored in /.gpuwheels/ /.kc/ /.dgb/ /.kcache/ /.xstage_commit; do
    grep -qxF "$ignored" .git/info/exclude || echo "$ignored" >> .git/info/exclude
  done
  # WHEELS_PREPARE: the offline wheel bundle's builder (docs/gpu.md); DEEPGEMM_DIR: the DeepGEMM bundle
  if [ ! -d .gpuwheels/b ]; then
    [ -n "${WHEELS_PREPARE:-}" ] && "$WHEELS_PREPARE" .gpuwheels || echo "no .gpuwheels: set WHEELS_PREPARE"
  fi
  [ -d .gpuwheels/x ] || python3 -m pip download -q --no-deps -d .gpuwheels/x pytest-xdist execnet
  for spec in "${AB_TREES[@]}" "$W4A8_TREE"; do
    name=${spec%%=*} commit=${spec#*=}
    if [ -d ".kc/$name" ]; then git -C ".kc/$name" checkout -q --detach "$commit"
    else git worktree add -f ".kc/$name" "$commit" --detach > /dev/null; fi
    git -C ".kc/$name" rev-parse HEAD > ".kc/$name/.xstage_commit"
  done
  if [ -n "${DEEPGEMM_DIR:-}" ]; then mkdir -p .dgb && cp "$DEEPGEMM_DIR"/*.tar.xz .dgb/
  elif [ ! -d .dgb ]; then echo "no .dgb: set DEEPGEMM_DIR"; fi
  if [ -n "${DGN_BUNDLE:-}" ]; then mkdir -p .dgb && cp "$DGN_BUNDLE" .dgb/dgn.tar.xz; fi
  du -sh .gpuwheels/* .kc/* .dgb
  ;;
precompile)
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  ab_trees_args
  XSTAGE_KERNEL_CACHE=$PWD/.kcache/ab python3 scripts/diag/megamoe_ab_trees.py "${trees[@]}" --precision w8a8 \
    --P 8 1 --bits --out "$out/precompile_ab" --compile-only
  for tokens in 256 1024; do
    XSTAGE_KERNEL_CACHE=$PWD/.kcache/ab_w4a8 python3 scripts/diag/megamoe_ab_trees.py --tree main=. \
      --tree "${W4A8_TREE%%=*}=.kc/${W4A8_TREE%%=*}" --precision w4a8 --P 1 --tokens $tokens \
      --out "$out/precompile_ab_w4a8" --compile-only
  done
  XSTAGE_KERNEL_CACHE=$PWD/.kcache/sweep_w4a8 python3 scripts/sweep_megamoe.py "${SWEEP_W4A8[@]}" --compile-only
  XSTAGE_KERNEL_CACHE=$PWD/.kcache/ncu python3 scripts/sweep_megamoe.py --shapes deepseek-v4-flash --P 8 --tokens 8192 \
    --routing balanced --worlds loopback --precision w8a8 --no-trace --compile-only  # the ncu driver's kernels
  du -sh .kcache/*
  ;;
suite)
  [ -d .gpuwheels/x ] && python3 -m pip install -q --no-index --no-deps --target /tmp/xstage-site .gpuwheels/x/*.whl
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  bounded fill python3 -m pytest tests -m gpu -q -n 12 -p no:cacheprovider
  STEP_TIMEOUT=${SUITE_TIMEOUT:-250} bounded suite python3 -m pytest tests -m gpu -q -p no:cacheprovider -p no:xdist
  ;;
ab)
  ab_trees_args
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  # do the two warpgroups lose the tensor pipe by finishing their batches together? (docs/moe-core.md section 5)
  STEP_TIMEOUT=60 bounded kloop_rate python3 scripts/diag/wgmma_rate.py --only "1 fragment" "n192" \
    --out "$out/kloop_rate"
  # --bits: the trees must give main's outputs bit for bit (a small fixed problem), then the timing
  STEP_TIMEOUT=${AB_TIMEOUT:-500} bounded ab python3 scripts/diag/megamoe_ab_trees.py "${trees[@]}" \
    --precision w8a8 --P 8 1 --rounds 2 --bits --out "$out/ab"
  ;;
ab_w4a8)
  tree=.kc/${W4A8_TREE%%=*}
  # correctness first, in the experiment's own tree (its tests pin its layout: kernel_codes, the swapped tiles):
  # the widening, then bitwise W8A8 on W8A8's six cases (the only ones with 17-32-row blocks, the N 32 form: the
  # review of 2026-12-05 counted them), with zero-token experts, and a checkpoint's layout
  (cd "$tree" && export PYTHONPATH=$PWD:${PYTHONPATH:-} && STEP_TIMEOUT=300 bounded ab_w4a8_tests python3 -m pytest \
    -q -x -p no:cacheprovider -m gpu tests/test_megamoe_fp4_widen.py tests/test_megamoe_w4a8_gpu.py \
    -k "widening or bitwise or zero_token or checkpoint")
  if ! grep -qE "[0-9]+ (failed|error)|FAILED" "$out/ab_w4a8_tests.log"; then
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
    for tokens in 256 1024; do  # 6 and 24 rows per expert: every half tile swapped (N 16, N 32)
      STEP_TIMEOUT=120 bounded "ab_w4a8_$tokens" python3 scripts/diag/megamoe_ab_trees.py \
        --tree main=. --tree "${W4A8_TREE%%=*}=$tree" --precision w4a8 --P 1 --tokens $tokens --rounds 2 \
        --out "$out/ab_w4a8_$tokens"
    done
  fi
  ;;
w4a8)
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  STEP_TIMEOUT=100 bounded wgmma_rate python3 scripts/diag/wgmma_rate.py --only widen swapped --out "$out/wgmma_rate"
  # lab.megamoe.deepgemm unpacks the bundle
  export CUDA_HOME=$(nvcc_home) XSTAGE_DEEPGEMM_BUNDLE=$PWD/.dgb
  STEP_TIMEOUT=${BENCH_TIMEOUT:-420} bounded w4a8_bench python3 scripts/bench_megamoe_w4a8.py --out "$out/w4a8"
  ;;
nvfp4)
  # the W4A8 layer's peer (issue 42): its own process, since the fork's package is also named deep_gemm
  [ -f .dgb/dgn.tar.xz ] || { echo "no .dgb/dgn.tar.xz: build it (docs/gpu.md), then prepare with DGN_BUNDLE" >&2; exit 2; }
  mkdir -p /tmp/dgn && tar -xJf .dgb/dgn.tar.xz -C /tmp/dgn
  export CUDA_HOME=$(nvcc_home) DG_JIT_CACHE_DIR=/tmp/dgcache_n
  export PYTHONPATH=/tmp/dgn:$PWD:${PYTHONPATH:-}
  for tokens in 256 1024; do  # the first includes the fork's JIT compile
    STEP_TIMEOUT=270 bounded "nvfp4_$tokens" python3 scripts/bench_megamoe_fork.py --fork nvfp4 --tokens $tokens \
      --trials 5 --out "$out/fork_nvfp4_$tokens"
  done
  ;;
ncu)
  # issue 41: where our W8A8 kernel's tensor pipe idles next to DeepGEMM's (rank 0 of loopback P = 8, 8192 tokens per
  # rank, 1536 rows per expert): issue slots, warp states, bank conflicts (results/h200/megamoe/ncu_p8)
  export PYTHONPATH=$PWD:${PYTHONPATH:-} CUDA_HOME=$(nvcc_home) XSTAGE_DEEPGEMM_BUNDLE=$PWD/.dgb
  sections=(--section SpeedOfLight --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis
    --metrics "$NCU_METRICS")
  driver=(python3 scripts/diag/megamoe_ncu_driver.py --P 8)
  bounded ncu_ours ncu --clock-control none "${sections[@]}" --kernel-name regex:MegaMoESm90 --launch-skip 8 \
    --launch-count 1 --csv --page details "${driver[@]}" --schedule interleaved --option precision=w8a8
  bounded ncu_deepgemm ncu --clock-control none "${sections[@]}" --kernel-name regex:fp8_gemm --launch-skip 16 \
    --launch-count 2 --csv --page details "${driver[@]}" --gemms deepgemm
  python3 scripts/diag/megamoe_ncu_metrics.py "$out/ncu_ours.log" "$out/ncu_deepgemm.log" --out "$out" > /dev/null
  grep -iE "tensor_op|issue|Eligible|bank|Elapsed Cycles" "$out/ncu_metrics.md" | cut -c1-240
  ;;
sweep_w4a8)
  # about 10 s a cell (the rerun of 2026-12-04): 48 cells fit one call; the JSON is written after every cell
  [ -n "${SWEEP_FROM:-}" ] && cp "$SWEEP_FROM" "$out/sweep_w4a8.json"
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
  STEP_TIMEOUT=${SWEEP_TIMEOUT:-540} bounded sweep_w4a8 python3 scripts/sweep_megamoe.py "${SWEEP_W4A8[@]}" \
    --out "$out/sweep_w4a8.json"
  ;;
*)
  echo "unknown call $cmd (prepare | precompile | suite | ab | ab_w4a8 | w4a8 | nvfp4 | sweep_w4a8)" >&2; exit 2
  ;;
esac
