"""Every figure the gather step writes keeps its title, footnote and labels inside the figure, and the figure's own
title and footnote clear of its panels, at one task and at 18; so does a behaviour strip of one frame. Measured
with matplotlib's Agg renderer at the dpi the PNG is written with."""

import matplotlib.pyplot as plt
import numpy as np
import pytest
from folder_helpers import group_result
from matplotlib.backends.backend_agg import FigureCanvasAgg

from qed_ray.analysis import plots
from qed_ray.spec.sweep import FinalEvalSpec
from qed_ray.analysis.tables import sweep_results
from qed_ray.spec.tasks import TASKS
from qed_ray.analysis.behaviour import compose_figure

FE = FinalEvalSpec(episodes=2, action_rollouts=2, action_steps=30, curve_episodes=1, bootstrap_reps=200)
TITLED = {"mean_return_vs_kl", "v_over_env_steps", "learning_curves"}  # the figures with a title over their panels


def _words(text) -> str:
    return " ".join(text.get_text().split())


def _texts(fig) -> list:
    """Every visible, non-empty text: the figure's own and each panel's title, axis labels, value labels, legend."""
    texts = list(fig.texts)
    for ax in fig.axes:
        if ax.get_visible():
            texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
            texts += ax.get_legend().get_texts() if ax.get_legend() else []
    return [t for t in texts if t.get_visible() and t.get_text()]


def _check_layout(name: str, fig) -> None:
    """Draws the figure (no pixels) and asserts every text inside it and its own texts clear of every panel."""
    fig.draw_without_rendering()  # legends and axis labels take their places only when drawn
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    for text in _texts(fig):
        b = text.get_window_extent(renderer)
        assert box.x0 - 0.5 <= b.x0 and b.x1 <= box.x1 + 0.5 and box.y0 - 0.5 <= b.y0 and b.y1 <= box.y1 + 0.5, (
            f"{name}: {_words(text)[:60]!r} at {b.bounds} leaves the figure {box.bounds}")
    panels = [(ax.get_title(), ax.get_tightbbox(renderer)) for ax in fig.axes if ax.get_visible()]
    for text in fig.texts:
        b = text.get_window_extent(renderer)
        hit = [title for title, panel in panels if b.overlaps(panel)]
        assert not hit, f"{name}: {_words(text)[:60]!r} covers the panels {hit}"


@pytest.mark.parametrize("n_tasks", [1, 18])
def test_every_gather_figure_keeps_its_title_and_footnote_inside_and_clear_of_its_panels(n_tasks):
    groups = [group_result(t, variant=v, scores=(0.1, 0.3, 0.2)) for t in TASKS[:n_tasks] for v in ("te", "qed0.2")]
    results = sweep_results("s", FE, groups, [], 6 * n_tasks)
    figures = plots.figures(results)
    try:
        assert list(figures) == list(plots.FIGURES)  # every figure all_figures writes
        for name, fig in figures.items():
            assert fig.dpi == plots.PNG_DPI and fig.get_figwidth() >= plots.MIN_WIDTH
            own = [_words(t) for t in fig.texts]
            assert plots.caption(results) in own, f"{name}: the footnote is the caption, whole"
            assert (fig.get_suptitle() != "") == (name in TITLED) and len(own) == 1 + (name in TITLED)
            _check_layout(name, fig)
        panels = [ax for ax in figures["v_over_env_steps"].axes if ax.get_visible()]
        assert sorted(ax.get_title() for ax in panels) == sorted(TASKS[:n_tasks])
    finally:
        for fig in figures.values():
            plt.close(fig)


@pytest.mark.parametrize("n_frames", [1, 6])
def test_a_behaviour_strip_keeps_its_title_inside_at_any_number_of_frames(n_frames):
    title = "finger-turn_hard sac_ln qed0.2+target_alpha=floor: 10 seeds from env seed 0's initial state"
    fig = compose_figure(np.zeros((2, n_frames, 8, 8, 3), np.uint8), list(range(n_frames)),
                         np.ones((n_frames, 4)), 0.0, 1.0, [0, 1], title)
    FigureCanvasAgg(fig)
    fig.set_dpi(120)  # as visualize.write_variant saves it
    assert fig.get_suptitle() == title
    _check_layout(f"behaviour strip of {n_frames} frames", fig)
