"""The one atomic-write helper: a target holds the old or the new content, never a mix, and failures leave no litter."""

import json

import numpy as np
import pytest

from qed_ray.records.atomic import atomic_dir, atomic_file, recover_dir, replace_dir, write_json, write_text


def test_atomic_file_replaces_and_keeps_the_suffix_for_writers_that_add_one(tmp_path):
    target = tmp_path / "chunk.npz"
    with atomic_file(target) as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".npz" and tmp.name.startswith(".chunk.tmp-")
        np.savez(tmp, a=np.arange(3))  # np.savez appends .npz unless the name already ends with it
    with np.load(target) as z:
        assert z["a"].tolist() == [0, 1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chunk.npz"]


def test_a_failed_write_keeps_the_old_content_and_removes_its_temporary_file(tmp_path):
    target = tmp_path / "sweep.json"
    write_json(target, {"v": 1})
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_file(target) as tmp:
            tmp.write_text('{"v": 2, "trunc')
            raise RuntimeError("disk full")
    assert json.loads(target.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["sweep.json"]
    write_text(target, "new")
    assert target.read_text() == "new"


def test_atomic_dir_swaps_a_whole_folder_or_nothing(tmp_path):
    target = tmp_path / "0000002000"
    with atomic_dir(target) as d:
        (d / "state.pt").write_bytes(b"one")
        (d / "sub").mkdir()
        (d / "sub" / "x").write_text("1")
    assert (target / "state.pt").read_bytes() == b"one" and (target / "sub" / "x").read_text() == "1"
    with pytest.raises(ValueError):
        with atomic_dir(target) as d:
            (d / "state.pt").write_bytes(b"two, half written")
            raise ValueError("crash mid-checkpoint")
    assert sorted(p.name for p in target.iterdir()) == ["state.pt", "sub"] and (target / "state.pt").read_bytes() == \
        b"one"
    with atomic_dir(target) as d:
        (d / "manifest.json").write_text("{}")
    assert sorted(p.name for p in target.iterdir()) == ["manifest.json"], "the old folder is replaced, not merged"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000002000"], "no staging or old folder is left"


def test_recover_dir_puts_back_a_folder_set_aside_by_an_interrupted_replace(tmp_path):
    dst = tmp_path / "checkpoint"
    dst.mkdir()
    (dst / "manifest.json").write_text("old")
    # What a crash between replace_dir's two renames leaves: the old folder set aside, no checkpoint/.
    dst.rename(tmp_path / ".checkpoint.old-1a2b3c4d")
    assert recover_dir(dst) and (dst / "manifest.json").read_text() == "old"
    assert not recover_dir(dst), "nothing to do when the folder is there"
    src = tmp_path / "new"
    src.mkdir()
    (src / "manifest.json").write_text("new")
    replace_dir(src, dst)
    assert (dst / "manifest.json").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
