"""The numerics gate of a QED precision: alpha from the whole QED pass against an FP64 recomputation (Sec. 5.1).

QED's alpha(s) = clip(Expectile_tau |Q1(s, a_i) - Q2(s, a_i)| / (k d), alpha_TE, alpha_max) reads a small
difference of two large numbers: near the floor, |Q1 - Q2| ~ 0.006 at |Q| ~ 120, so rounding in the critics
shows up in alpha. The gate measures it. For every case (a critic pair at one |Q| level, its disagreement set so
the FP64 alpha sits near the floor, mid-range or near the cap) it evaluates the whole pass -- both heads' layers
(through :meth:`SACFunctions.qed_q_pair <qed_ray.rl.agents.base.SACFunctions.qed_q_pair>`, the training code path),
|Q1 - Q2| over N policy samples per state, the tau-expectile and the clip -- once in FP64 (FP32 weights and
inputs cast exactly) and once per precision of :data:`qed_ray.rl.precision.PRECISIONS`, and compares per state.
**A precision passes when its alpha error -- the mean over states of |alpha - alpha64| / alpha64 -- is at most
twice FP32's own error against FP64 on every case.** The max over states is reported beside it; it is one
state's extreme and too noisy to gate on (at width 128 with 64 states, 3xTF32's max reached 6.5x FP32's where
its mean was 1.7x).

The cases run as one pack: their critics stacked on a leading axis and the pass mapped over it with
``torch.func.vmap``, as a pack maps its seeds; with ``graph`` (CUDA) each precision's pass is captured once in a
CUDA graph and replayed, as a pack's update is.

The critic pairs are built so the heads compute nearly the same function from different weights, as trained twin
critics do: head 2's hidden layers are head 1's scaled (c W) plus a rank-one shift (1 v^T), which the following
LayerNorm removes exactly (up to its eps), so every hidden product rounds independently in the two heads. The
output layers differ only by the disagreement (head 2 = head 1 + rho d), so their weights' own TF32 rounding is
mostly shared and cancels in |Q1 - Q2|: plain TF32's error is, if anything, understated; 3xTF32's weight error (the
rounding of lo) is not shared.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from qed_ray.rl.agents.base import SACFunctions
from qed_ray.spec.config import TemperatureSpec
from qed_ray.rl.networks import TanhGaussianActor, TwinCritic
from qed_ray.rl.precision import PRECISIONS, apply_matmul_precision, qed_products
from qed_ray.rl.temperature import QEDTemperature, expectile, temperature_state

REGIMES = ("floor", "mid", "cap")
TOLERANCE = 2.0  # a precision's alpha error may be at most this multiple of FP32's


@dataclass(frozen=True)
class GateSettings:
    """The gate's critics and QED settings (SAC-LN's critic at the paper's width, cheetah-run's dimensions, the
    paper's N, tau and alpha_max, k = 0.2 and a late-training alpha_TE)."""

    obs_dim: int = 17
    action_dim: int = 6
    hidden: int = 512
    depth: int = 2
    states: int = 256
    n_actions: int = 8
    tau: float = 0.9
    k: float = 0.2
    alpha_te: float = 0.005
    alpha_max: float = 0.2
    q_levels: tuple[float, ...] = (10.0, 40.0, 120.0, 400.0)
    seed: int = 0

    def target(self, regime: str) -> float:
        """The median FP64 alpha before the clip that a case is calibrated to: 1.25 alpha_TE (about 40% of the
        states on the floor), the geometric middle of floor and cap, or 0.8 alpha_max."""
        return {"floor": 1.25 * self.alpha_te, "mid": math.sqrt(self.alpha_te * self.alpha_max),
                "cap": 0.8 * self.alpha_max}[regime]


@dataclass(frozen=True)
class AlphaError:
    """One precision's alpha against FP64 on one case: relative error |alpha - alpha64| / alpha64 over the states
    (mean, max), and the per-head relative Q error (median over the B N rows of |Q1 - Q1_64| / |Q1_64|)."""

    mean: float
    max: float
    q_rel: float


