"""Behaviour figure of a finished sweep (paper Fig. 1, Sec. 6.2 'Visual similarity'): ``qed-ray visualize`` (its command
and MLflow upload: :mod:`qed_ray.service.behaviour_cli`; its outputs and rendering: docs/results.md, "Behaviour
figure")."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Mapping, MutableMapping, Sequence

import numpy as np

from qed_ray.records.atomic import write_json
from qed_ray.records.layout import SweepDir
from qed_ray.analysis.metrics import per_step_pairwise_distance

GL_DISABLED = ("off", "disable", "disabled", "false", "0")  # dm_control's names for "no renderer"
GL_HEADLESS = ("egl", "osmesa")  # tried in this order when MUJOCO_GL is unset
COLORMAP = "coolwarm"  # blue = low spread, red = high (Fig. 1 caption)
COLORBAR_LABEL = "mean pairwise L2 state distance"
GIF_MS_PER_STEP = 200


class RenderError(RuntimeError):
    """No usable headless OpenGL backend; the message says what to set or install."""


# ---- rendering backend ---------------------------------------------------------------------------------
def _probe_backend(backend: str) -> bool:
    """Whether a ``backend`` OpenGL context can be made; tried in a child, as a process's choice is final."""
    env = {**os.environ, "MUJOCO_GL": backend, "PYOPENGL_PLATFORM": backend}
    code = "from dm_control._render import Renderer; Renderer(8, 8).free()"
    try:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def choose_gl_backend(environ: Mapping[str, str], probe: Callable[[str], bool] = _probe_backend) -> str:
    """``MUJOCO_GL`` from ``environ``, else the first of :data:`GL_HEADLESS` that ``probe`` accepts; RenderError if
    ``MUJOCO_GL`` turns rendering off or no headless backend works."""
    requested = environ.get("MUJOCO_GL", "").strip().lower()
    if requested in GL_DISABLED:
        raise RenderError(f"MUJOCO_GL={requested!r} turns rendering off; unset it or set MUJOCO_GL to one of "
                          f"{', '.join(GL_HEADLESS)}")
    if requested:
        return requested
    for backend in GL_HEADLESS:
        if probe(backend):
            return backend
    raise RenderError("no headless OpenGL backend works: EGL needs libegl1 and libgl1-mesa-dri, OSMesa needs "
                      "libosmesa6 (apt-get install -y libosmesa6), or set MUJOCO_GL explicitly")


def configure_rendering(environ: MutableMapping[str, str]) -> str:
    """Exports the chosen backend (``MUJOCO_GL``, ``PYOPENGL_PLATFORM``) before dm_control's first import; returns it.
    RenderError as :func:`choose_gl_backend`, or if dm_control was already imported with rendering off."""
    loaded = sys.modules.get("dm_control._render")
    if loaded is not None:
        if loaded.BACKEND is None or loaded.BACKEND in GL_DISABLED:
            raise RenderError(f"dm_control was already imported with MUJOCO_GL={environ.get('MUJOCO_GL')!r} "
                              f"(rendering off); run this in a fresh process with MUJOCO_GL=egl")
        return loaded.BACKEND
    backend = choose_gl_backend(environ)
    environ["MUJOCO_GL"] = backend
    if backend in GL_HEADLESS:
        environ.setdefault("PYOPENGL_PLATFORM", backend)  # PyOpenGL must load the same platform as MuJoCo
    return backend


