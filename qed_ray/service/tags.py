"""The tags that give the sweep's MLflow runs their identity (read by :mod:`qed_ray.service.tracking` and, in the
store's own tables, by :mod:`qed_ray.service.relink`)."""

SWEEP_TAG = "qed.sweep_id"
TRIAL_TAG = "qed.trial"
ROLE_TAG = "qed.role"
REASON_TAG = "qed.failure_reason"
NODES_TAG = "qed.node_ids"
# What a trial's worker records at its end (qed_ray.rl.digests): the digest of every file the gather reads of it,
# its HMAC under the user's results key, and that key's id. A finished run without them is flagged UNVERIFIED_TAG.
DIGEST_TAG, MAC_TAG, KEY_ID_TAG = "qed.files_sha256", "qed.files_hmac", "qed.results_key_id"
UNVERIFIED_TAG = "qed.unverified"
PACK_TAG, PACK_SIZE_TAG = "qed.pack", "qed.pack_size"  # a seed run trained in a pack: the pack's name and size
