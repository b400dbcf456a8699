"""The tags that give the sweep's MLflow runs their identity, and the ones the MLflow UI groups and shows them by."""

from qed_ray.records.layout import TrialId

SWEEP_TAG = "qed.sweep_id"
TRIAL_TAG = "qed.trial"
ROLE_TAG = "qed.role"  # sweep (the parent), group (a cross-seed group), trial (a seed run), reanalysis
REASON_TAG = "qed.failure_reason"
NODES_TAG = "qed.node_ids"
# What a trial's worker records at its end (qed_ray.records.digests): the digest of every file the gather reads of it,
# its HMAC under the user's results key, and that key's id. A finished run without them is flagged UNVERIFIED_TAG.
DIGEST_TAG, MAC_TAG, KEY_ID_TAG = "qed.files_sha256", "qed.files_hmac", "qed.results_key_id"
UNVERIFIED_TAG = "qed.unverified"
PACK_TAG, PACK_SIZE_TAG = "qed.pack", "qed.pack_size"  # a seed run trained in a pack: the pack's name and size
# A trial run's parts, so the UI can group and filter by them ("Group by" lists tags; params hold no variant).
TASK_TAG, AGENT_TAG, VARIANT_TAG, SEED_TAG = "qed.task", "qed.agent", "qed.variant", "qed.seed"
GROUP_TAG = "qed.group"  # task/agent/variant: the seeds of one cross-seed group, te and QED of a task side by side
# the claim's outcome (pass, fail, not enough data, or exploratory: not judged) on a sweep or re-analysis run
VERDICT_TAG = "qed.verdict"
BASELINE_TAG = "qed.baseline"  # a group run's te variant on its task, once that group has landed (its ratios' base)
REANALYSIS_TAG = "qed.reanalysis"  # a re-analysis run's settings (its name without the prefix): one run each
NOTE_TAG = "mlflow.note.content"  # a run's description (markdown), shown on its page in the MLflow UI
RUN_NAME_TAG = "mlflow.runName"  # MLflow's own: the run's name
# A group run's GroupResult.alpha_regime (where QED's alpha sat late in training: ok, at_cap, hot), named as the
# results field and the parent run's alpha_regime/<group> tags; NO_ESTIMATE where there is none (te, fixed, no
# history.json), so that a run without a regime is never read as one where nothing was wrong.
ALPHA_REGIME_TAG, NO_ESTIMATE = "alpha_regime", "no estimate"


def run_name(trial: str) -> str:
    """A trial run's name in the MLflow UI: ``qed0.2 s0 cheetah-run sac_ln``. The runs list cuts names to about 14
    characters, so what tells sibling runs apart, the variant and the seed, comes first."""
    t = TrialId.from_name(trial)
    return f"{t.variant} s{t.seed} {t.task} {t.agent}"


def trial_tags(trial: str) -> dict[str, str]:
    t = TrialId.from_name(trial)
    return {TASK_TAG: t.task, AGENT_TAG: t.agent, VARIANT_TAG: t.variant, SEED_TAG: str(t.seed),
            GROUP_TAG: f"{t.task}/{t.agent}/{t.variant}", RUN_NAME_TAG: run_name(trial)}


def group_run_name(task: str, agent: str, variant: str) -> str:
    """A group run's name: ``cartpole-balance te sac_ln``, task first, so that the runs list sorted by name puts te
    and every variant of a task side by side."""
    return f"{task} {variant} {agent}"


def group_tags(task: str, agent: str, variant: str, alpha_regime: str | None) -> dict[str, str]:
    """A group run's parts as tags, its name and its ``alpha_regime`` (None: :data:`NO_ESTIMATE`, never left out)."""
    return {TASK_TAG: task, AGENT_TAG: agent, VARIANT_TAG: variant, GROUP_TAG: f"{task}/{agent}/{variant}",
            RUN_NAME_TAG: group_run_name(task, agent, variant), ALPHA_REGIME_TAG: alpha_regime or NO_ESTIMATE}
