"""Benchmark: inter-run variability V at the paper's App. E scale, plus the IQM bootstrap.

V uses 10 seeds' policies on the pooled eval states of 10 seeds x 20 episodes x 500 decisions
(100,000 states) with action dim 12 (the largest dm_control action space in the 18 tasks).
Run: `python benchmarks/bench_metrics.py [--repeats 3]`. Prints wall time (median of repeats)
and peak extra memory traced by tracemalloc (numpy allocations are traced).
"""

import argparse
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from qed_ray.analysis import bootstrap, metrics


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall-clock seconds of `repeats` calls of `fn`."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _peak_extra_mib(fn: Callable[[], object]) -> float:
    """Peak memory allocated during one call of `fn`, in MiB, beyond what existed before."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return (peak - base) / 2**20


def _policy_outputs(n_pol: int, n_states: int, n_dims: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Random pre-tanh means and stds (log-std in the actor's [-5, 2] range), shape (I, S, A)."""
    rng = np.random.default_rng(0)
    mus = rng.normal(size=(n_pol, n_states, n_dims)).astype(dtype)
    sigmas = np.exp(rng.uniform(-5.0, 2.0, size=(n_pol, n_states, n_dims))).astype(dtype)
    return mus, sigmas


def bench_variability(repeats: int) -> None:
    """Times V for 10 policies x 100,000 states x 12 dims in float32 and float64 inputs."""
    n_pol, n_states, n_dims = 10, 10 * 20 * 500, 12
    for dtype in (np.float32, np.float64):
        mus, sigmas = _policy_outputs(n_pol, n_states, n_dims, dtype)
        run = lambda: metrics.inter_run_variability(mus, sigmas)  # noqa: E731
        seconds = _median_seconds(run, repeats)
        peak = _peak_extra_mib(run)
        input_mib = (mus.nbytes + sigmas.nbytes) / 2**20
        print(f"V for {n_pol} policies x {n_states} states x {n_dims} dims ({np.dtype(dtype).name} inputs, "
              f"{input_mib:.0f} MiB): {seconds:.3f} s (median of {repeats}), peak extra memory {peak:.1f} MiB")


def bench_chunk_sizes(repeats: int) -> None:
    """Times V at the same scale for several `chunk_elements` budgets (float64 inputs)."""
    mus, sigmas = _policy_outputs(10, 100_000, 12, np.float64)
    for chunk in (1 << 16, 1 << 18, 1 << 20, 1 << 22):
        run = lambda: metrics.inter_run_variability(mus, sigmas, chunk_elements=chunk)  # noqa: E731
        print(f"  chunk_elements={chunk:>8d} ({chunk * 8 / 2**20:5.1f} MiB per temporary): "
              f"{_median_seconds(run, repeats):.3f} s (median of {repeats})")


def bench_bootstrap(repeats: int) -> None:
    """Times the vectorised IQM stratified bootstrap on a 10 x 18 score matrix."""
    scores = np.random.default_rng(1).uniform(size=(10, 18))
    for reps in (2000, 50000):
        seconds = _median_seconds(lambda: bootstrap.stratified_bootstrap_ci(scores, reps=reps), repeats)
        print(f"IQM 95% CI, stratified bootstrap, 10 runs x 18 tasks, {reps} reps: "
              f"{seconds:.3f} s (median of {repeats})")


def main() -> None:
    """Parses `--repeats` and runs the benchmarks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case (median reported)")
    args = parser.parse_args()
    bench_variability(args.repeats)
    bench_chunk_sizes(args.repeats)
    bench_bootstrap(args.repeats)


if __name__ == "__main__":
    main()
