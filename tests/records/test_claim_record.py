"""The frozen pre-registration is bound to its hash and signed (qed_ray/spec/claim.py, qed_ray/records/sweep.py):
one threshold edited in sweep.json's stored claim block is refused naming the field by a driver start and by the
re-analysis; a block and hash edited together fail the record's signature; the verdict is
judged by the claim file's block, or by the signed stored block where the file is not at hand."""

import json
import shutil
from pathlib import Path

import pytest
from kit import sweep_spec

from qed_ray.spec import claim
from qed_ray.records.codec import dump
from qed_ray.service.reanalysis import main as gather_main
from qed_ray.service.results_key import load_key
from qed_ray.records.sweep import ClaimRecord, SweepState, read_state, sign_claim, verified_claim, write_state
from qed_ray.service.sweep_state import plan
from qed_ray.spec.sweep import SpecError

DOC = Path(__file__).resolve().parents[2] / "docs" / "claim.md"
FIELD = "endpoints.iqm_kept.lower_at_least"


def _edited(state: SweepState, value: float, rehash: bool = False) -> SweepState:
    """``state`` as a folder writer leaves it: one threshold of the stored block changed (and its sha256 with it)."""
    raw = json.loads(json.dumps(dump(state)))
    raw["claim"]["block"]["endpoints"]["iqm_kept"]["lower_at_least"] = value
    if rehash:
        raw["claim"]["sha256"] = claim.block_sha256(raw["claim"]["block"])
    return SweepState.model_validate(raw)


@pytest.fixture
def doc(tmp_path) -> Path:
    shutil.copy(DOC, tmp_path / "claim.md")
    return tmp_path / "claim.md"


def test_a_driver_start_refuses_an_edited_stored_block_naming_the_field_and_judges_by_the_file(doc):
    first = plan(None, sweep_spec(claim=str(doc))).state
    file_block = claim.read_block(doc)[1]
    assert plan(first, sweep_spec(claim=str(doc))).state.claim.block == file_block
    (problem,) = plan(_edited(first, 0.5), sweep_spec(claim=str(doc))).problems
    assert problem.startswith(f"claim.block: sweep.json's frozen claim block was edited after the first start "
                              f"({FIELD}: 0.95 -> 0.5 against {doc}): its values hash to "), problem
    assert f"not to the block sha256 {first.claim.sha256[:12]} frozen with it" in problem
    (problem,) = plan(_edited(first, 0.5, rehash=True), sweep_spec(claim=str(doc))).problems  # block and hash replaced
    assert problem.startswith(f"claim: {doc}: the claim block changed since this sweep started ({FIELD}: 0.5 -> 0.95;")


def test_the_reanalysis_refuses_an_edited_threshold_naming_the_field(sweep_copy, doc, capsys):
    state = read_state(sweep_copy)  # the first start froze the claim file's block and signed it
    state = sign_claim(state.model_copy(update={"claim": ClaimRecord(**claim.check(None, str(doc), False)[0])}),
                       load_key(create=True).secret)
    frozen = state.claim
    write_state(sweep_copy, _edited(state, 0.5))
    gathered = {p: p.read_bytes() for p in sweep_copy.gather.rglob("*") if p.is_file()}
    assert gather_main([str(sweep_copy.root)]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"error: sweep.json: claim.block: sweep.json's frozen claim block was edited after "
                                f"the first start ({FIELD}: 0.95 -> 0.5 against {doc}): its values hash to "
                                f"{claim.block_sha256(_edited(state, 0.5).claim.block)[:12]}, "
                                f"not to the block sha256 {frozen.sha256[:12]} frozen with it; a sweep's "
                                f"pre-registration cannot change: restore sweep.json, or start over with --fresh or "
                                f"another name"]
    assert "re-analysing" not in out
    assert {p: p.read_bytes() for p in sweep_copy.gather.rglob("*") if p.is_file()} == gathered, "nothing written"


def test_the_signed_record_binds_block_hash_and_file(doc, tmp_path):
    key = load_key(create=True).secret
    state = sign_claim(plan(None, sweep_spec(claim=str(doc))).state, key)
    file_block = claim.read_block(doc)[1]
    assert verified_claim(state, key) == {"file": str(doc), "sha256": claim.block_sha256(file_block),
                                          "block": file_block}
    with pytest.raises(SpecError, match=r"^sweep\.json: claim\.signature: the claim record .* does not carry your "
                                        r"results key's signature"):
        verified_claim(_edited(state, 0.5, rehash=True), key)  # a consistent forgery of block and hash
    with pytest.raises(SpecError, match="claim.signature"):
        verified_claim(state, b"another key" * 3)
    with pytest.raises(SpecError, match=rf"^claim: {doc}: the claim block changed since this sweep started "
                                        rf"\({FIELD}: 0.5 -> 0.95\)"):
        verified_claim(_edited(state, 0.5, rehash=True), None)  # --no-verify: the claim file at hand still decides
    doc.rename(tmp_path / "elsewhere.md")  # re-analysed where the claim file is not: the signed block stands for it
    assert verified_claim(state, key)["block"] == file_block
    unsigned = state.model_copy(update={"claim": state.claim.model_copy(update={"signature": None})})
    with pytest.raises(SpecError, match=r"^sweep\.json: claim\.signature: the claim record is unsigned"):
        verified_claim(unsigned, key)
    with pytest.raises(SpecError, match=r"the claim file cannot be read here to name the field"):
        verified_claim(_edited(state, 0.5), key)