@dataclass(frozen=True)
class CaseResult:
    """One case: its |Q| level and regime, the FP64 reference's |Q| range and alpha, and each precision's error."""

    q_level: float
    regime: str
    q_abs_min: float
    q_abs_max: float
    alpha_mean: float
    frac_floor: float
    frac_cap: float
    errors: dict[str, AlphaError]

    def passes(self, precision: str) -> bool:
        """Whether ``precision``'s mean alpha error is at most :data:`TOLERANCE` x FP32's."""
        return self.errors[precision].mean <= TOLERANCE * self.errors["fp32"].mean


@dataclass(frozen=True)
class GateResult:
    """The gate on one device: every case, and whether a precision passed on all of them."""

    device: str
    emulated: bool
    graph: bool
    settings: GateSettings
    cases: tuple[CaseResult, ...] = field(default_factory=tuple)

    def passed(self, precision: str = "3xtf32") -> bool:
        """``precision`` passed on every case."""
        return all(c.passes(precision) for c in self.cases)

    def table(self) -> str:
        """A markdown table: per case, the FP64 reference and each precision's mean/max alpha error."""
        head = "| abs(Q) | regime | abs(Q) range | alpha64 mean | at floor / cap |"
        rule = "|---:|---|---|---:|---|"
        for p in PRECISIONS:
            head += f" {p} mean / max | {p} Q rel |"
            rule += "---|---:|"
        lines = [head, rule]
        for c in self.cases:
            row = (f"| {c.q_level:g} | {c.regime} | {c.q_abs_min:.3g}-{c.q_abs_max:.3g} | {c.alpha_mean:.4g} | "
                   f"{c.frac_floor:.2f} / {c.frac_cap:.2f} |")
            for p in PRECISIONS:
                e = c.errors[p]
                mark = "" if p == "fp32" else (" ok" if c.passes(p) else " FAIL")
                row += f" {e.mean:.2e} / {e.max:.2e}{mark} | {e.q_rel:.1e} |"
            lines.append(row)
        return "\n".join(lines)

    def to_json(self) -> dict:
        """Plain JSON: the settings, the cases and the verdict per precision."""
        return {"device": self.device, "emulated": self.emulated, "graph": self.graph,
                "settings": asdict(self.settings), "cases": [asdict(c) for c in self.cases],
                "passed": {p: self.passed(p) for p in PRECISIONS if p != "fp32"}, "tolerance": TOLERANCE}


def run_gate(settings: GateSettings = GateSettings(), device: torch.device | str = "cpu",
             emulate: bool | None = None, graph: bool = False) -> GateResult:
    """Builds the cases on ``device`` and measures every precision against FP64 (see the module notes).

    Args:
        settings: critic sizes, QED settings and |Q| levels.
        device: where the passes run.
        emulate: emulate TF32 (None: on every device but CUDA; True on CUDA checks the emulation against FP64 there).
        graph: capture each precision's pass in a CUDA graph and replay it (CUDA only).

    Sets the process-wide matmul precision to FP32 first (:func:`~qed_ray.rl.precision.apply_matmul_precision`), so the
    ``fp32`` row is IEEE FP32 whatever the process had set, and leaves it there.
    """
    device = torch.device(device)
    if graph and device.type != "cuda":
        raise ValueError(f"graph: a CUDA graph needs a CUDA device, not {device}")
    apply_matmul_precision("fp32")
    g = torch.Generator().manual_seed(settings.seed)
    states = torch.randn(settings.states, settings.obs_dim, generator=g)
    actions = _policy_actions(settings, g)
    cases = [(q, r) for q in settings.q_levels for r in REGIMES]
    critics = [gate_critic(settings, q, r, states, actions, g) for q, r in cases]
    stacked = {k: torch.stack([dict(c.named_parameters())[k].detach() for c in critics]).to(device)
               for k, _ in critics[0].named_parameters()}
    states, actions = states.to(device), actions.to(device)
    q64, a64 = _alphas(_GatePass(settings, device, torch.float64), {k: v.double() for k, v in stacked.items()},
                       states.double(), actions.double(), "fp32", None, False)
    gate = _GatePass(settings, device, torch.float32)
    errors: dict[str, list[AlphaError]] = {}
    for p in PRECISIONS:
        q, a = _alphas(gate, stacked, states, actions, p, emulate, graph)
        errors[p] = _errors(q, a, q64, a64)
    floor, cap = settings.alpha_te, settings.alpha_max
    results = tuple(CaseResult(q_level=q, regime=r, q_abs_min=float(q64[i].abs().min()),
                               q_abs_max=float(q64[i].abs().max()), alpha_mean=float(a64[i].mean()),
                               frac_floor=float((a64[i] <= floor).double().mean()),
                               frac_cap=float((a64[i] >= cap).double().mean()),
                               errors={p: errors[p][i] for p in PRECISIONS}) for i, (q, r) in enumerate(cases))
    emulated = device.type != "cuda" if emulate is None else emulate
    return GateResult(str(device), emulated, graph, settings, results)


