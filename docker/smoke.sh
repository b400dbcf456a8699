#!/usr/bin/env bash
# Smoke test for the qed-ray image. Run it:
#   - at build time: the Dockerfile's `smoke` stage runs it with MUJOCO_GL=osmesa (builders have no GPU);
#   - on a GPU host:  docker run --rm --gpus all ghcr.io/your-org/qed-ray:2.60.0-py311-gpu bash docker/smoke.sh
#     (add -e QED_SMOKE_RENDER=1 to also render one frame through EGL).
# It fails (non-zero exit) as soon as any step fails.
set -euo pipefail

echo "MUJOCO_GL=${MUJOCO_GL:-<unset>} NVIDIA_DRIVER_CAPABILITIES=${NVIDIA_DRIVER_CAPABILITIES:-<unset>}"

# 1. The pinned stack imports, and reports the versions actually installed.
python -c 'import ray, torch, mujoco, dm_control, mlflow; print(f"ray {ray.__version__} | torch {torch.__version__} cuda={torch.cuda.is_available()} | mujoco {mujoco.__version__} | mlflow {mlflow.__version__}")'

# 2. The image's user cannot become root: no passwordless sudo (the Ray base image grants it; the
#    Dockerfile removes it). `sudo -n` fails without a password, or sudo is absent.
if command -v sudo > /dev/null && sudo -n true 2> /dev/null; then
  echo "passwordless sudo for $(id -un): the image must not grant it" >&2
  exit 1
fi

# 3. Every one of the 18 dm_control tasks loads (one line per task). This exact command string is
#    documented in docker/README.md and checked by cluster/check.py.
qed-ray envs --check-all

# 4. Optional: headless rendering through the configured backend (EGL on GPU hosts). State-based
#    training never renders, so this is opt-in; it catches a missing `graphics` driver capability.
if [[ "${QED_SMOKE_RENDER:-0}" == "1" ]]; then
  python -c 'from dm_control import suite; px = suite.load("cartpole", "swingup").physics.render(); print("rendered", px.shape)'
fi

echo "smoke OK"
