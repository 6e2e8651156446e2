# FA4 + Ulysses post-A2A: Table-3 sweep in the loopback world, then the host (PCIe) world (issue 4).
source "$(dirname "$0")/../_env.sh"
"$PY" scripts/bench_fa_a2a.py --world loopback --out "$XSTAGE_RESULTS/fa4_a2a"
"$PY" scripts/bench_fa_a2a.py --world host --heads 40 --profile h200-pcie-host --out "$XSTAGE_RESULTS/fa4_a2a"
# Clock-stabilised acceptance run (paired, matched-clock verdict T_fused < T_serial per M).
"$PY" scripts/bench_fa_a2a.py --stabilize --cooldown-s 0.2 --variants fa_only serial a2a_symm serial_symm fused \
  --out "$XSTAGE_RESULTS/fa4_a2a" --tag bench_loopback_stabilized