class _GatePass:
    """The QED pass of the gate's critics, through the training code (:class:`SACFunctions`), on one device and
    dtype, at ``precision`` (``emulate`` None: as a run would; else through :func:`qed_products` with it)."""

    def __init__(self, s: GateSettings, device: torch.device, dtype: torch.dtype):
        critic = TwinCritic(s.obs_dim, s.action_dim, s.hidden, s.depth, "mish")
        actor = TanhGaussianActor(s.obs_dim, s.action_dim, 8, 1, "mish", -5.0, 2.0)  # structure only: never called
        rule = QEDTemperature(s.action_dim, TemperatureSpec(kind="qed", k=s.k, n_actions=s.n_actions, tau=s.tau,
                                                            alpha_max=s.alpha_max, init_alpha=s.alpha_te))
        self.fn, self.n = SACFunctions(actor, critic, rule.to(device, dtype)), s.n_actions
        self.tstate = {k: v.detach() for k, v in temperature_state(self.fn.temperature).items()}
        self.precision, self.emulate = "fp32", None

    def __call__(self, params: dict[str, torch.Tensor], states: torch.Tensor, actions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Q1 [B N], alpha [B])`` of one critic pair."""
        if self.emulate is None:
            self.fn.qed_precision = self.precision
            q1, q2 = self.fn.qed_q_pair(params, states, actions, self.n)
        else:
            with qed_products(self.precision, self.emulate):
                q1, q2 = self.fn.q_pair(params, states, actions, self.n)
        delta = expectile((q1 - q2).abs().reshape(states.shape[0], self.n), self.fn.temperature.tau)
        return q1, self.fn.temperature.alpha(self.tstate, states.shape[0], delta)


def _policy_actions(s: GateSettings, g: torch.Generator) -> torch.Tensor:
    """[B N, A] tanh-Gaussian policy samples, state-major (QED's layout), in FP32: every pass reads these."""
    mu = 0.5 * torch.randn(s.states, s.action_dim, generator=g)
    log_std = -2.0 + 2.0 * torch.rand(s.states, s.action_dim, generator=g)
    eps = torch.randn(s.states * s.n_actions, s.action_dim, generator=g)
    return torch.tanh(mu.repeat_interleave(s.n_actions, 0) + log_std.exp().repeat_interleave(s.n_actions, 0) * eps)


@torch.no_grad()
def _alphas(gate: _GatePass, stacked: dict[str, torch.Tensor], states: torch.Tensor, actions: torch.Tensor,
            precision: str, emulate: bool | None, graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q1 [C, B N], alpha [C, B])`` of the C stacked cases, mapped over the cases (as a pack over its seeds)."""
    gate.precision, gate.emulate = precision, emulate
    mapped = torch.func.vmap(lambda p: gate(p, states, actions), randomness="error")
    if not graph:
        return mapped(stacked)
    side = torch.cuda.Stream(states.device)
    side.wait_stream(torch.cuda.current_stream(states.device))
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up off the capture stream (cuBLAS workspaces, vmap's first-call work)
            mapped(stacked)
    torch.cuda.current_stream(states.device).wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        q1, alpha = mapped(stacked)
    cuda_graph.replay()
    torch.cuda.synchronize(states.device)
    return q1.clone(), alpha.clone()


def _errors(q: torch.Tensor, a: torch.Tensor, q64: torch.Tensor, a64: torch.Tensor) -> list[AlphaError]:
    rel = (a.double() - a64).abs() / a64
    q_rel = ((q.double() - q64).abs() / q64.abs()).median(dim=1).values
    return [AlphaError(float(rel[i].mean()), float(rel[i].max()), float(q_rel[i])) for i in range(len(a64))]


def gate_critic(s: GateSettings, q_level: float, regime: str, states: torch.Tensor, actions: torch.Tensor,
                g: torch.Generator) -> TwinCritic:
    """A FP32 twin critic whose heads agree to the regime's disagreement at mean Q ~ ``q_level`` (module notes).

    Head 1: seeded initialisation, LayerNorm gains in [0.5, 1.5] and offsets ~ N(0, 0.1) (as after training),
    output layer scaled so Q over the gate's inputs has mean ``q_level`` and std ``q_level`` / 4. Head 2: head 1
    with each hidden Linear replaced by (c W + 1 v^T, c b + beta 1) and the output weights moved by rho d, rho
    calibrated in FP64 so the median of Delta / (k d) is :meth:`GateSettings.target`.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=g)))
        critic = TwinCritic(s.obs_dim, s.action_dim, s.hidden, s.depth, "mish").double()
    h1, h2 = critic.q1, critic.q2
    with torch.no_grad():
        for m1, m2 in zip(h1, h2):
            if isinstance(m1, torch.nn.LayerNorm):
                m1.weight.copy_(0.5 + torch.rand(m1.weight.shape, generator=g, dtype=torch.float64))
                m1.bias.copy_(0.1 * torch.randn(m1.bias.shape, generator=g, dtype=torch.float64))
            if isinstance(m1, torch.nn.Linear) and m1 is not h1[-1]:
                c = 0.7 + 0.6 * float(torch.rand((), generator=g))
                v = m1.weight.std() * torch.randn(m1.weight.shape[1], generator=g, dtype=torch.float64)
                beta = m1.bias.std() * float(torch.randn((), generator=g))
                m2.weight.copy_(c * m1.weight + v.unsqueeze(0))
                m2.bias.copy_(c * m1.bias + beta)
            elif not isinstance(m1, torch.nn.Linear):
                m2.load_state_dict(m1.state_dict())
        x, a = states.double(), actions.double()
        hidden = _hidden(h1, x, a, s.n_actions)
        out = h1[-1]
        z = hidden @ out.weight[0]
        scale = q_level / 4 / float(z.std())
        out.weight.mul_(scale)
        out.bias.fill_(q_level - scale * float(z.mean()))
        direction = out.weight.abs().mean() * torch.randn(out.weight.shape, generator=g, dtype=torch.float64)
        rho = 1e-3
        for _ in range(3):  # Delta is close to linear in rho: three rescales land within a few percent
            h2[-1].weight.copy_(out.weight + rho * direction)
            h2[-1].bias.copy_(out.bias)
            q1, q2 = critic(x, a, s.n_actions)
            delta = expectile((q1 - q2).abs().reshape(len(x), s.n_actions), s.tau)
            rho *= s.target(regime) / float((delta / (s.k * s.action_dim)).median())
        h2[-1].weight.copy_(out.weight + rho * direction)
    return critic.float()


def _hidden(head: torch.nn.Sequential, x: torch.Tensor, a: torch.Tensor, n: int) -> torch.Tensor:
    """The last hidden layer's output [B N, H] of one head (everything but its output layer)."""
    h = torch.cat([x.repeat_interleave(n, 0), a], -1)
    for layer in list(head)[:-1]:
        h = layer(h)
    return h
