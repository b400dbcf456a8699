"""The user's results key: the secret that signs what a trial records about its files and every cached group, kept
outside any sweep folder (docs/design.md, "Trusting results"). The driver creates it on its first start (256 random
bits as hex, mode 600, in a folder of mode 700); ``qed-ray gather`` and ``--status`` only read it."""

from __future__ import annotations

import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

from qed_ray.records.file_reads import LIMITS, open_regular
from qed_ray.records.digests import key_id
from qed_ray.service.sweep_state import SYSTEM_FOLDERS
from qed_ray.spec.sweep import SpecError

KEY_FILE_ENV = "QED_RESULTS_KEY_FILE"
_HEX_KEY = re.compile(r"[0-9a-f]{64}")


class ResultsKeyError(SpecError):
    """A results key that is missing (where it must exist), open to others, not the user's, or damaged."""


@dataclass(frozen=True)
class ResultsKey:
    """The key's bytes (never printed) and its file."""

    secret: bytes = field(repr=False)
    path: Path

    @property
    def id(self) -> str:
        return key_id(self.secret)


def key_path() -> Path:
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV]).expanduser().absolute()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config).expanduser().absolute() / "qed_ray" / "results.key"


def load_key(create: bool = False, sweep_dir: Path | None = None, log=print) -> ResultsKey:
    """Reads the key (creating it first with ``create``); ResultsKeyError for one missing, inside ``sweep_dir`` or
    its storage root, open to others, not the user's own, or not 64 hex digits."""
    path = key_path()
    if sweep_dir is not None and path.resolve().is_relative_to(Path(sweep_dir).resolve()):
        raise ResultsKeyError(f"{KEY_FILE_ENV}: {path} lies inside the sweep folder {sweep_dir}, where whoever can "
                              f"write the folder could read it; keep the results key outside it (default "
                              f"~/.config/qed_ray/results.key)")
    root = Path(sweep_dir).resolve().parent if sweep_dir is not None else None  # the storage root of every sweep
    # A folder moved into the home folder or /tmp has no storage root of its own (a start refuses those as roots).
    shared = root is not None and root not in {Path.home().resolve(), *(Path(f).resolve() for f in SYSTEM_FOLDERS)}
    if shared and path.resolve().is_relative_to(root):
        raise ResultsKeyError(f"{KEY_FILE_ENV}: {path} lies under the storage root {root} of the sweep folders, "
                              f"which on a cluster is the shared file system every node writes; keep the results "
                              f"key outside it (default ~/.config/qed_ray/results.key)")
    if create and not path.exists():
        _create(path, log)
    if not os.path.lexists(path):
        raise ResultsKeyError(
            f"{path}: no results key. The trials of a sweep sign the digests of their files with the key of the "
            f"user who ran it (its driver creates it on its first start): copy that key here (chmod 600) or point "
            f"{KEY_FILE_ENV} at it")
    # A plain file of at most a few bytes, wherever a link of the user's leads (never a device, FIFO or huge file).
    with open_regular(path, "key", ResultsKeyError, within="/") as f:
        info = os.fstat(f.fileno())
        text = f.read(LIMITS["key"][0]).decode(errors="replace").strip()
    if info.st_uid != os.getuid():
        raise ResultsKeyError(f"{path}: the results key belongs to uid {info.st_uid}, not to you (uid "
                              f"{os.getuid()}); use a key file of your own")
    if info.st_mode & 0o077:
        raise ResultsKeyError(f"{path}: the results key is open to other users (mode "
                              f"{stat.S_IMODE(info.st_mode):03o}); run chmod 600 {path}")
    if not _HEX_KEY.fullmatch(text):
        raise ResultsKeyError(f"{path}: not a results key (64 hex digits); restore it, or move it away to have the "
                              f"next sweep start create a new one (its trials' digests can then no longer be checked)")
    return ResultsKey(bytes.fromhex(text), path)


def _create(path: Path, log) -> None:
    """A new random key, owner-only from its first byte (``O_EXCL``: a key another process created meanwhile wins)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
        f.flush()
        os.fsync(f.fileno())
    log(f"created the results key {path} (mode 600): it signs what every trial records about its files; keep it, "
        f"and keep it outside the sweep folders")
