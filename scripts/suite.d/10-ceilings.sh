# Copy bandwidth and dense bf16 rate: the ceilings every other number is read against.
source "$(dirname "$0")/../_env.sh"
"$PY" scripts/measure_ceilings.py --out "$XSTAGE_RESULTS/ceilings.json"
