"""A pack's update as one replayable unit: eager, ``torch.compile``d, or one CUDA graph per update (the modes and
why they look as they do: docs/design.md, "The packed update")."""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from qed_ray.rl.agents.packed import PackedAgent
from qed_ray.rl.replay import Replay
from qed_ray.rl.update_metrics import MetricAccumulator

MODES = ("auto", "off", "compile", "graph")
WARMUP = 3  # eager updates on a side stream before the capture (the optimiser state must exist when it starts)
# train.compile auto on a CPU: per (agent, temperature pass structure), a cold compile's wall seconds and the CPU
# ms one compiled update saves against an eager one, at width 256, batch 256, one thread, on the 2-core reference
# machine (benchmarks/README.md, "Compile on CPU"): SAC-LN measured with the one-exp Mish compiled, MAD-SAC with
# aten::mish compiled (a lower bound), floor between te and qed (its extra passes are half of qed's; not measured).
# The saving scales with the update's product work (width^2 x batch); the compile's cost does not.
CPU_COMPILE = {("sac_ln", "te"): (25.0, 2.4), ("sac_ln", "qed"): (25.0, 26.0), ("sac_ln", "floor"): (25.0, 14.0),
               ("mad_sac", "te"): (50.0, 11.0), ("mad_sac", "qed"): (50.0, 18.0), ("mad_sac", "floor"): (50.0, 14.0)}
CPU_COMPILE_WORK = 256 * 256 * 256  # width^2 x batch of the measurement


def temperature_passes(agent: PackedAgent) -> str:
    """``te`` (no QED pass: te and fixed), ``floor`` (QED at actor updates only: ``target_alpha: floor``) or
    ``qed`` (QED also at s' for the TD target): what sets an update's extra critic passes."""
    fn = agent.template.fn
    return "te" if not fn.n_qed else "floor" if not fn.n_qed_target else "qed"


def compile_pays(agent: PackedAgent, total_updates: int) -> tuple[bool, str]:
    """Whether compiling a CPU pack's update repays its cost within ``total_updates``, and why: :data:`CPU_COMPILE`
    scaled by width^2 x batch x seeds, no clock read, so the same run always chooses the same way."""
    cost_s, saved_ms = CPU_COMPILE[(agent.name, temperature_passes(agent))]
    spec = agent.spec
    saved_ms *= spec.hidden ** 2 * spec.batch_size * agent.n / CPU_COMPILE_WORK
    payback = math.ceil(cost_s * 1e3 / saved_ms)
    pays = total_updates >= payback
    return pays, (f"{total_updates} updates {'>=' if pays else '<'} the ~{payback} that repay a ~{cost_s:.0f} s "
                  f"compile on a CPU")


def resolve_mode(mode: str, device: torch.device, agent: PackedAgent,
                 total_updates: int | None = None) -> tuple[str, str]:
    """``(mode, reason)``: ``off``, ``compile`` or ``graph`` and a phrase for the log, from ``train.compile``, the
    device and (``auto`` on a CPU) the run's total updates (None: unknown, so eager)."""
    device = torch.device(device)
    if mode not in MODES:
        raise ValueError(f"train.compile: {mode!r} is not one of {', '.join(MODES)}")
    if mode == "graph" and device.type != "cuda":
        raise ValueError(f"train.compile: 'graph' needs a CUDA device (the pack runs on {device}); on this device "
                         f"use one of auto, off, compile")
    if mode == "auto" and device.type != "cuda":
        if total_updates is None:
            return "off", "auto: eager, the run's length is not known"
        pays, why = compile_pays(agent, total_updates)
        return ("compile" if pays else "off"), f"auto: {why}"
    if mode == "auto":
        mode = "graph"
    every = model_every(agent)
    if mode == "graph" and every > 1:
        return "off", (f"agent.mad.model_every={every} branches on the host every update; one CUDA graph cannot "
                       f"hold both branches, so the update runs eagerly")
    return mode, {"off": "eager", "compile": "torch.compile", "graph": "one CUDA graph per update"}[mode]


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether two device names mean one device (``cuda`` is the current CUDA device, so it equals ``cuda:0``
    there; comparing ``torch.device`` objects says they differ)."""
    return torch.empty(0, device=a).device == torch.empty(0, device=b).device


def model_every(agent: PackedAgent) -> int:
    """MAD-SAC's ``agent.mad.model_every`` (1 for agents without a model)."""
    return getattr(getattr(agent.spec, "mad", None), "model_every", 1)


