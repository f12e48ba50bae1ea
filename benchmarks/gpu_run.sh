#!/usr/bin/env bash
# The GPU check on a machine with torch and no network (docs/gpu-step.md), from the repository root:
#     bash benchmarks/gpu_run.sh OUT_DIR [BUNDLE_DIR]
# Installs the wheel bundle (benchmarks/gpu_bundle.py; default .whl) into a folder of its own with
# --no-index --no-deps (nothing the machine has is replaced), then runs benchmarks/gpu_check.py:
# OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.log. Exit: the check's (0 passed, 1 failed,
# 2 a job does not parse, 3 no CUDA); 4 when the bundle does not install.
set -uo pipefail
out=${1:?usage: bash benchmarks/gpu_run.sh OUT_DIR [BUNDLE_DIR]}
bundle=${2:-.whl}
site=${FASTPATH_SITE:-/tmp/fastpath-site}
py=${PYTHON:-python3}
mkdir -p "$out"
if ! compgen -G "$bundle/*.whl" >/dev/null; then
  echo "gpu_run: no wheels in $bundle: build them with python benchmarks/gpu_bundle.py --out $bundle" >&2
  exit 4
fi
"$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  "$bundle"/*.whl >"$out/install.log" 2>&1 || { cat "$out/install.log" >&2; exit 4; }
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" benchmarks/gpu_check.py --out "$out/gpu_check.json" --budget-s "${FASTPATH_CHECK_BUDGET_S:-420}" \
  2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
