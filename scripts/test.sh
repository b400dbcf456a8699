#!/usr/bin/env bash
# The project's test command (README, CI): fast suite first, then the slow end-to-end suite (real Ray, MLflow).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export MUJOCO_GL=disable RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
$PY -m pytest -m "not slow" -q "$@"
$PY -m pytest -m slow -q "$@"
