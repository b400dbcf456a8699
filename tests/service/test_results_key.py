"""The user's results key: created owner-only on first use, kept outside the sweep folder, refused when others can
read it, when it is missing where it must exist, or damaged; each refusal names the file."""

import stat

import pytest

from qed_ray.records.digests import key_id, record, signed
from qed_ray.service.results_key import ResultsKeyError, key_path, load_key


@pytest.fixture
def key_file(tmp_path, monkeypatch):
    path = tmp_path / "config" / "qed_ray" / "results.key"
    monkeypatch.setenv("QED_RESULTS_KEY_FILE", str(path))
    return path


def test_created_owner_only_on_first_use_then_read_back(key_file):
    assert key_path() == key_file
    with pytest.raises(ResultsKeyError, match=f"^{key_file}: no results key. The trials of a sweep sign"):
        load_key()  # readers never create it
    said = []
    key = load_key(create=True, log=said.append)
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    assert len(key.secret) == 32 and key.id == key_id(key.secret) and key.secret.hex() not in repr(key)
    assert said == [f"created the results key {key_file} (mode 600): it signs what every trial records about its "
                    f"files; keep it, and keep it outside the sweep folders"]
    assert load_key(create=True, log=said.append) == key and len(said) == 1, "created once"
    files = {"0000001000/state.pt": "a" * 64}
    rec = record(key.secret, "sweep0", "t/sac_ln/te/0", files)
    assert signed(key.secret, "sweep0", "t/sac_ln/te/0", rec)
    assert not signed(key.secret, "sweep0", "t/sac_ln/te/1", rec), "bound to its trial"
    assert not signed(key.secret, "sweep1", "t/sac_ln/te/0", rec), "and to its sweep"


def test_default_location_is_the_users_config_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("QED_RESULTS_KEY_FILE")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    assert key_path() == tmp_path / "qed_ray" / "results.key"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert key_path() == tmp_path / "home" / ".config" / "qed_ray" / "results.key"


def test_a_key_others_can_read_inside_the_sweep_folder_or_damaged_is_refused(key_file, tmp_path, monkeypatch):
    load_key(create=True, log=lambda line: None)
    key_file.chmod(0o644)
    with pytest.raises(ResultsKeyError, match=rf"^{key_file}: the results key is open to other users \(mode 644\); "
                                              rf"run chmod 600 {key_file}"):
        load_key()
    key_file.chmod(0o600)
    key_file.write_text("not a key\n")
    with pytest.raises(ResultsKeyError, match=f"^{key_file}: not a results key"):
        load_key()
    sweep = tmp_path / "sweep"
    monkeypatch.setenv("QED_RESULTS_KEY_FILE", str(sweep / "results.key"))
    with pytest.raises(ResultsKeyError, match=f"^QED_RESULTS_KEY_FILE: {sweep / 'results.key'} lies inside the sweep "
                                              f"folder {sweep}"):
        load_key(create=True, sweep_dir=sweep)
    assert not sweep.exists(), "refused before anything is written"
    monkeypatch.setenv("QED_RESULTS_KEY_FILE", str(tmp_path / "keys" / "results.key"))  # beside the sweep
    with pytest.raises(ResultsKeyError, match=f"^QED_RESULTS_KEY_FILE: {tmp_path / 'keys' / 'results.key'} lies "
                                              f"under the storage root {tmp_path.resolve()} of the sweep folders"):
        load_key(create=True, sweep_dir=sweep)
    assert not (tmp_path / "keys").exists(), "refused before anything is written"
