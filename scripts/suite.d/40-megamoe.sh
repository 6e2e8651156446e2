# MegaMoE fused kernel vs grouped GEMMs and the unfused pipeline, both schedules (issue 5):
# the validated single-stage WGMMA path, then the TMA warp-specialized mainloop.
source "$(dirname "$0")/../_env.sh"
"$PY" scripts/bench_megamoe.py --P 1 8 --tokens 8192 --out "$XSTAGE_RESULTS/megamoe"
"$PY" scripts/bench_megamoe.py --P 1 8 --tokens 8192 --mma tma_ws --block-m 128 --block-n 256 --stages 3 \
  --skip-baselines --tag _tma_ws_128x256 --out "$XSTAGE_RESULTS/megamoe"
