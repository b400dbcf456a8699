#!/usr/bin/env bash
# The project's test command (README, CI): fast suite first, then the slow end-to-end suite (real Ray, MLflow).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
export MUJOCO_GL=disable RAY_USAGE_STATS_ENABLED=0
# Ray auth stays on: tests/conftest.py gives each pytest run a throwaway token (environment only, never a file).
unset RAY_AUTH_MODE RAY_AUTH_TOKEN RAY_AUTH_TOKEN_PATH RAY_ADDRESS
# Bytecode is cached (qed_ray's own modules too): the suites start a few hundred Python processes.
unset PYTHONDONTWRITEBYTECODE
# The fast suite on every core (its tests share nothing but read-only fixtures). The slow suite three files at a time
# on two cores: its tests wait on process starts, Ray and MLflow (two at a time left them 11-17% idle), and each
# file's clusters are its own (tests/ray_cluster.py); the longest files go first, by the recorded durations of
# tests/data/slow_durations.json (tests/conftest.py; docs/ci.md says how to record them again).
$PY -m pytest -m "not slow" -q -n auto --durations=10 "$@"
$PY -m pytest -m slow -q -n 3 --dist loadfile --no-loadscope-reorder --durations=40 "$@"
