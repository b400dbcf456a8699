"""The tags that give the sweep's MLflow runs their identity (read by :mod:`qed_ray.service.tracking` and, in the
store's own tables, by :mod:`qed_ray.service.relink`)."""

SWEEP_TAG = "qed.sweep_id"
TRIAL_TAG = "qed.trial"
ROLE_TAG = "qed.role"
REASON_TAG = "qed.failure_reason"
NODES_TAG = "qed.node_ids"
POLICY_SHA_TAG = "qed.policy_sha256"  # the final snapshot's state.pt SHA-256, set by the trial at its end
SNAPSHOTS_SHA_TAG = "qed.snapshots_sha256"  # the digest of all its snapshots (qed_ray.analysis.checksums)
PACK_TAG, PACK_SIZE_TAG = "qed.pack", "qed.pack_size"  # a seed run trained in a pack: the pack's name and size
