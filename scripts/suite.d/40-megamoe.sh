# MegaMoE fused kernel vs grouped GEMMs and the unfused pipeline, both schedules (issue 5).
source "$(dirname "$0")/../_env.sh"
"$PY" scripts/bench_megamoe.py --out "$XSTAGE_RESULTS/megamoe"
