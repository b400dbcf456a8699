"""Behaviour figure (paper Fig. 1): spread maths, colours, figure borders, and the CLI on a tiny sweep folder.

The CLI runs in a child process without ``MUJOCO_GL`` (so it picks a headless backend itself): conftest turns
rendering off in this process, and dm_control fixes its backend at its first import.
"""

import itertools
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from qed_ray.analysis import behaviour as vis
from qed_ray.service import behaviour_cli as cli
from qed_ray.records.layout import SweepDir

ROOT = Path(__file__).resolve().parents[2]
TASK = "cheetah-run"
VARIANTS = {"te": {"kind": "te"}, "qed0.2": {"kind": "qed", "k": 0.2}}
SEEDS = (0, 1, 2)
EARLY, FINAL = 1000, 2000
STEPS, FRAMES, SIZE = 10, 4, 48


def naive_spread(states: np.ndarray) -> np.ndarray:
    """Mean over seed pairs of the L2 distance at each step, with plain loops. states [P, L, D] -> [L]."""
    out = []
    for t in range(states.shape[1]):
        pairs = [np.sqrt(np.sum((states[i, t] - states[j, t]) ** 2))
                 for i, j in itertools.combinations(range(states.shape[0]), 2)]
        out.append(sum(pairs) / len(pairs))
    return np.asarray(out)


def redness(rgb) -> float:
    """Position in [0, 1] of an RGB colour (0-255) along coolwarm: 0 = its blue end, 1 = its red end."""
    ramp = matplotlib.colormaps["coolwarm"](np.linspace(0.0, 1.0, 1001))[:, :3] * 255
    return float(np.argmin(np.sum((ramp - np.asarray(rgb, dtype=float)[:3]) ** 2, axis=1)) / 1000)


