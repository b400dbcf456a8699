#!/usr/bin/env bash
# The project's test command (README, CI): fast suite first, then the slow end-to-end suite (real Ray, MLflow).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export MUJOCO_GL=disable RAY_USAGE_STATS_ENABLED=0
# Ray auth stays on: tests/conftest.py gives each pytest run a throwaway token (environment only, never a file).
unset RAY_AUTH_MODE RAY_AUTH_TOKEN RAY_AUTH_TOKEN_PATH RAY_ADDRESS
# The fast suite on every core (its tests share nothing but read-only fixtures); the slow one in order: each of its
# tests drives a Ray cluster that wants both cores.
$PY -m pytest -m "not slow" -q -n auto --durations=10 "$@"
$PY -m pytest -m slow -q --durations=40 "$@"
