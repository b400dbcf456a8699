"""qed_ray.service.ray_token: the Ray token file stays owner-only (fast cases on a scratch HOME, one slow real ``ray.init``)."""

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from qed_ray.service.ray_token import private_ray_token, restrict, token_path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def write(path: Path, perm: int, text: str = "f" * 64) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(perm)
    return path


@pytest.mark.parametrize("env, expected", [
    ({}, ".ray/auth_token"),
    ({"RAY_AUTH_MODE": "token"}, ".ray/auth_token"),
    ({"RAY_AUTH_MODE": "DISABLED"}, None),
    ({"RAY_AUTH_TOKEN": "abc"}, None),  # environment only: no file involved
    ({"RAY_AUTH_TOKEN_PATH": "/etc/qed/token"}, "/etc/qed/token"),
])
def test_token_path_follows_rays_lookup_order(tmp_path, env, expected):
    got = token_path(env, tmp_path)
    assert got == (None if expected is None else tmp_path / expected if not expected.startswith("/") else Path(expected))


def test_missing_folder_is_created_owner_only_and_a_new_token_ends_up_0600(tmp_path):
    with private_ray_token({}, tmp_path) as path:
        assert mode(tmp_path / ".ray") == 0o700
        write(path, 0o644)  # what Ray 2.60 does under the usual umask 022
    assert path == tmp_path / ".ray" / "auth_token" and mode(path) == 0o600
    assert path.read_text() == "f" * 64  # the token itself is untouched


def test_existing_world_readable_token_is_restricted_on_entry(tmp_path):
    path = write(tmp_path / ".ray" / "auth_token", 0o644)
    with private_ray_token({"RAY_AUTH_MODE": "token"}, tmp_path):
        assert mode(path) == 0o600
    assert restrict(path) is False  # already private: nothing to change


def test_env_token_and_disabled_auth_touch_nothing(tmp_path):
    path = write(tmp_path / ".ray" / "auth_token", 0o644)
    for env in ({"RAY_AUTH_TOKEN": "abc"}, {"RAY_AUTH_MODE": "disabled"}):
        with private_ray_token(env, tmp_path) as got:
            assert got is None
    assert mode(path) == 0o644


def test_token_path_file_is_restricted_but_its_folder_never_created(tmp_path):
    own = write(tmp_path / "keys" / "ray.token", 0o640)
    with private_ray_token({"RAY_AUTH_TOKEN_PATH": str(own)}, tmp_path):
        pass
    assert mode(own) == 0o600
    missing = tmp_path / "nowhere" / "ray.token"
    with private_ray_token({"RAY_AUTH_TOKEN_PATH": str(missing)}, tmp_path):
        pass
    assert not missing.parent.exists() and not (tmp_path / ".ray").exists()


EMBEDDED = """
import ray
from qed_ray.service.ray_token import private_ray_token
with private_ray_token():
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
ray.shutdown()
"""


@pytest.mark.slow
def test_embedded_ray_init_leaves_its_generated_token_owner_only():
    """Real Ray, default auth (RAY_AUTH_MODE unset, no token anywhere): Ray generates ~/.ray/auth_token under a
    scratch HOME with umask 022, and it ends up 0600 in a 0700 folder."""
    with tempfile.TemporaryDirectory(prefix="qtk", dir="/tmp") as tmp:  # short: Ray's socket paths live under it
        home = Path(tmp) / "home"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
        env.update(HOME=str(home), RAY_TMPDIR=tmp)
        proc = subprocess.run([sys.executable, "-c", f"import os; os.umask(0o022)\n{EMBEDDED}"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        token = home / ".ray" / "auth_token"
        assert len(token.read_text().strip()) == 64  # Ray's own token (32 random bytes, hex)
        assert (mode(token), mode(token.parent)) == (0o600, 0o700)


def test_only_rays_opt_out_advice_is_silenced(caplog):
    import logging

    from qed_ray.service.ray_token import RAY_AUTH_LOGGER, quiet_opt_out_notice

    logger = logging.getLogger(RAY_AUTH_LOGGER)
    quiet_opt_out_notice()
    quiet_opt_out_notice()  # idempotent: one filter
    assert len(logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger=RAY_AUTH_LOGGER):
        logger.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        logger.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    assert [r.getMessage()[:44] for r in caplog.records] == ["Token authentication is disabled for this Ra"]
