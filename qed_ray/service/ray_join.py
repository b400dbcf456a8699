"""Where the driver joins Ray, said before it connects, and a join that gives up in bounded time (docs/running.md).

A head that died without ``ray stop`` leaves its address in ``ray_current_cluster``, and ``ray.init`` would retry it
for minutes; so the driver resolves the address by Ray's rule itself and asks it over TCP first. Starting an
embedded cluster is not bounded: that is this machine starting processes, not a connect that may never answer.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from qed_ray.spec.sweep import SpecError

TIMEOUT_ENV = "QED_RAY_CONNECT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 30.0
EXIT_NO_RAY = 1  # the code a driver that could not join Ray exits with


class JoinFailed(RuntimeError):
    """Joining the Ray cluster failed; the message names the address, where it came from and the ways out."""


@dataclass(frozen=True)
class Target:
    """The cluster a driver joins: its address (None: an embedded cluster it starts) and where that came from."""

    address: str | None
    source: str
    address_file: str | None = None  # the ray_current_cluster file the address was read from

    def line(self) -> str:
        if self.address is None:
            return f"Ray: starting an embedded cluster on this machine ({self.source})"
        return f"Ray: joining the cluster at {self.address} ({self.source})"

    def give_up(self, timeout_s: float, cause: str = "") -> str:
        what = f"failed ({cause})" if cause else f"got no answer within {timeout_s:g} s"
        fix = (f"if no head runs there any more, `ray stop` clears the stale address (it also stops every Ray process "
               f"of yours on this machine; or remove {self.address_file})" if self.address_file else
               "check that a head runs at that address")
        return (f"Ray: joining the cluster at {self.address} ({self.source}) {what}; {fix}, or run with "
                f"RAY_ADDRESS=local for an embedded cluster ({TIMEOUT_ENV} to wait longer)")


def target(temp_dir: str | None = None, env: dict | None = None) -> Target:
    """The cluster ``ray.init()`` would join: ``RAY_ADDRESS`` (``local``: an embedded cluster), else the address the
    last ``ray start`` here left in Ray's temp folder ``temp_dir`` (None: Ray's default), else an embedded cluster."""
    from ray._common.utils import get_ray_address_file  # Ray's own answer to where `ray start` wrote it

    env = os.environ if env is None else env
    given = env.get("RAY_ADDRESS", "")
    if given == "local":
        return Target(None, "RAY_ADDRESS=local")
    if given and given != "auto":
        return Target(given, "RAY_ADDRESS")
    path = get_ray_address_file(temp_dir)
    try:
        with open(path) as f:
            found = f.read(1000).strip()
    except OSError:
        found = ""
    if found:
        return Target(found, f"the address a `ray start` on this machine left in {path}", path)
    if given == "auto":  # Ray then looks for a running head's processes, and refuses when there is none
        return Target("auto", f"RAY_ADDRESS=auto, no `ray start` address in {path}")
    return Target(None, f"no RAY_ADDRESS, and no `ray start` address in {path}")


def timeout_s(env: dict | None = None) -> float:
    """``QED_RAY_CONNECT_TIMEOUT_S`` (default 30); SpecError for anything but a positive number of seconds."""
    raw = (os.environ if env is None else env).get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw.strip() else DEFAULT_TIMEOUT_S
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise SpecError(f"{TIMEOUT_ENV}: {raw[:40]!r} is not a number of seconds above 0 (default "
                        f"{DEFAULT_TIMEOUT_S:g})")
    return value


def unreachable(address: str, limit: float) -> str | None:
    """Why nothing answers at a GCS address ``host:port`` over TCP within ``limit`` seconds: "" for no answer in
    time, the error for a refusal; None when something answers there, or for an address that is no ``host:port``
    (``ray://``, ``http://``: left to Ray)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address:
        return None
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=limit).close()
    except TimeoutError:
        return ""
    except OSError as e:
        return f"nothing listens there: {type(e).__name__}"
    return None


def join(init: Callable[[str], None], temp_dir: str | None = None, log: Callable[[str], None] = print,
         before_exit: Callable[[], None] = lambda: None) -> Target:
    """Prints where Ray is joined, then calls ``init(address)`` (``"local"``: an embedded cluster). Nothing listening
    or a failure raises :class:`JoinFailed`; no success after :func:`timeout_s` ends the process with
    :data:`EXIT_NO_RAY` after ``before_exit`` (``ray.init`` cannot be interrupted while it retries)."""
    limit, start = timeout_s(), time.monotonic()
    where = target(temp_dir)
    log(where.line())
    if where.address is None:
        init("local")
        return where
    problem = unreachable(where.address, limit)
    if problem is not None:  # at once when nothing listens (the usual stale address), not after the timeout
        raise JoinFailed(where.give_up(limit, problem))

    def _give_up() -> None:
        print(f"error: {where.give_up(limit)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        before_exit()
        os._exit(EXIT_NO_RAY)

    timer = threading.Timer(max(limit - (time.monotonic() - start), 0.1), _give_up)
    timer.daemon = True
    timer.start()
    try:
        init(where.address)
    except Exception as e:  # noqa: BLE001 - whatever Ray raises, the user needs the address and the way out
        raise JoinFailed(where.give_up(limit, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}")) from None
    finally:
        timer.cancel()
    return where


def join_ray() -> None:
    """The driver's join, unless Ray is already initialised: token auth as Ray chose it, without its opt-out
    advice, and a token file Ray writes kept private."""
    import ray

    from qed_ray.service.ray_token import private_ray_token, quiet_opt_out_notice, restrict

    if ray.is_initialized():
        return
    quiet_opt_out_notice()  # auth stays on; only Ray's advice to switch it off is not printed
    with private_ray_token() as token:  # Ray writes a new ~/.ray/auth_token with the umask (0644): keep it 0600
        join(lambda address: ray.init(address=address, include_dashboard=False, log_to_driver=False,
                                      logging_level="WARNING"),
             log=lambda line: print(line, flush=True),
             before_exit=lambda: token is not None and token.exists() and restrict(token))
