# Sourced by scripts/run and scripts/test: pick a Python that has the project's
# dependencies, installing them into ./.venv on first use.
#
# * On a GPU host prepared with the offline wheel bundle (docs/gpu.md), the
#   system python3 + /tmp/xstage-gpu-env.sh are used as they are (no registry),
#   and one line on stderr says so. XSTAGE_SYSTEM_PYTHON=1 asks for that mode
#   anywhere; XSTAGE_SYSTEM_PYTHON=0 uses ./.venv even where the file exists.
# * Elsewhere a local venv is created. On the CPU machines torch==2.13.0 (a CPU
#   build on disk) is installed first so the `torch>=2.9` requirement does not
#   pull a multi-GB CUDA build. XSTAGE_TORCH overrides that pin.
set -euo pipefail
XSTAGE_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$XSTAGE_ROOT"
export CUTE_DSL_ARCH=${CUTE_DSL_ARCH:-sm_90a}
export FLASH_ATTENTION_ARCH=${FLASH_ATTENTION_ARCH:-sm_90}
export FLASH_ATTENTION_NUM_SMS=${FLASH_ATTENTION_NUM_SMS:-132}
export PYTHONUNBUFFERED=1

gpu_env=${XSTAGE_GPU_ENV:-/tmp/xstage-gpu-env.sh}  # XSTAGE_GPU_ENV: another path (tests)
use_system=${XSTAGE_SYSTEM_PYTHON:-}
if [ -z "$use_system" ] && [ -f "$gpu_env" ]; then
  # the offline GPU-host workflow (docs/gpu.md) has no registry for a venv: keep it, but say so
  echo "[xstage] using system python3 + $gpu_env (GPU host bundle); set XSTAGE_SYSTEM_PYTHON=0 to use ./.venv" >&2
  use_system=1
fi
if [ "$use_system" = 1 ]; then
  if [ -f "$gpu_env" ]; then source "$gpu_env"; fi
  PY=python3
  export PYTHONPATH="$XSTAGE_ROOT${PYTHONPATH:+:$PYTHONPATH}"
else
  venv="$XSTAGE_ROOT/.venv"
  stamp="$venv/.xstage-installed"
  want=$(sha256sum pyproject.toml | cut -c1-16)
  if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "[xstage] setting up $venv (first run or pyproject.toml changed)"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -c "import torch" 2>/dev/null \
      || "$venv/bin/python" -m pip install -q "torch==${XSTAGE_TORCH:-2.13.0}"
    "$venv/bin/python" -m pip install -q -e ".[test,plot,dit]"
    echo "$want" > "$stamp"
  fi
  PY="$venv/bin/python"
  export XSTAGE_REQUIRE_DIT=1  # the venv has the dit extra: its integration tests must not skip
fi

hopper_present() {
  "$PY" - <<'PYEOF' 2>/dev/null
import sys, torch
sys.exit(0 if torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0) else 1)
PYEOF
}
