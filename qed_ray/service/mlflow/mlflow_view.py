"""Where the MLflow UI shows a sweep: the address of its runs list and the view the sweep stores on its experiment
(the MLflow 3 UI's shared views), and the command that opens the UI. Plain strings: no MLflow import."""

from __future__ import annotations

import sys

from qed_ray.service.mlflow.tags import ALPHA_REGIME_TAG, ROLE_TAG

PARENT_TAG = "mlflow.parentRunId"  # MLflow's own: the run a run is nested under
SORT_BY_NAME = "tags.%60mlflow.runName%60"  # the UI's sort key of the Run Name column, URL-encoded
SHARED_VIEW_TAG = "mlflow.sharedViewState."  # + a share key: a runs-list view stored on the experiment (UI 3.x)


def view_key(sweep_id: str) -> str:
    return f"qed-groups-{sweep_id}"


def group_view_state(parent_id: str) -> dict:
    """The runs list the sweep shares on its experiment: the group runs under ``parent_id`` sorted by name (te and
    QED of a task side by side), V, IQM and the ratios to te first, then ``alpha_regime`` (a ratio to te taken at
    QED's cap compares te with an almost fixed alpha); keys as the MLflow 3.17 UI's state."""
    stats = ("V", "te_V_ratio", "IQM", "IQM_ratio")  # first, in this order (the UI sorts by name without an order)
    columns = [*(f"metrics.`{m}`" for m in stats), f"tags.`{ALPHA_REGIME_TAG}`",
               *(f"metrics.`{m}{end}`" for m in stats for end in ("_ci_lower", "_ci_upper")),
               "metrics.`alpha_frac_cap_late`", "metrics.`n_seeds`"]
    return {"searchFilter": f"tags.`{ROLE_TAG}` = 'group' and tags.`{PARENT_TAG}` = '{parent_id}'",
            "orderByKey": "tags.`mlflow.runName`", "orderByAsc": True, "selectedColumns": columns,
            "columnOrder": columns}


def runs_page(experiment_id: str, sweep_id: str | None = None) -> str:
    """The UI's address (a fragment: MLflow routes by it) of the experiment's runs: with ``sweep_id``, the sweep's
    shared group view, else every run sorted by name. ``workflowType`` keeps the UI out of its GenAI view, which it
    remembers per browser (whatever the experiment's kind tag says)."""
    page = f"#/experiments/{experiment_id}/runs?workflowType=machine_learning"
    # The UI ignores a shared view when the address carries a sort or filter of its own.
    return f"{page}&viewStateShareKey={view_key(sweep_id)}" if sweep_id else \
        f"{page}&orderByKey={SORT_BY_NAME}&orderByAsc=true"


def ui_command(uri: str, experiment_id: str | None = None, sweep_id: str | None = None) -> str:
    """The command that opens the MLflow UI on ``uri``, and the address of the experiment's runs."""
    page = f"/{runs_page(experiment_id, sweep_id)}" if experiment_id else ""
    if uri.startswith("sqlite:"):
        return (f"{sys.executable} -m mlflow ui --backend-store-uri {uri} --port 5000\n"
                f"  then open http://127.0.0.1:5000{page}")
    return f"open {uri.rstrip('/')}{page} in a browser (MLflow tracking server)"
