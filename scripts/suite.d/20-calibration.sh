# X-Stage calibration (host PCIe target + local control), fit and report (issue 3).
source "$(dirname "$0")/../_env.sh"
"$PY" -m calibration all --target host local --out "$XSTAGE_RESULTS/calibration" \
  --profile "$XSTAGE_RESULTS/calibration/profile-h200-pcie-host.json"
