"""The envs of a pack, stepped together: in the pack's own process (``workers=0``) or on W worker processes, through
shared memory, the same bits whatever W is (docs/design.md, "The training loop")."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from qed_ray.rl.envs import DMCEnv, make_env


class EnvWorkerError(RuntimeError):
    """An env worker failed or died; the message carries its traceback or exit code."""


@dataclass(frozen=True)
class Steps:
    """Outcome of one decision of several envs: obs [N, O] float32, reward [N] float64, flags [N] bool."""

    obs: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray


class _Shared:
    """numpy views of the shared buffers of N envs (created by the pool, attached by the workers)."""

    def __init__(self, raw: dict, n: int, obs_dim: int, action_dim: int):
        self.raw = raw
        self.action = np.frombuffer(raw["action"], np.float32).reshape(n, action_dim)
        self.obs = np.frombuffer(raw["obs"], np.float32).reshape(n, obs_dim)
        self.reward = np.frombuffer(raw["reward"], np.float64)
        self.flags = np.frombuffer(raw["flags"], np.uint8).reshape(n, 2)  # terminated, truncated

    @classmethod
    def create(cls, ctx, n: int, obs_dim: int, action_dim: int) -> "_Shared":
        raw = {"action": ctx.RawArray("f", n * action_dim), "obs": ctx.RawArray("f", n * obs_dim),
               "reward": ctx.RawArray("d", n), "flags": ctx.RawArray("B", n * 2)}
        return cls(raw, n, obs_dim, action_dim)


def _serve(envs: dict[int, DMCEnv], sh: _Shared, command: str, args: tuple):
    """Runs one command on ``envs`` (worker side; also the in-process path, so both do exactly the same)."""
    if command == "step":
        for i in args[0]:
            st = envs[i].step(sh.action[i])
            sh.obs[i], sh.reward[i], sh.flags[i] = st.obs, st.reward, (st.terminated, st.truncated)
    elif command == "reset":
        for i in args[0]:
            sh.obs[i] = envs[i].reset()
    elif command == "reseed":
        for i, seed in args[0]:
            envs[i].reseed(seed)
    elif command == "physics":
        return [envs[i].physics.get_state().copy() for i in args[0]]
    elif command == "random_state":
        return envs[args[0]].random_state()
    elif command == "set_random_state":
        envs[args[0]].set_random_state(args[1])
    elif command == "cpu_s":  # a worker's own CPU time (asked of workers only: the pack's process counts its own)
        return time.process_time()
    else:
        raise ValueError(f"env worker: unknown command {command!r}")
    return None


def _worker(conn, task: str, frame_skip: int, owned: list[tuple[int, int]], raw: dict, n: int, obs_dim: int,
            action_dim: int) -> None:
    """Worker process: builds its envs, then serves commands until ``close`` or until the pool's end of the pipe
    closes (the pack's process is gone)."""
    # Ctrl-C is the pack's process's to handle (it closes the pipe): started with SIGINT blocked, the worker ignores
    # it before any library thread could take it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    envs: dict[int, DMCEnv] = {}
    try:
        envs = {i: make_env(task, seed, frame_skip) for i, seed in owned}
        sh = _Shared(raw, n, obs_dim, action_dim)
        conn.send(("ok", None))
        while True:
            command, *args = conn.recv()
            if command == "close":
                break
            try:
                conn.send(("ok", _serve(envs, sh, command, tuple(args))))
            except Exception:  # noqa: BLE001 - the pool re-raises it with this traceback
                conn.send(("error", traceback.format_exc()))
    except EOFError:
        pass
    except Exception:  # noqa: BLE001 - building the envs failed: report it instead of dying silently
        conn.send(("error", traceback.format_exc()))
    finally:
        for env in envs.values():
            env.close()


class EnvPool:
    """N envs of one task (env i seeded ``seeds[i]``), stepped together: in this process (``workers`` 0) or spread
    over W worker processes (spawned, so no torch state is forked)."""

    def __init__(self, task: str, seeds: Sequence[int], frame_skip: int, workers: int = 0):
        if workers < 0:
            raise ValueError(f"env_workers: {workers} must be >= 0")
        self.task, self.n, self.workers = task, len(seeds), min(workers, len(seeds))
        self._local: dict[int, DMCEnv] = {}
        self._conns, self._procs = [], []
        if self.workers == 0:
            self._local = {i: make_env(task, s, frame_skip) for i, s in enumerate(seeds)}
            probe = self._local[0]
        else:
            probe = make_env(task, seeds[0], frame_skip)
            probe.close()
        self.obs_dim, self.action_dim = probe.obs_dim, probe.action_dim
        ctx = mp.get_context("spawn")
        self._sh = _Shared.create(ctx, self.n, self.obs_dim, self.action_dim)
        # The workers start with SIGINT blocked (the mask survives the spawn) until they ignore it: Ctrl-C reaches a
        # terminal's whole process group, and it is the pack's process that stops, closing the pipes.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            for w in range(self.workers):
                owned = [(i, s) for i, s in enumerate(seeds) if i % self.workers == w]
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker, name=f"env-worker-{w}", daemon=True,
                                   args=(child, task, frame_skip, owned, self._sh.raw, self.n, self.obs_dim,
                                         self.action_dim))
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for w in range(self.workers):
            self._reply(w)

    # ---- calls -----------------------------------------------------------------------------------------
    def reset(self, idx: Sequence[int]) -> np.ndarray:
        """Starts new episodes in envs ``idx``; their first observations [len(idx), O]."""
        self._run("reset", idx)
        return self._sh.obs[list(idx)].copy()

    def step(self, idx: Sequence[int], actions: np.ndarray) -> Steps:
        """One decision of envs ``idx`` with ``actions`` [len(idx), A] (float32, as an agent acts)."""
        idx = list(idx)
        self._sh.action[idx] = actions
        self._run("step", idx)
        flags = self._sh.flags[idx].astype(bool)
        return Steps(self._sh.obs[idx].copy(), self._sh.reward[idx].copy(), flags[:, 0], flags[:, 1])

    def reseed(self, idx: Sequence[int], seeds: Sequence[int]) -> None:
        """Reseeds envs ``idx`` (:meth:`DMCEnv.reseed`): their next reset draws a fresh env's initial state."""
        self._run("reseed", list(zip(idx, seeds)), env=lambda pair: pair[0])

    def physics_states(self, idx: Sequence[int]) -> np.ndarray:
        """[len(idx), Q] MuJoCo state vectors (qpos, qvel, act) of envs ``idx`` (state-spread figures)."""
        states = {i: s for mine, got in self._run("physics", list(idx)) for i, s in zip(mine, got)}
        return np.stack([states[i] for i in idx])

    def random_state(self, i: int) -> dict:
        """Env ``i``'s task RNG state (:meth:`DMCEnv.random_state`)."""
        return self._call_one(i, "random_state")

    def set_random_state(self, i: int, state: dict) -> None:
        self._call_one(i, "set_random_state", state)

    def workers_cpu_s(self) -> float:
        """CPU seconds the env worker processes have used since they started, summed (0.0 without workers)."""
        for conn in self._conns:
            conn.send(("cpu_s",))
        return float(sum(self._reply(w) for w in range(len(self._conns))))

    def close(self) -> None:
        """Frees the envs and stops the workers (idempotent)."""
        for env in self._local.values():
            env.close()
        self._local = {}
        for conn in self._conns:
            try:
                conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._conns, self._procs = [], []

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- plumbing ----------------------------------------------------------------------------------------
    def _run(self, command: str, items: list, env: Callable = lambda i: i) -> list[tuple[list, object]]:
        """``command`` on each worker's share of ``items`` (env i lives on worker i mod W): ``(share, reply)`` pairs."""
        if self.workers == 0:
            return [(items, _serve(self._local, self._sh, command, (items,)))]
        shares = [[x for x in items if env(x) % self.workers == w] for w in range(self.workers)]
        busy = [w for w, share in enumerate(shares) if share]
        for w in busy:
            self._conns[w].send((command, shares[w]))
        return [(shares[w], self._reply(w)) for w in busy]

    def _call_one(self, i: int, command: str, *args):
        if self.workers == 0:
            return _serve(self._local, self._sh, command, (i, *args))
        w = i % self.workers
        self._conns[w].send((command, i, *args))
        return self._reply(w)

    def _reply(self, w: int):
        try:
            status, payload = self._conns[w].recv()
        except (EOFError, OSError):
            code = self._procs[w].exitcode
            raise EnvWorkerError(f"env worker {w} of {self.task} died (exit code {code})") from None
        if status == "error":
            raise EnvWorkerError(f"env worker {w} of {self.task} failed:\n{payload}")
        return payload
