# FA4 + Ulysses post-A2A: Table-3 sweep in the loopback world, then the host (PCIe) world (issue 4).
source "$(dirname "$0")/../_env.sh"
"$PY" scripts/bench_fa_a2a.py --world loopback --out "$XSTAGE_RESULTS/fa4_a2a"
"$PY" scripts/bench_fa_a2a.py --world host --heads 40 --profile h200-pcie-host --out "$XSTAGE_RESULTS/fa4_a2a"