class PackUpdater:
    """One packed update per call, in a resolved mode, the metric sums kept on the device in ``acc`` (None: metrics
    only returned); ``batch_size`` is fixed, the static buffers have its shape."""

    def __init__(self, agent: PackedAgent, replay: Replay, acc: MetricAccumulator | None, mode: str,
                 batch_size: int):
        if mode not in ("off", "compile", "graph"):
            raise ValueError(f"PackUpdater mode: {mode!r} is not one of off, compile, graph (resolve 'auto' first)")
        if mode == "graph" and agent.device.type != "cuda":
            raise ValueError(f"PackUpdater mode 'graph' needs a CUDA agent (it is on {agent.device})")
        if mode == "graph" and model_every(agent) > 1:
            raise ValueError(f"PackUpdater mode 'graph': agent.mad.model_every={model_every(agent)} needs the eager "
                             f"update (one graph holds one branch); resolve_mode chooses it")
        self.agent, self.replay, self.acc, self.mode = agent, replay, acc, mode
        self.calls, self.graph = 0, None
        dev = agent.device
        self.gather_inside = same_device(replay.storage.device, dev)
        self.idx = torch.zeros((agent.n, batch_size), dtype=torch.int64, device=replay.storage.device)
        # Indices reach a CUDA device through pinned host buffers (a copy from pageable memory waits for the
        # device); two of them, each reused only once its last copy is done (an event, so no stream sync).
        pinned = self.idx.device.type == "cuda"
        self._staging = [torch.zeros(self.idx.shape, dtype=torch.int64, pin_memory=True) for _ in range(2)] \
            if pinned else []
        self._copied = [torch.cuda.Event() for _ in self._staging]
        rows = agent.template.noise_rows(batch_size)
        self.noise = torch.zeros((agent.n, rows, agent.action_dim), device=dev, dtype=agent.dtype)
        self.batch = None if self.gather_inside else {k: v.clone() for k, v in replay.gather(
            np.zeros((agent.n, batch_size), np.int64)).items()}
        if mode == "compile":
            use_inductor_cache()
            agent.compile_losses()
        self.metrics: torch.Tensor | None = None

    def __call__(self, idx: np.ndarray, noise: torch.Tensor) -> torch.Tensor:
        """One update of every seed from batch indices [S, B] and noise [S, R, A]; returns the [S, K] metrics (in
        ``graph`` mode a static buffer the next call overwrites)."""
        self._load(idx, noise)
        if self.mode != "graph":
            self.metrics = self._step()
        elif self.graph is not None:
            self._replay()
        elif self.calls < WARMUP:
            self.metrics = self._on_side_stream(self._step)
        else:
            self._capture()
        self.calls += 1
        if self.acc is not None:
            self.acc.counted()
        self.agent.hold_frozen()  # outside the graph: freezing a seed never invalidates a capture
        return self.metrics

    def eager(self, batch: dict[str, torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
        """One eager update on a given ``batch`` (e.g. one with an injected fault) in any mode; a memo tensor the
        update rebinds is copied back into the one a captured graph writes, so later replays stay consistent."""
        kept = dict(self.agent.memo)
        metrics = self.agent.learn(batch, noise)
        for k, old in kept.items():
            if self.agent.memo[k] is not old:
                old.copy_(self.agent.memo[k])
                self.agent.memo[k] = old
        if self.acc is not None:
            self.acc.add(metrics)
        self.agent.hold_frozen()
        return metrics

    # ---- the update as a function of the static buffers --------------------------------------------------
    def _load(self, idx: np.ndarray, noise: torch.Tensor) -> None:
        if self.gather_inside and not self._staging:  # CPU: the index buffer is host memory already
            self.idx.copy_(torch.from_numpy(np.ascontiguousarray(idx, np.int64)))
        elif self.gather_inside:
            k = self.calls % 2
            self._copied[k].synchronize()  # done long ago in a training loop: acting reads actions back
            self._staging[k].numpy()[...] = idx
            self.idx.copy_(self._staging[k], non_blocking=True)
            self._copied[k].record()
        else:
            for k, v in self.replay.gather(idx).items():
                self.batch[k].copy_(v, non_blocking=True)
        self.noise.copy_(noise)

    def _step(self) -> torch.Tensor:
        batch = self.replay.gather_tensor(self.idx) if self.gather_inside else self.batch
        metrics = self.agent.learn(batch, self.noise)
        if self.acc is not None:
            self.acc.fold(metrics)
        return metrics

    # ---- graph mode ------------------------------------------------------------------------------------
    def _on_side_stream(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream(self.agent.device)
        side.wait_stream(torch.cuda.current_stream(self.agent.device))
        with torch.cuda.stream(side):
            out = fn()
        torch.cuda.current_stream(self.agent.device).wait_stream(side)
        return out

    def _capture(self) -> None:
        for opt in self.agent.opts.values():
            make_capturable(opt)
        updates = self.agent.updates
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):  # records, runs nothing: the replay below is this call's update
            self.metrics = self._step()
        # Host-side counters the update moves (MAD-SAC's ``updates``) moved once during the capture; each replay
        # moves them by the same amount (model_every == 1 here, so the captured branch is the only one).
        self._host_delta = self.agent.updates - updates
        self.agent.updates = updates
        self._replay()

    def _replay(self) -> None:
        self.graph.replay()
        self.agent.updates += self._host_delta


def make_capturable(opt: torch.optim.Optimizer) -> None:
    """Sets ``capturable`` on every param group and moves step counters to their parameter's device: a state loaded
    from a checkpoint written on the CPU carries ``capturable=False`` and host step counters, which a CUDA graph
    cannot step."""
    for group in opt.param_groups:
        group["capturable"] = True
        for p in group["params"]:
            state = opt.state.get(p, {})
            step = state.get("step")
            if step is not None and step.device != p.device:
                state["step"] = step.to(p.device, torch.float32)


def inductor_cache_dir() -> Path:
    """The node-local folder of inductor's compiled kernels for this code: under the system temp folder (what
    every trial and restart on a node shares), one subfolder per torch version and hash of the qed_ray sources, so
    a code change starts a fresh cache rather than trusting inductor's own key to see every change."""
    src = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(torch.__version__.encode())
    for f in sorted(src.rglob("*.py")):
        h.update(f.relative_to(src).as_posix().encode() + b"\0" + f.read_bytes())
    return Path(tempfile.gettempdir()) / f"qed_ray_inductor_{os.getuid()}" / h.hexdigest()[:16]


def use_inductor_cache() -> None:
    """Points inductor at :func:`inductor_cache_dir` unless ``TORCHINDUCTOR_CACHE_DIR`` is set already (a user's
    choice wins); called before the first compile."""
    if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
