#!/usr/bin/env bash
# GPU suite (called by scripts/run on a Hopper host): every GPU test, then the
# measurement scripts that exist. Results go under results/ (override with
# XSTAGE_RESULTS) with provenance.
source "$(dirname "$0")/_env.sh"
out=${XSTAGE_RESULTS:-results/$(hostname)-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$out"
echo "== GPU tests"
"$PY" -m pytest tests -m "gpu or compile" -q 2>&1 | tee "$out/gpu-tests.log"
for step in scripts/suite.d/*.sh; do
  [ -e "$step" ] || continue
  echo "== $step"
  XSTAGE_RESULTS="$out" bash "$step"
done
echo "results in $out"
