"""Commands the lab runs, and whether this machine can run a lab at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

_iptables_tried = False
ALLOWED_CC = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"


def run(*command: str, timeout: float = 10.0, check: bool = True) -> str:
    """Run ``command``; its stdout. Raises ``RuntimeError`` with stderr when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here (None: they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespace tests need root"
    if shutil.which("ip") is None:
        return "network namespace tests need iproute2 (`ip`)"
    return None


def delay_line_unavailable_reason() -> str | None:
    """Like ``unavailable_reason``, and TUN devices can be opened (``/dev/net/tun``: the
    packet-level delay line, ``Lab.add_delayed_host``)."""
    reason = unavailable_reason()
    if reason is not None:
        return reason
    try:
        os.close(os.open("/dev/net/tun", os.O_RDWR))
    except OSError as e:
        return f"the packet-level delay line needs TUN devices (/dev/net/tun: {e.strerror})"
    return None


def iptables_unavailable_reason() -> str | None:
    """Like ``unavailable_reason``, and iptables is installed: if it is missing, try once per
    process to install it (``apt-get install -y iptables``, as CI may on a fresh machine)."""
    global _iptables_tried
    reason = unavailable_reason()
    if reason is not None:
        return reason
    if shutil.which("iptables") is None and not _iptables_tried and shutil.which("apt-get"):
        _iptables_tried = True
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for command in (
            ["apt-get", "install", "-y", "-q", "--no-download", "iptables"],  # from the cache
            ["apt-get", "update", "-q"],
            ["apt-get", "install", "-y", "-q", "iptables"],
        ):
            try:
                subprocess.run(command, capture_output=True, timeout=180, env=env)
            except (subprocess.TimeoutExpired, OSError):
                break
            if shutil.which("iptables") is not None:
                break
    if shutil.which("iptables") is None:
        return (
            "iptables is missing and `apt-get install -y iptables` did not work here "
            "(NAT boxes and packet loss need it)"
        )
    return None


def tc_available() -> bool:
    return shutil.which("tc") is not None


@contextlib.contextmanager
def congestion_control_allowed(name: str) -> Iterator[list[str] | None]:
    """A namespace other than the first may default only to an algorithm in the box's
    ``tcp_allowed_congestion_control`` (else EPERM): add ``name`` to it while inside (it only
    lets unprivileged sockets pick it; nobody's default changes), restore it afterwards.
    Yields the list in force when it was changed, None when ``name`` was already allowed."""
    with open(ALLOWED_CC) as f:
        before = f.read().split()
    if name in before:
        yield None
        return
    with open(ALLOWED_CC, "w") as f:
        f.write(" ".join([*before, name]))
    try:
        yield [*before, name]
    finally:
        with open(ALLOWED_CC, "w") as f:
            f.write(" ".join(before))