def save_policy(layout: SweepDir, spec, step: int, init_seed: int, dims: tuple[int, int]) -> None:
    """A policy snapshot where the sweep writes it, with weights initialised from ``init_seed``."""
    from qed_ray.rl.agents import make_agent
    from qed_ray.records.checkpoint import new_manifest, save_checkpoint

    agent = make_agent(spec.agent, spec.temperature, *dims, torch.device("cpu"), init_seed)
    manifest = new_manifest(task=spec.task, agent=spec.agent.name, variant=spec.variant, seed=spec.seed,
                            obs_dim=dims[0], action_dim=dims[1], env_steps=step, run=spec)
    save_checkpoint(layout.snapshot(spec.name, step), {k: m.state_dict() for k, m in agent.modules().items()},
                    manifest)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """``tiny-sweep/``: 2 variants x 3 seeds of tiny SAC-LN policies on cheetah-run, each with an older decoy."""
    from qed_ray.spec.config import RunSpec
    from qed_ray.rl.envs import make_env

    root = tmp_path_factory.mktemp("vis") / "tiny-sweep"
    layout = SweepDir(root)
    env = make_env(TASK, 0)
    dims = (env.obs_dim, env.action_dim)
    env.close()
    for variant, temperature in VARIANTS.items():
        for seed in SEEDS:
            spec = RunSpec.model_validate({"task": TASK, "seed": seed, "temperature": temperature,
                                           "agent": {"hidden": 16, "batch_size": 16}})
            save_policy(layout, spec, EARLY, 50 + seed, dims)  # must be ignored: not the final snapshot
            save_policy(layout, spec, FINAL, seed + (0 if variant == "te" else 100), dims)
            layout.done_marker(spec.name).write_text("{}")
    layout.state_file.write_text(json.dumps({"sweep_id": "0123456789ab", "fingerprint": "f", "created": 0}))
    return root


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``main(argv)`` in a fresh process with no rendering backend or MLflow URI preset."""
    env = {k: v for k, v in os.environ.items() if k not in ("MUJOCO_GL", "PYOPENGL_PLATFORM", "MLFLOW_TRACKING_URI")}
    code = "import sys; from qed_ray.cli import main; sys.exit(main([\"visualize\", *sys.argv[1:]]))"
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def behaviour(sweep, tmp_path_factory) -> tuple[Path, dict]:
    """Output folder and JSON summary of one CLI run over both variants."""
    out = tmp_path_factory.mktemp("behaviour")
    proc = run_cli(sweep, "--task", TASK, "--steps", STEPS, "--frames", FRAMES, "--size", SIZE, "--out", out,
                   "--no-mlflow")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, json.loads((out / f"behaviour_{TASK}_sac_ln.json").read_text())


def gif_frames(path: Path) -> list[np.ndarray]:
    with Image.open(path) as im:
        return [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(im)]


# ---- pure functions ---------------------------------------------------------------------------------------
def test_state_spread_is_mean_pairwise_l2():
    rng = np.random.default_rng(0)
    states = rng.normal(size=(4, 7, 5))
    np.testing.assert_allclose(vis.state_spread(states), naive_spread(states), rtol=1e-12)
    same = np.repeat(states[:1], 3, axis=0)
    assert np.all(vis.state_spread(same) == 0.0)
    two = np.zeros((2, 1, 2))
    two[1, 0] = [3.0, 4.0]
    assert vis.state_spread(two).tolist() == [5.0]
    with pytest.raises(ValueError, match="states"):
        vis.state_spread(states[0])


def test_spread_colors_blue_to_red_on_the_given_scale():
    cmap = matplotlib.colormaps["coolwarm"]
    colors = vis.spread_colors([0.0, 0.5, 1.0, 2.0, 5.0], vmin=0.0, vmax=2.0)
    assert colors.shape == (5, 4)
    np.testing.assert_allclose(colors[0], cmap(0.0))
    np.testing.assert_allclose(colors[3], cmap(1.0))
    np.testing.assert_allclose(colors[4], colors[3])  # above vmax: clipped to the red end
    assert colors[0][2] > colors[0][0] and colors[3][0] > colors[3][2]  # blue low, red high
    assert [redness(np.asarray(c) * 255) for c in colors[:4]] == pytest.approx([0.0, 0.25, 0.5, 1.0], abs=0.01)
    assert np.all(vis.spread_colors([1.0, 1.0], 1.0, 1.0) == cmap(0.0))
    with pytest.raises(ValueError, match="vmin"):
        vis.spread_colors([0.0], vmin=1.0, vmax=0.0)


def test_frame_steps_are_evenly_spaced_and_checked():
    assert vis.frame_steps(10, 4).tolist() == [0, 3, 6, 9]
    assert vis.frame_steps(25, 6).tolist() == [0, 5, 10, 14, 19, 24]
    assert vis.frame_steps(5, 1).tolist() == [0]
    with pytest.raises(ValueError, match="--frames"):
        vis.frame_steps(3, 4)


def test_compose_figure_borders_take_each_columns_colour():
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, size=(2, 3, 32, 32, 3), dtype=np.uint8)
    colors = vis.spread_colors([0.0, 1.0, 2.0], 0.0, 2.0)
    fig = vis.compose_figure(frames, [0, 4, 9], colors, 0.0, 2.0, seeds=[3, 7], title="t")
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 6  # rows = seeds, columns = time
    for k, ax in enumerate(panels):
        p, f = divmod(k, 3)
        img = np.asarray(ax.images[0].get_array())
        b = (img.shape[0] - 32) // 2
        assert b >= 2
        want = np.round(np.asarray(colors[f][:3]) * 255)
        assert np.all(img[0, 0] == want) and np.all(img[-1, -1] == want)
        assert np.array_equal(img[b:-b, b:-b], frames[p, f])
    assert [ax.get_title() for ax in panels[:3]] == ["t = 0", "t = 4", "t = 9"]
    assert panels[3].get_ylabel() == "seed 7"
    assert fig.axes[-1].get_ylabel() == vis.COLORBAR_LABEL
    with pytest.raises(ValueError, match="frames"):
        vis.compose_figure(frames, [0, 4], colors, 0.0, 2.0, seeds=[3, 7], title="t")


def test_gl_backend_choice():
    def never(_backend):
        raise AssertionError("an explicit MUJOCO_GL must not be probed")

    assert vis.choose_gl_backend({"MUJOCO_GL": "osmesa"}, probe=never) == "osmesa"
    assert vis.choose_gl_backend({}, probe=lambda b: True) == "egl"  # EGL first
    assert vis.choose_gl_backend({}, probe=lambda b: b == "osmesa") == "osmesa"  # then OSMesa
    with pytest.raises(vis.RenderError, match="libosmesa6"):
        vis.choose_gl_backend({}, probe=lambda b: False)
    with pytest.raises(vis.RenderError, match="egl"):
        vis.choose_gl_backend({"MUJOCO_GL": "disable"}, probe=never)


def test_configure_rendering_respects_an_already_imported_dm_control(monkeypatch):
    environ = {"MUJOCO_GL": "disable"}
    monkeypatch.setitem(sys.modules, "dm_control._render", types.SimpleNamespace(BACKEND="off"))
    with pytest.raises(vis.RenderError, match="fresh process"):
        vis.configure_rendering(environ)
    monkeypatch.setitem(sys.modules, "dm_control._render", types.SimpleNamespace(BACKEND="egl"))
    assert vis.configure_rendering(environ) == "egl" and environ == {"MUJOCO_GL": "disable"}  # nothing rewritten
    monkeypatch.delitem(sys.modules, "dm_control._render")
    environ = {"MUJOCO_GL": "osmesa"}
    assert vis.configure_rendering(environ) == "osmesa" and environ["PYOPENGL_PLATFORM"] == "osmesa"


def test_bad_input_names_the_argument_and_what_the_sweep_has(sweep, capsys):
    gl_before = os.environ.get("MUJOCO_GL")
    cases = [(["--task", "walker-walk"], ["--task", "cheetah-run"]),
             (["--task", TASK, "--agent", "mad_sac"], ["--agent", "sac_ln"]),
             (["--task", TASK, "--variants", "te", "qed9"], ["--variants", "te, qed0.2"])]
    for args, expected in cases:
        assert cli.main([str(sweep), *args, "--no-mlflow"]) == 2
        err = capsys.readouterr().err
        assert all(e in err for e in expected), err
    assert cli.main([str(sweep), "--task", TASK, "--steps", "3", "--frames", "5", "--no-mlflow"]) == 2
    assert "--frames" in capsys.readouterr().err
    assert cli.main([str(sweep.parent), "--task", TASK, "--no-mlflow"]) == 2
    assert "policies" in capsys.readouterr().err
    # An MLflow URI is checked as a spec's is, before any rollout, naming the flag (and the password masked).
    assert cli.main([str(sweep), "--task", TASK, "--tracking-uri", "http://qed:hunter2@head:5000"]) == 2
    assert capsys.readouterr().err == ("error: --tracking-uri: 'http://***@head:5000' carries credentials, which "
                                       "would be printed and stored with the sweep; give the URI without them and "
                                       "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD instead\n")
    assert os.environ.get("MUJOCO_GL") == gl_before  # refused before choosing a renderer


# ---- the CLI on a sweep folder --------------------------------------------------------------------------------
def test_final_snapshots_of_every_seed_are_used(behaviour, sweep):
    _, meta = behaviour
    assert list(meta["variants"]) == ["te", "qed0.2"]  # te first, as in Fig. 1
    for variant, info in meta["variants"].items():
        assert info["seeds"] == list(SEEDS)
        assert info["snapshots"] == [str(SweepDir(sweep).snapshot(f"{TASK}/sac_ln/{variant}/{s}", FINAL))
                                     for s in SEEDS]
    assert meta["gl_backend"] in ("egl", "osmesa") and meta["frame_steps"] == [0, 3, 6, 9]


def test_shared_start_and_spread_from_recorded_states(behaviour, sweep):
    from qed_ray.rl.agents import load_policies
    from qed_ray.rl.envs import make_env

    out, meta = behaviour
    for variant, info in meta["variants"].items():
        data = np.load(out / f"behaviour_{TASK}_sac_ln_{variant}.npz")
        states, spread = data["states"], data["spread"]
        assert states.shape == (len(SEEDS), STEPS, 18)  # cheetah: qpos 9 + qvel 9
        assert np.all(states[:, 0] == states[0, 0]) and spread[0] == 0.0  # one initial state for every seed
        np.testing.assert_allclose(spread, naive_spread(states), rtol=1e-12)
        np.testing.assert_allclose(spread, info["spread"], rtol=1e-12)
        assert spread[-1] > 0.0  # different policies drift apart
        # The recorded states are the policies' real rollouts from env seed 0, on freshly built envs by hand.
        pack, _ = load_policies(info["snapshots"])
        envs = [make_env(TASK, 0, 2) for _ in SEEDS]
        obs = np.stack([env.reset() for env in envs])[:, None]
        again = []
        for _ in range(STEPS):
            again.append(np.stack([env.physics.get_state().copy() for env in envs]))
            actions = pack.act_deterministic(obs)
            obs = np.stack([env.step(a[0]).obs for env, a in zip(envs, actions)])[:, None]
        np.testing.assert_allclose(np.stack(again, 1), states, rtol=1e-6, atol=1e-8)
    assert not np.allclose(meta["variants"]["te"]["spread"], meta["variants"]["qed0.2"]["spread"])


def test_colours_follow_the_spread_on_one_scale_for_all_variants(behaviour):
    out, meta = behaviour
    spreads = {v: np.asarray(i["spread"]) for v, i in meta["variants"].items()}
    assert meta["vmin"] == min(s.min() for s in spreads.values()) == 0.0
    assert meta["vmax"] == max(s.max() for s in spreads.values())
    for variant, spread in spreads.items():
        data = np.load(out / f"behaviour_{TASK}_sac_ln_{variant}.npz")
        np.testing.assert_allclose(data["colors"], vis.spread_colors(spread, meta["vmin"], meta["vmax"]))
        borders = [f[0, 0] for f in gif_frames(out / f"behaviour_{TASK}_sac_ln_{variant}.gif")]
        assert len(borders) == STEPS
        np.testing.assert_allclose(borders, np.round(data["colors"][:, :3] * 255), atol=12)  # GIF palette
        gap = 0.05 * meta["vmax"]
        for i, j in itertools.permutations(range(STEPS), 2):
            if spread[i] + gap < spread[j]:
                assert redness(borders[i]) < redness(borders[j]), (variant, i, j, spread[i], spread[j])


def test_frames_are_real_headless_renders(behaviour):
    out, _ = behaviour
    b = max(2, SIZE // 16)
    panel = SIZE + 2 * b
    for variant in VARIANTS:
        frames = gif_frames(out / f"behaviour_{TASK}_sac_ln_{variant}.gif")
        assert frames[0].shape == (panel, panel * len(SEEDS), 3)  # the seeds side by side
        for frame in frames:
            for p in range(len(SEEDS)):
                inner = frame[b:panel - b, p * panel + b:(p + 1) * panel - b].astype(float)
                assert inner.std() > 8.0 and len(np.unique(inner.reshape(-1, 3), axis=0)) > 20
        first = [frames[0][b:panel - b, p * panel + b:(p + 1) * panel - b].astype(float) for p in range(len(SEEDS))]
        assert all(np.abs(f - first[0]).mean() < 2.0 for f in first)  # same initial state looks the same
        png = out / f"behaviour_{TASK}_sac_ln_{variant}.png"
        assert png.stat().st_size > 10_000
        with Image.open(png) as im:
            assert np.asarray(im.convert("RGB")).astype(float).std() > 8.0


def test_outputs_are_logged_to_the_sweeps_parent_run(sweep, tmp_path):
    from qed_ray.service.mlflow.tracking import Tracker, default_tracking_uri

    tracker = Tracker(default_tracking_uri(sweep), sweep.name, "0123456789ab",
                      artifact_location=str(SweepDir(sweep).mlartifacts))
    parent = tracker.parent_run(sweep.name, {"name": sweep.name}, {})
    tracker.end_run(parent)
    proc = run_cli(sweep, "--task", TASK, "--variants", "te", "--steps", 3, "--frames", 2, "--size", 32,
                   "--out", tmp_path / "b")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert parent in proc.stdout
    names = {Path(a.path).name for a in tracker.client.list_artifacts(parent, "behaviour")}
    assert {f"behaviour_{TASK}_sac_ln_te.png", f"behaviour_{TASK}_sac_ln_te.gif",
            f"behaviour_{TASK}_sac_ln.json"} <= names
    assert tracker.client.get_run(parent).info.status == "FINISHED"  # a finished sweep stays finished
    with pytest.raises(LookupError, match="--experiment"):
        cli.log_to_mlflow([tmp_path / "b" / f"behaviour_{TASK}_sac_ln.json"], sweep, None, "no-such-sweep")
