# MegaMoE fused kernel vs grouped GEMMs and the unfused pipeline, both schedules (issue 5), at
# the default MegaMoEConfig (128x256 tiles, Dispatch overlapped, 4 ring stages + LSU Dispatch at
# P = 1 / 3 stages + bulk Dispatch at P = 8 on DeepSeek-V4-Flash), with the baselines, the
# clock-matched paired verdict (0.25 s cooldown before each timed call) and a per-tile trace.
source "$(dirname "$0")/../_env.sh"
"$PY" scripts/bench_megamoe.py --P 1 8 --tokens 8192 --trace --cooldown-s 0.25 --out "$XSTAGE_RESULTS/megamoe"
# The same paired comparison under sustained load: trials back to back (no cooldown), each
# fused trial a MegaMoE.rerun() so the GPU idles before it no longer than before the GEMMs.
"$PY" scripts/bench_megamoe.py --P 1 8 --tokens 8192 --paired-only --paired-trials 15 --cooldown-s 0 \
  --fused-call rerun --tag _sustained --out "$XSTAGE_RESULTS/megamoe"
# Host-side cost of MegaMoE.forward around the kernels (phases + torch.profiler tables).
"$PY" scripts/diag/profile_megamoe_api.py --P 1 --tokens 8192 --out "$XSTAGE_RESULTS/megamoe"
