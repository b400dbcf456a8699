"""A pack: the S members of one (task, agent, temperature kind, network shape) trained as one batched computation
(docs/design.md, "The packed update")."""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import numpy as np
import torch

from qed_ray.rl.agents.base import Params, SACBase, draw_noise
from qed_ray.rl.networks import make_adam, per_seed_clip_, polyak_lerp_

TARGET, TEMPERATURE = "critic_target", "temperature"
RECOMPILE_LIMIT = 64  # compiled per-seed functions per process (compile_losses)


def host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy that later training steps cannot change (checkpoints are written from such copies)."""
    return t.detach().to("cpu", copy=True)


def slice_optimizer_state(state: dict, i: int) -> dict:
    """Seed ``i``'s optimiser ``state_dict`` from a pack optimiser's: moments sliced, the shared ``step`` copied."""
    per_param = {idx: {k: host(v) if k == "step" else host(v[i]) for k, v in entry.items()}
                 for idx, entry in state["state"].items()}
    return {"state": per_param, "param_groups": copy.deepcopy(state["param_groups"])}


def stack_optimizer_states(states: Sequence[dict]) -> dict:
    """Inverse of :func:`slice_optimizer_state` over the S seeds (all must have taken the same steps)."""
    first = states[0]
    if any(set(s["state"]) != set(first["state"]) for s in states):
        raise ValueError("optimiser state: some seeds have taken steps that others have not; a pack's seeds step "
                         "together")
    stacked = {}
    for idx, entry in first["state"].items():
        stacked[idx] = {}
        for key, value in entry.items():
            values = [s["state"][idx][key] for s in states]
            if key == "step":
                if any(not torch.equal(v, value) for v in values):
                    raise ValueError(f"optimiser state: the seeds took different numbers of steps "
                                     f"({[float(v) for v in values]}); a pack's seeds step together")
                stacked[idx][key] = value.clone()
            else:
                stacked[idx][key] = torch.stack(values)
    return {"state": stacked, "param_groups": copy.deepcopy(first["param_groups"])}


def _tensors_map(f: Callable, tree):
    """``f`` on every tensor of nested dicts, tuples and lists (a loss function's arguments and results); anything
    else as it is. The few container types of a pack's losses, without pytree's generic flatten and unflatten."""
    if isinstance(tree, torch.Tensor):
        return f(tree)
    if isinstance(tree, dict):
        return {k: _tensors_map(f, v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_tensors_map(f, v) for v in tree)
    return tree


def _one_seed(fn: Callable) -> Callable:
    """``vmap(fn)`` over a seed axis of length 1, without vmap: ``fn`` on each input's only slice, its outputs given
    the axis back. The same numbers up to rounding, but plain (not batched) kernels and no per-call vmap wrapping:
    eager vmap over one seed costs about 15% of a CPU update (linear and layer norm through their batching rules).
    The slice is ``squeeze(0)``, a view whose gradient is a view too (``x[0]``'s backward would allocate and fill a
    zero tensor of every stacked parameter each update)."""
    def mapped(*args):
        out = fn(*_tensors_map(lambda x: x.squeeze(0), args))
        return _tensors_map(lambda x: x.unsqueeze(0), out)
    return mapped


class PackedAgent:
    """S seeds of one agent: stacked tensors, one vmapped update, per-seed noise and state.

    ``agents``: S single-seed agents of one spec, temperature (its member scalars aside), dims and device, in pack
    order; the first is the template whose modules give the functions their structure.
    """

    def __init__(self, agents: Sequence[SACBase]):
        self.template = t = agents[0]
        _check_alike(agents)
        self.n, self.name, self.spec, self.device = len(agents), t.name, t.spec, t.device
        self.acting_modules, self.metric_layout, self.action_dim = t.acting_modules, t.metric_layout, t.action_dim
        self.generators = [a.generator for a in agents]
        self.state: dict[str, dict[str, torch.Tensor]] = {
            m: {k: torch.stack([a.modules()[m].state_dict()[k] for a in agents]).detach() for k in mod.state_dict()}
            for m, mod in t.modules().items()}
        self.param_names = {m: [n for n, _ in mod.named_parameters()] for m, mod in t.modules().items()}
        self.opts, self._opt_leaves = self._build_optimizers()
        self.updates = t.updates
        self.memo = {k: torch.stack([a.memo[k] for a in agents]) for k in t.memo}
        # Per-member temperature scalars the rule reads from its state but never checkpoints (QED's scale, alpha_max).
        self.settings = {k: torch.stack([_settings(a)[k] for a in agents]) for k in _settings(t)}
        self._frozen: dict[int, list[torch.Tensor]] = {}
        self._compiled: dict[Callable, Callable] | None = None  # compile_losses()
        self.load_seed_state_dicts([None if not any(o.state for o in a.optimizers().values()) else a.state_dict()
                                    for a in agents])
        for i, a in enumerate(agents):  # each slice is exactly the seeded single-seed agent
            for m, mod in a.modules().items():
                for k, v in mod.state_dict().items():
                    if not torch.equal(self.state[m][k][i], v):
                        raise AssertionError(f"pack slice {i} of {m}.{k} differs from its seed's module")

    def _build_optimizers(self) -> tuple[dict[str, torch.optim.Optimizer], dict[str, list[torch.Tensor]]]:
        owner = {id(p): (m, n) for m, mod in self.template.modules().items() for n, p in mod.named_parameters()}
        opts, leaves = {}, {}
        for name, opt in self.template.optimizers().items():
            (group,) = opt.param_groups
            leaves[name] = [self.state[m][n].requires_grad_(True) for m, n in (owner[id(p)] for p in group["params"])]
            opts[name] = make_adam(leaves[name], group["lr"], self.device)
        return opts, leaves

    # ---- the Learner interface -------------------------------------------------------------------------
    def params(self) -> dict[str, Params]:
        out = {m: {n: self.state[m][n] for n in names} for m, names in self.param_names.items()
               if m not in (TARGET, TEMPERATURE)}
        out[TEMPERATURE] = {**self.state[TEMPERATURE], **self.settings}
        return out

    def target_params(self) -> Params:
        return {n: self.state[TARGET][n] for n in self.param_names[TARGET]}

    def per_seed(self, fn: Callable) -> Callable:
        """``fn`` mapped over the leading seed axis (a random draw inside raises); compiled once per ``fn`` after
        :meth:`compile_losses`."""
        if self._compiled is not None and fn in self._compiled:
            return self._compiled[fn]
        mapped = _one_seed(fn) if self.n == 1 else torch.func.vmap(fn, randomness="error")
        if self._compiled is None:
            return mapped
        # A pack of one compiles the vmap-free form too: plain mm/addmm kernels, fewer guards per call.
        self._compiled[fn] = torch.compile(mapped)
        return self._compiled[fn]

    def compile_losses(self) -> None:
        """From now on every per-seed function (losses, their backward, metrics) runs ``torch.compile``d; the
        optimiser steps, per-seed clip and Polyak stay the eager multi-tensor kernels (compiling the optimiser
        costs minutes of inductor time per agent and saves little: it is already one fused kernel per group)."""
        if self._compiled is None:
            self._compiled = {}
            # Every mapped function shares one wrapper code object (functorch's or _one_seed's), and dynamo counts
            # recompilations per code object: with the default limit (8) later functions would silently run eager.
            limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            torch._dynamo.config.recompile_limit = limit

    def step(self, loss: torch.Tensor, *groups: tuple[str, float | None]) -> list[torch.Tensor]:
        for name, _ in groups:  # zero_grad(set_to_none=True) without its per-call wrapper (~0.1 ms a group)
            for p in self._opt_leaves[name]:
                p.grad = None
        loss.sum().backward()
        norms = [per_seed_clip_([p.grad for p in self._opt_leaves[name]], clip)
                 for name, clip in groups if clip is not None]
        for name, _ in groups:
            self.opts[name].step()
        return norms

    def polyak(self, rate: float) -> None:
        names = self.param_names[TARGET]
        polyak_lerp_([self.state[TARGET][n] for n in names], [self.state["critic"][n] for n in names], rate)

    # ---- learning and acting ---------------------------------------------------------------------------
    def noise(self, batch_size: int, active: np.ndarray) -> torch.Tensor:
        """[S, R, A] update noise, seed s's block from its own generator; zeros (and no draw) for a stopped seed."""
        return self._per_seed_noise(self.template.noise_rows(batch_size), active)

    def update(self, batch: dict[str, torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
        """One update of every seed from obs [S, B, O], action [S, B, A], reward, terminated [S, B], next_obs and
        noise [S, R, A]; [S, K] metrics (a stopped seed's row is meaningless)."""
        metrics = self.learn(batch, noise)
        self.hold_frozen()
        return metrics

    def learn(self, batch: dict[str, torch.Tensor], noise: torch.Tensor) -> torch.Tensor:
        """:meth:`update` without holding stopped seeds: only in-place device work, no host sync, so a CUDA graph
        can capture it; the caller holds stopped seeds afterwards (:meth:`hold_frozen`)."""
        parts = noise.split(self.template.fn.noise_sizes(batch["obs"].shape[1]), dim=1)
        return self.template.learn(self, batch, parts)

    @torch.no_grad()
    def act(self, obs: np.ndarray, active: np.ndarray) -> np.ndarray:
        """Policy samples [S, A] for observations [S, O]; noise [1, A] per active seed from its generator."""
        eps = self._per_seed_noise(1, active)
        x = torch.as_tensor(obs, dtype=torch.float32, device=self.device).unsqueeze(1)
        return self.per_seed(self.template.sample_with)(self._acting_params(), x, eps)[:, 0].cpu().numpy()

    @torch.no_grad()
    def act_deterministic(self, obs: np.ndarray) -> np.ndarray:
        """tanh(mu) [S, N, A] at observations [S, N, O] (seed s's policy on row s): one forward."""
        x = torch.as_tensor(obs, dtype=torch.float32, device=self.device)
        return self.per_seed(self.template.mode_with)(self._acting_params(), x).cpu().numpy()

    @torch.no_grad()
    def distribution(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pre-tanh ``(mu, sigma)`` [S, N, A] at observations [S, N, O], float64 numpy (the KL metric, App. E)."""
        x = torch.as_tensor(obs, dtype=self.dtype, device=self.device)
        mu, log_std = self.per_seed(self.template.policy_with)(self._acting_params(), x)
        return mu.double().cpu().numpy(), log_std.exp().double().cpu().numpy()

    @torch.no_grad()
    def q_values(self, obs: np.ndarray, action: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Online ``(Q1, Q2)`` [S, N] at observations [S, N, O] and actions [S, N, A] (critic proxy, App. D)."""
        x = torch.as_tensor(obs, dtype=self.dtype, device=self.device)
        a = torch.as_tensor(action, dtype=self.dtype, device=self.device)
        q1, q2 = self.per_seed(self.template.q_with)(self.params(), x, a)
        return q1.cpu().numpy(), q2.cpu().numpy()

    def _acting_params(self) -> dict[str, Params]:
        p = self.params()
        return {m: p[m] for m in self.acting_modules}

    @property
    def dtype(self) -> torch.dtype:
        return self.state["actor"][self.param_names["actor"][0]].dtype

    def _per_seed_noise(self, rows: int, active: np.ndarray) -> torch.Tensor:
        dtype = self.dtype
        zeros = torch.zeros((rows, self.action_dim), device=self.device, dtype=dtype)
        return torch.stack([draw_noise(g, rows, self.action_dim, dtype) if on else zeros
                            for g, on in zip(self.generators, active)])

    # ---- stopping a seed -------------------------------------------------------------------------------
    def freeze(self, i: int) -> None:
        """Stops seed ``i``: its parameters, target and memo keep their values from now on (its gradients and
        moments may go on being computed, but nothing of it moves or reaches another seed)."""
        if i not in self._frozen:
            self._frozen[i] = [t[i].detach().clone() for t in self._stacked()]

    def _stacked(self) -> list[torch.Tensor]:
        return [t for m in self.state.values() for t in m.values()] + list(self.memo.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor that defines the pack by name: parameters, buffers, memo and the optimisers' moments (their
        step counters aside): what two packs must share to train alike."""
        out = {f"{m}.{k}": v for m, sd in self.state.items() for k, v in sd.items()}
        out.update({f"memo.{k}": v for k, v in self.memo.items()})
        for name, opt in self.opts.items():
            for i, p in enumerate(opt.param_groups[0]["params"]):
                out.update({f"{name}.{i}.{k}": v for k, v in opt.state[p].items() if k != "step"})
        return out

    @torch.no_grad()
    def hold_frozen(self) -> None:
        """Puts every stopped seed's tensors back to their values at :meth:`freeze` (after :meth:`learn`)."""
        for i, values in self._frozen.items():
            for t, v in zip(self._stacked(), values):
                t[i] = v

    # ---- per-seed state in the single-seed layout --------------------------------------------------------
    def seed_state_dict(self, i: int) -> dict:
        """Seed ``i``'s state in its single-seed agent's ``state_dict`` layout, as CPU copies."""
        state = {m: {k: host(v[i]) for k, v in sd.items()} for m, sd in self.state.items()}
        state.update({name: slice_optimizer_state(opt.state_dict(), i) for name, opt in self.opts.items()})
        state["generator"] = self.generators[i].get_state()
        memo = {k: v[i] for k, v in self.memo.items()}
        state.update({k: host(v) for k, v in self.template.learner_state(self.updates, memo).items()})
        return state

    def module_state_dicts(self, i: int, names: Sequence[str]) -> dict[str, dict[str, torch.Tensor]]:
        """Seed ``i``'s ``state_dict`` of the modules ``names`` (a policy snapshot), as CPU copies."""
        unknown = sorted(set(names) - set(self.state))
        if unknown:
            raise ValueError(f"modules: {unknown} are not modules of {self.name} ({sorted(self.state)})")
        return {m: {k: host(v[i]) for k, v in self.state[m].items()} for m in names}

    @torch.no_grad()
    def load_seed_state_dicts(self, states: Sequence[dict | None]) -> None:
        """Loads S single-seed states (``state_dict`` layout) into the pack; None keeps that seed as it is."""
        if len(states) != self.n:
            raise ValueError(f"states: {len(states)} given for a pack of {self.n} seeds")
        given = [(i, s) for i, s in enumerate(states) if s is not None]
        if not given:
            return
        for i, s in given:
            for m, sd in self.state.items():
                for k, v in sd.items():
                    v[i] = s[m][k].to(v.device, v.dtype)
            self.generators[i].set_state(s["generator"])
        for name, opt in self.opts.items():
            current = opt.state_dict()
            # A seed given no state keeps its moments; if it has none yet (a stopped seed that never reached a
            # checkpoint), it takes a given seed's: it is frozen, so they never move anything.
            keep = [slice_optimizer_state(current, i) if current["state"] else given[0][1][name]
                    for i in range(self.n)]
            opt.load_state_dict(stack_optimizer_states([s[name] if s is not None else k
                                                        for s, k in zip(states, keep)]))
        learner = [self.template.read_learner_state(s) for _, s in given]
        counts = sorted({u for u, _ in learner})
        if len(counts) > 1:
            raise ValueError(f"states: the seeds' update counters differ ({counts}); a pack's seeds update together")
        self.updates = counts[0]
        for (i, _), (_, memo) in zip(given, learner):
            for k, v in memo.items():
                self.memo[k][i] = v.to(self.memo[k].device)


def _settings(agent: SACBase) -> dict[str, torch.Tensor]:
    """The temperature buffers outside its ``state_dict`` (per-member settings a run spec gives)."""
    kept = agent.temperature.state_dict()
    return {k: b for k, b in agent.temperature.named_buffers() if k not in kept}


def _check_alike(agents: Sequence[SACBase]) -> None:
    t = agents[0]
    for i, a in enumerate(agents[1:], 1):
        if type(a) is not type(t) or a.spec != t.spec or a.device != t.device or a.action_dim != t.action_dim:
            raise ValueError(f"pack: agent {i} ({a.name}, {a.device}) differs from agent 0 ({t.name}, {t.device}) "
                             f"in type, spec, device or dims; a pack holds seeds of one configuration")
        mine, theirs = a.temperature_spec.shared(), t.temperature_spec.shared()
        if mine != theirs:
            diff = ", ".join(f"temperature.{k}" for k in mine if mine[k] != theirs[k])
            raise ValueError(f"pack: agent {i} differs from agent 0 in {diff}; a pack's members may differ only in "
                             f"temperature.{', temperature.'.join(a.temperature_spec.MEMBER_FIELDS)}")
        for m, mod in t.modules().items():
            if m == TEMPERATURE:
                continue  # passed to every function explicitly, per seed
            for k, b in mod.named_buffers():
                if not torch.equal(b, dict(a.modules()[m].named_buffers())[k]):
                    raise ValueError(f"pack: buffer {m}.{k} differs between seeds 0 and {i}; the functions read "
                                     f"the template's buffers, so they must be equal")
