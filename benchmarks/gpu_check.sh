#!/usr/bin/env bash
# The GPU run of issue 13, one command (at most ~5 minutes on an H100):
#   bash benchmarks/gpu_check.sh --device cuda --out "$OUT"
# from the repository root, with the pydantic wheels (pydantic, pydantic_core, annotated_types,
# typing_inspection for cp312) carried in .whl/ (see benchmarks/README.md, "GPU run owed").
# `--device cpu --quick` runs every step CI-sized (tests/benchmarks/test_gpu_check.py).
# Steps: (0) install the carried wheels; (1) import check: nothing on the path imports dm_control, mujoco, ray
# or mlflow; (2) the torch_only tests with QED_TEST_DEVICE=<device>; (3) the precision gate
# (benchmarks/bench_precision_gate.py): QED's alpha at fp32, 3xtf32 and tf32 against an FP64 recomputation on the
# same inputs, each pass captured in a CUDA graph on CUDA; (4) benchmarks/gpu_bench.py: graph-vs-eager deviation +
# sync check, then the throughput cells (with their precision), writing throughput.json / throughput.md after
# every cell.
# Outputs (flat, in --out): gpu_check.log, env.txt, pytest.log, precision_gate.json, precision_gate.md,
# throughput.json, throughput.md.
set -uo pipefail

DEVICE=cuda OUT=benchmarks/out/gpu QUICK=() GATE=() DEADLINE=
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --quick) QUICK=(--quick); GATE=(--quick); shift ;;
    --deadline-s) DEADLINE="$2"; shift 2 ;;
    *) echo "gpu_check.sh: unknown argument $1 (allowed: --device cuda|cpu, --out DIR, --quick, --deadline-s S)" >&2
       exit 2 ;;
  esac
done
# The GPU run's cells must end within ~5 minutes; the CPU form runs every cell (slowly on a loaded machine).
[ -n "$DEADLINE" ] || { [ ${#QUICK[@]} -gt 0 ] && DEADLINE=1200 || DEADLINE=200; }
case "$DEVICE" in cpu|cuda|cuda:[0-9]*) ;; *) echo "gpu_check.sh: --device $DEVICE is not cpu, cuda or cuda:N" >&2; exit 2 ;; esac

PY=${PYTHON:-python3}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1
SITE=""
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && SITE=/tmp/site || echo "step 0: installing the carried wheels FAILED"
fi
export PYTHONPATH="$PWD${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
echo "step 0: $(date -u +%FT%TZ) device=$DEVICE out=$OUT PYTHONPATH=$PYTHONPATH"

{ "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); [print("gpu", i, torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())]'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

"$PY" - <<'PY'
import sys
import qed_ray.rl.agents, qed_ray.rl.agents.packed, qed_ray.rl.update, qed_ray.rl.replay, qed_ray.rl.trainer  # noqa
import qed_ray.rl.precision  # noqa
import benchmarks.gpu_bench, benchmarks.precision_gate, benchmarks.bench_precision_gate  # noqa
heavy = sorted(m for m in ("dm_control", "mujoco", "ray", "mlflow") if m in sys.modules)
print("step 1: import check:", "FAILED, imported " + ", ".join(heavy) if heavy else "passed (no dm_control, mujoco, ray, mlflow)")
PY
[ $? -eq 0 ] || echo "step 1: import check FAILED (see the traceback above)"

echo "step 2: torch_only tests with QED_TEST_DEVICE=$DEVICE"
QED_TEST_DEVICE="$DEVICE" timeout 120 "$PY" -m pytest -q -p no:cacheprovider -m "torch_only and not slow" \
  tests/rl/test_pack_update.py tests/records/test_throughput.py tests/rl/test_precision.py > "$OUT/pytest.log" 2>&1
echo "step 2: pytest exit $? ($(tail -n 1 "$OUT/pytest.log"))"

# The gate: alpha from the whole QED pass against FP64 on the same inputs; 3xtf32 passes when its mean alpha error
# is at most twice fp32's on every case. On CUDA the tensor-core passes are captured in CUDA graphs and vmapped
# over the cases (a pack's path), then the emulation runs the same cases as a cross-check.
[ "$DEVICE" = cpu ] || GATE+=(--graph)
echo "step 3: precision gate (benchmarks/bench_precision_gate.py ${GATE[*]+${GATE[*]}})"
timeout 300 "$PY" benchmarks/bench_precision_gate.py --device "$DEVICE" ${GATE[@]+"${GATE[@]}"} \
  --out "$OUT/precision_gate.json" > "$OUT/precision_gate.md" 2>&1
GATE_RC=$?
cat "$OUT/precision_gate.md"
echo "step 3: precision gate exit $GATE_RC (0 passed, 3 3xtf32 failed the gate, other: an error)"

echo "step 4: benchmarks/gpu_bench.py (deadline ${DEADLINE}s)"
timeout $((DEADLINE + 80)) "$PY" benchmarks/gpu_bench.py --device "$DEVICE" --out "$OUT" --deadline-s "$DEADLINE" \
  ${QUICK[@]+"${QUICK[@]}"}
echo "step 4: gpu_bench exit $?"
echo "done: $(date -u +%FT%TZ)"