# ---- sweep folder -----------------------------------------------------------------------------------------
def _require(arg: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:  # name the argument and list what the sweep has
        raise ValueError(f"{arg}: {value!r} is not in this sweep; it has: {', '.join(allowed) or 'nothing'}")


def select_snapshots(sweep_dir: Path, task: str, agent: str,
                     variants: Sequence[str] | None) -> dict[str, list[tuple[int, Path]]]:
    """``{variant: [(seed, final snapshot dir), ...]}``, seeds ascending; ``variants=None``: all, ``te`` first.
    ValueError on a task, agent or variant the sweep lacks (listing what it has) or fewer than 2 seeds."""
    layout = SweepDir(sweep_dir)
    trials = layout.trials()
    _require("--task", task, sorted({t.task for t in trials}))
    of_task = [t for t in trials if t.task == task]
    _require("--agent", agent, sorted({t.agent for t in of_task}))
    of_agent = sorted((t for t in of_task if t.agent == agent), key=lambda t: t.seed)
    available = sorted({t.variant for t in of_agent}, key=lambda v: (v != "te", v))
    for v in variants or ():
        _require("--variants", v, available)
    out = {}
    for v in dict.fromkeys(variants) if variants else available:
        out[v] = [(t.seed, layout.final_snapshot(t.name)) for t in of_agent if t.variant == v]
        if len(out[v]) < 2:
            raise ValueError(f"--variants: {task} {agent} {v} has {len(out[v])} seed(s); the state spread compares "
                             f"seeds, so it needs at least 2")
    return out


# ---- rollouts and spread -------------------------------------------------------------------------------
def rollout_states(snapshots: Sequence[Path], task: str, steps: int, env_seed: int) -> np.ndarray:
    """float64 [P, L=steps, D] state vectors (qpos, qvel, act) before each decision of each snapshot's policy.

    Every policy starts from env seed ``env_seed``'s initial state and acts deterministically.
    """
    from qed_ray.rl.agents import load_policies
    from qed_ray.rl.env_pool import EnvPool
    from qed_ray.rl.evaluate import rollout_lockstep

    pack, manifests = load_policies(snapshots, "cpu")
    skips = {m.run.train.frame_skip for m in manifests}
    if len(skips) != 1:
        raise ValueError(f"--variants: the seeds' policies were trained with different frame skips {sorted(skips)}")
    with EnvPool(task, [env_seed] * pack.n, skips.pop()) as pool:
        rolls = rollout_lockstep(pack.act_deterministic, pool, np.arange(pack.n)[:, None], [env_seed],
                                 max_decisions=steps, record_physics=True)
    states = rolls.physics_states[:, 0].astype(np.float64)
    if states.shape[1] != steps:
        raise ValueError(f"--steps: {steps} is longer than an episode ({states.shape[1]} decisions)")
    return states


def state_spread(states) -> np.ndarray:
    """Per-step state spread (Fig. 1 colour): states [P >= 2, L, D] -> float64 [L] mean pairwise L2 distance."""
    arr = np.asarray(states, dtype=np.float64)
    if arr.ndim != 3:
        raise ValueError(f"states: expected shape (P, L, D), got {arr.shape}")
    return per_step_pairwise_distance(arr[:, None])[0]


def spread_colors(spread, vmin: float, vmax: float) -> np.ndarray:
    """Spread [L] -> RGBA [L, 4] on :data:`COLORMAP`, ``vmin`` blue, ``vmax`` red (all blue if they are equal)."""
    import matplotlib

    s = np.asarray(spread, dtype=np.float64)
    if s.ndim != 1 or not vmin <= vmax:
        raise ValueError(f"spread, vmin, vmax: need shape (L,) and vmin <= vmax, got {s.shape}, {vmin}, {vmax}")
    scaled = np.clip((s - vmin) / (vmax - vmin), 0.0, 1.0) if vmax > vmin else np.zeros_like(s)
    return matplotlib.colormaps[COLORMAP](scaled)


def frame_steps(steps: int, frames: int) -> np.ndarray:
    """[F] evenly spaced step indices in [0, steps - 1], first and last included."""
    if not 1 <= frames <= steps:
        raise ValueError(f"--frames: need 1 <= frames <= steps ({steps}), got {frames}")
    return np.unique(np.linspace(0, steps - 1, frames).round().astype(int))


# ---- rendering and figures -------------------------------------------------------------------------------
def _plain_scene(physics, scene) -> None:
    """Shadows and reflections off: about 4x faster software rendering (llvmpipe)."""
    import mujoco

    scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
    scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0


def render_states(task: str, states, steps: Sequence[int], size: int) -> np.ndarray:
    """Renders states [L, D] at indices ``steps`` [F] with camera 0 -> uint8 [F, size, size, 3].

    Needs :func:`configure_rendering` first (a backend other than "disable").
    """
    from qed_ray.rl.envs import make_env

    arr = np.asarray(states, dtype=np.float64)
    env = make_env(task, seed=0)  # the seed is irrelevant: every frame's state is overwritten
    try:
        physics = env.physics
        if arr.ndim != 2 or arr.shape[1] != physics.get_state().shape[0]:
            raise ValueError(f"states: expected shape (L, {physics.get_state().shape[0]}) for {task}, got {arr.shape}")
        frames = []
        for t in steps:
            physics.set_state(arr[t])
            physics.forward()  # positions (and tracking cameras) follow qpos only after forward kinematics
            frames.append(physics.render(size, size, camera_id=0, scene_callback=_plain_scene))
    finally:
        env.close()
    return np.stack(frames)


def with_border(frames, color) -> np.ndarray:
    """Frames [..., H, W, 3] in a b-pixel RGBA ``color`` border -> uint8 [..., H+2b, W+2b, 3], b = max(2, H // 16)."""
    arr = np.asarray(frames)
    h, w = arr.shape[-3:-1]
    width = max(2, h // 16)  # visible at any frame size
    rgb = np.round(np.asarray(color, dtype=np.float64)[:3] * 255).astype(np.uint8)
    out = np.empty(arr.shape[:-3] + (h + 2 * width, w + 2 * width, 3), dtype=np.uint8)
    out[...] = rgb
    out[..., width:-width, width:-width, :] = arr
    return out


def compose_figure(frames, steps: Sequence[int], colors, vmin: float, vmax: float, seeds: Sequence[int],
                   title: str):
    """Fig. 1 panel (a matplotlib ``Figure``, no pyplot state) from frames uint8 [P, F, H, W, 3]: rows = ``seeds`` [P],
    columns = ``steps`` [F], each frame bordered in its ``colors`` [F, 4] RGBA, and a colour bar."""
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    arr = np.asarray(frames)
    if arr.ndim != 5 or len(steps) != arr.shape[1] or len(colors) != arr.shape[1] or len(seeds) != arr.shape[0]:
        raise ValueError(f"frames, steps, colors, seeds: need frames (P, F, H, W, 3) with len(steps) = len(colors) "
                         f"= F and len(seeds) = P; got {arr.shape}, {len(steps)}, {len(colors)}, {len(seeds)}")
    n_seeds, n_frames = arr.shape[:2]
    fig = Figure(figsize=(1.3 * n_frames + 1.5, 1.3 * n_seeds + 0.8), layout="constrained")
    axes = fig.subplots(n_seeds, n_frames, squeeze=False)
    for p in range(n_seeds):
        for f in range(n_frames):
            ax = axes[p, f]
            ax.imshow(with_border(arr[p, f], colors[f]))
            ax.set_xticks([]), ax.set_yticks([])
            ax.spines[:].set_visible(False)
            if p == 0:
                ax.set_title(f"t = {steps[f]}", fontsize=8)
            if f == 0:
                ax.set_ylabel(f"seed {seeds[p]}", fontsize=8)
    norm = Normalize(vmin, vmax if vmax > vmin else vmin + 1e-12)
    fig.colorbar(ScalarMappable(norm, COLORMAP), ax=axes, label=COLORBAR_LABEL, shrink=0.9)
    fig.suptitle(title, fontsize=9, wrap=True)  # wrapped to the figure width: a strip of few frames is narrow
    return fig


def gif_strip(frames, colors) -> np.ndarray:
    """Frames uint8 [P, L, H, W, 3], colors [L, 4] -> uint8 [L, H', P * W', 3]: bordered seeds side by side."""
    arr = np.asarray(frames)
    bordered = np.stack([with_border(arr[:, t], colors[t]) for t in range(arr.shape[1])])  # [L, P, H', W', 3]
    n_steps, n_seeds, h, w, _ = bordered.shape
    return bordered.transpose(0, 2, 1, 3, 4).reshape(n_steps, h, n_seeds * w, 3)


def write_gif(path: Path, frames) -> Path:
    """Writes uint8 [L, H, W, 3] as a looping GIF with Pillow (a matplotlib dependency, so always installed)."""
    from PIL import Image

    images = [Image.fromarray(np.asarray(f, dtype=np.uint8)) for f in frames]
    images[0].save(path, save_all=True, append_images=images[1:], duration=GIF_MS_PER_STEP, loop=0)
    return path


# ---- the command -------------------------------------------------------------------------------------------
def write_variant(out: Path, stem: str, title: str, states, frames, spread, vmin: float, vmax: float,
                  shown, seeds: Sequence[int]) -> list[Path]:
    """Writes ``<stem>.png``, ``.gif`` and ``.npz`` from states [P, L, D], frames uint8 [P, L, H, W, 3], spread [L]."""
    colors = spread_colors(spread, vmin, vmax)
    fig = compose_figure(frames[:, shown], shown, colors[shown], vmin, vmax, seeds, title)
    png = out / f"{stem}.png"
    fig.savefig(png, dpi=120)
    gif = write_gif(out / f"{stem}.gif", gif_strip(frames, colors))
    npz = out / f"{stem}.npz"
    np.savez_compressed(npz, states=states, spread=spread, colors=colors, frame_steps=shown)
    return [png, gif, npz]


def run(args: argparse.Namespace, selected: dict[str, list[tuple[int, Path]]], shown, meta: dict) -> list[Path]:
    """Rolls out, renders and writes every selected variant, then the JSON summary; returns the files written."""
    states = {v: rollout_states([d for _, d in sel], args.task, args.steps, args.seed) for v, sel in selected.items()}
    spreads = {v: state_spread(s) for v, s in states.items()}
    # One colour range for every variant, so equal colours mean equal spread across the panels (Fig. 1).
    vmin, vmax = min(float(s.min()) for s in spreads.values()), max(float(s.max()) for s in spreads.values())
    out = args.out or SweepDir(args.sweep_dir).behaviour
    out.mkdir(parents=True, exist_ok=True)
    paths, summary = [], {}
    for v, st in states.items():
        seeds = [s for s, _ in selected[v]]
        frames = np.stack([render_states(args.task, x, range(args.steps), args.size) for x in st])
        title = f"{args.task} {args.agent} {v}: {len(seeds)} seeds from env seed {args.seed}'s initial state"
        stem = f"behaviour_{args.task}_{args.agent}_{v}"
        paths += write_variant(out, stem, title, st, frames, spreads[v], vmin, vmax, shown, seeds)
        summary[v] = {"seeds": seeds, "snapshots": [str(d) for _, d in selected[v]], "spread": spreads[v].tolist(),
                      "spread_sum": float(spreads[v].sum())}
    paths.append(out / f"behaviour_{args.task}_{args.agent}.json")
    write_json(paths[-1], {**meta, "vmin": vmin, "vmax": vmax, "variants": summary}, indent=1)
    return paths
