"""Where the MLflow UI shows a sweep: the address of its runs list and the view the sweep stores on its experiment
(the MLflow 3 UI's shared views), and the command that opens the UI. Plain strings: no MLflow import."""

from __future__ import annotations

import sys

from qed_ray.service.mlflow.tags import ALPHA_REGIME_TAG, ROLE_TAG

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the run a run is nested under
SORT_BY_NAME = "tags.%60mlflow.runName%60"  # the UI's sort key of the Run Name column, URL-encoded
SHARED_VIEW_TAG = "mlflow.sharedViewState."  # + a share key: a runs-list view stored on the experiment (UI 3.x)


def view_key(sweep_id: str) -> str:
    """The share key of a sweep's group view (:meth:`Tracker.share_group_view`)."""
    return f"qed-groups-{sweep_id}"


def group_view_state(parent_id: str) -> dict:
    """The runs list the sweep shares on its experiment: the group runs under ``parent_id``, sorted by name (named
    task first, :func:`~qed_ray.service.mlflow.tags.group_run_name`: te and QED of a task side by side), with V, IQM and the
    ratios to te as the first columns, then the tag ``alpha_regime`` (where QED's alpha sat: a ratio to te taken at
    its cap compares te with an almost fixed alpha), the interval ends, the share at the cap and the seeds. Keys as
    the MLflow 3.17 UI's search facets and UI state (its columns keep this order, tags among metrics)."""
    stats = ("V", "te_V_ratio", "IQM", "IQM_ratio")  # first, in this order (the UI sorts by name without an order)
    columns = [*(f"metrics.`{m}`" for m in stats), f"tags.`{ALPHA_REGIME_TAG}`",
               *(f"metrics.`{m}{end}`" for m in stats for end in ("_ci_lower", "_ci_upper")),
               "metrics.`alpha_frac_cap_late`", "metrics.`n_seeds`"]
    return {"searchFilter": f"tags.`{ROLE_TAG}` = 'group' and tags.`{PARENT_TAG}` = '{parent_id}'",
            "orderByKey": "tags.`mlflow.runName`", "orderByAsc": True, "selectedColumns": columns, "columnOrder": columns}


def runs_page(experiment_id: str, sweep_id: str | None = None) -> str:
    """The UI's address (a fragment: MLflow routes by it) of the experiment's runs in the Model-training view: with
    ``sweep_id``, the sweep's shared group view (:meth:`Tracker.share_group_view`), else every run sorted by name.
    ``workflowType`` keeps the UI out of its GenAI view, which it remembers per browser."""
    page = f"#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    # The UI ignores a shared view when the address carries a sort or filter of its own.
    return f"{page}&viewStateShareKey={view_key(sweep_id)}" if sweep_id else \
        f"{page}&orderByKey={SORT_BY_NAME}&orderByAsc=true"


def ui_command(uri: str, experiment_id: str | None = None, sweep_id: str | None = None) -> str:
    """The command that opens the MLflow UI on ``uri``, and the address of the experiment's runs.

    MLflow 3.17's UI shows an experiment as its GenAI switch says (remembered per browser, GenAI by default), not
    as the experiment's kind tag says; ``?workflowType=machine_learning`` opens it on its training runs.
    """
    page = f"/{runs_page(experiment_id, sweep_id)}" if experiment_id else ""
    if uri.startswith("sqlite:"):
        return (f"{sys.executable} -m mlflow ui --backend-store-uri {uri} --port 5000\n"
                f"  then open http://127.0.0.1:5000{page}")
    return f"open {uri.rstrip('/')}{page} in a browser (MLflow tracking server)"
