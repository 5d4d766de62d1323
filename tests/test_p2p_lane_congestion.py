"""``P2PConfig.lane_congestion``: the TCP congestion control of lane sockets, set on both
ends' own sockets (the caller's dialled ones, the callee's accepted ones), real hosts on
loopback; a name the kernel refuses is logged once and lanes keep working."""

import logging
import os
import socket

import pytest
from google.protobuf.wrappers_pb2 import BytesValue, Int64Value

from swarmtrain.p2p import P2P
from swarmtrain.p2p.lane_connections import congestion_of

AVAILABLE = "/proc/sys/net/ipv4/tcp_available_congestion_control"
DEFAULT = "/proc/sys/net/ipv4/tcp_congestion_control"


def another_algorithm() -> str:
    """A loaded algorithm other than the default (the test shows the option took effect)."""
    if getattr(socket, "TCP_CONGESTION", None) is None:
        pytest.skip("TCP_CONGESTION is Linux only")
    try:
        with open(AVAILABLE) as f:
            available = f.read().split()
        with open(DEFAULT) as f:
            default = f.read().strip()
    except OSError:
        pytest.skip("no /proc/sys/net/ipv4 congestion control files")
    others = [name for name in available if name != default]
    if not others:
        pytest.skip(f"only {default} is loaded")
    return others[0]


def system_default() -> str:
    with open(DEFAULT) as f:
        return f.read().strip()


def lane_sockets(port: int) -> dict[str, list[str]]:
    """This process's TCP sockets with local or remote port ``port``: their congestion
    control, by end ("callee": local port, "caller": remote port)."""
    found: dict[str, list[str]] = {"callee": [], "caller": []}
    for fd in os.listdir("/proc/self/fd"):
        try:
            probe = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        with probe:
            try:
                if probe.type != socket.SOCK_STREAM or probe.family != socket.AF_INET:
                    continue
                local, remote = probe.getsockname()[1], probe.getpeername()[1]
            except OSError:
                continue
            name = congestion_of(probe)
            if local == port and name:
                found["callee"].append(name)
            elif remote == port and name:
                found["caller"].append(name)
    return found


async def total_size(requests, context):
    total = 0
    async for request in requests:
        total += len(request.value)
    return Int64Value(value=total)


async def bulk_call(caller, callee) -> None:
    reply = await caller.call_protobuf_handler(
        callee.peer_id,
        "t::C.total_size",
        [BytesValue(value=b"c" * 100_000)],
        Int64Value,
        stream_input=True,
        bulk=True,
    )
    assert reply.value == 100_000


async def two_lanes(callee_options: dict, caller_options: dict) -> None:
    """Two bulk calls from a caller to a callee, each over a new lane."""
    async with (
        P2P.create(**callee_options) as a,
        P2P.create(initial_peers=a.get_visible_maddrs(), **caller_options) as b,
    ):
        a.add_protobuf_handler("t::C.total_size", total_size, BytesValue, stream_input=True)
        for _ in range(2):
            await bulk_call(b, a)
            await b._bulk_pool.aclose()  # the next call opens a new lane
        assert b.statistics()["lanes_opened"] == 2


@pytest.mark.trio
async def test_lane_sockets_use_the_configured_congestion_control():
    algorithm = another_algorithm()
    async with (
        P2P.create(lane_congestion=algorithm) as a,
        P2P.create(initial_peers=a.get_visible_maddrs(), lane_congestion=algorithm) as b,
    ):
        a.add_protobuf_handler("t::C.total_size", total_size, BytesValue, stream_input=True)
        await bulk_call(b, a)
        assert b.statistics()["lanes_opened"] == 1
        ends = lane_sockets(a.lanes.port)
        assert ends["caller"] == [algorithm] and ends["callee"] == [algorithm], ends


@pytest.mark.trio
async def test_a_refused_congestion_control_is_logged_once_and_lanes_still_work(caplog):
    another_algorithm()  # Linux with the option
    with caplog.at_level(logging.WARNING, logger="swarmtrain.p2p.lane"):
        await two_lanes({}, {"lane_congestion": "nosuchcc"})
    refused = [r for r in caplog.records if "nosuchcc" in r.getMessage()]
    assert len(refused) == 1


def test_lane_congestion_is_validated():
    from swarmtrain.p2p.host import P2PConfig

    with pytest.raises(TypeError):
        P2PConfig(lane_congestion=b"bbr")
    for bad in ("", "x" * 16, "bb r\n"):
        with pytest.raises(ValueError):
            P2PConfig(lane_congestion=bad)
    assert P2PConfig(lane_congestion="bbr").lane_congestion == "bbr"


def test_auto_gives_only_long_paths_the_long_path_congestion_control():
    from swarmtrain.p2p.lane_connections import (
        AUTO_CONGESTION,
        LONG_PATH_CONGESTION,
        congestion_for_path,
    )

    assert congestion_for_path(AUTO_CONGESTION, 0.3, 0.01) == LONG_PATH_CONGESTION
    assert congestion_for_path(AUTO_CONGESTION, 0.01, 0.01) == LONG_PATH_CONGESTION
    assert congestion_for_path(AUTO_CONGESTION, 0.002, 0.01) is None  # a LAN
    assert congestion_for_path(AUTO_CONGESTION, None, 0.01) is None  # RTT unknown
    assert congestion_for_path(AUTO_CONGESTION, 0.0, 0.0) == LONG_PATH_CONGESTION
    for setting in (None, "cubic", "bbr"):  # set before connecting, or never
        assert congestion_for_path(setting, 0.3, 0.01) is None


def test_lane_congestion_defaults_to_auto():
    from swarmtrain.p2p.host import P2PConfig
    from swarmtrain.p2p.lane_connections import AUTO_CONGESTION

    assert P2PConfig().lane_congestion == AUTO_CONGESTION


@pytest.mark.trio
@pytest.mark.parametrize("long_path", [True, False])
async def test_auto_sets_the_long_path_congestion_control_on_long_paths_only(
    monkeypatch, long_path
):
    """Real lanes on loopback under the default ``"auto"``: with ``lane_stripe_min_rtt=0``
    every path counts as long and both ends' lane sockets switch (to a loaded algorithm other
    than the system's, so the switch shows); with the default threshold loopback is short and
    they keep the system's."""
    from swarmtrain.p2p import lane_connections

    algorithm, default = another_algorithm(), system_default()
    monkeypatch.setattr(lane_connections, "LONG_PATH_CONGESTION", algorithm)
    options = {"lane_stripes": 1}
    if long_path:
        options["lane_stripe_min_rtt"] = 0.0
    async with (
        P2P.create(**options) as a,
        P2P.create(initial_peers=a.get_visible_maddrs(), **options) as b,
    ):
        a.add_protobuf_handler("t::C.total_size", total_size, BytesValue, stream_input=True)
        await bulk_call(b, a)
        assert b.statistics()["lanes_opened"] == 1
        ends = lane_sockets(a.lanes.port)
        expected = algorithm if long_path else default
        assert ends["caller"] == [expected] and ends["callee"] == [expected], ends


@pytest.mark.trio
async def test_auto_refused_by_the_kernel_is_logged_once_and_lanes_still_work(monkeypatch, caplog):
    from swarmtrain.p2p import lane_connections

    another_algorithm()  # Linux with the option
    monkeypatch.setattr(lane_connections, "LONG_PATH_CONGESTION", "nosuchcc")
    long_paths = {"lane_stripe_min_rtt": 0.0, "lane_stripes": 1}
    with caplog.at_level(logging.INFO, logger="swarmtrain.p2p.lane"):
        await two_lanes(long_paths, long_paths)
    refused = [r for r in caplog.records if "nosuchcc" in r.getMessage()]
    assert len(refused) == 2, [r.getMessage() for r in refused]  # once per host (both ends)
    assert all(r.levelno == logging.INFO for r in refused)


def test_a_caller_dials_few_stripes_only_when_both_ends_use_the_long_path_control():
    from swarmtrain.p2p.lane_connections import (
        LONG_PATH_CONGESTION,
        LONG_PATH_STRIPES,
        stripes_to_dial,
    )

    both = LONG_PATH_CONGESTION
    assert stripes_to_dial(8, both, both) == LONG_PATH_STRIPES
    assert stripes_to_dial(1, both, both) == 1
    assert stripes_to_dial(8, both, None) == 8  # the callee sends with cubic: many flows
    assert stripes_to_dial(8, None, both) == 8
    assert stripes_to_dial(8, "cubic", "cubic") == 8


def test_the_long_path_control_is_what_this_process_may_set(monkeypatch):
    from swarmtrain.p2p import lane_connections

    another_algorithm()  # Linux with the option
    assert lane_connections.long_path_congestion(None) is None
    assert lane_connections.long_path_congestion("cubic") == "cubic"
    expected = lane_connections.LONG_PATH_CONGESTION
    probe = socket.socket()
    with probe:
        if lane_connections.set_congestion(probe, expected) is not None:
            expected = None
    assert lane_connections.long_path_congestion("auto") == expected
    monkeypatch.setattr(lane_connections, "LONG_PATH_CONGESTION", "nosuchcc")
    assert lane_connections.long_path_congestion("auto") is None  # refused: the system's


@pytest.mark.trio
@pytest.mark.parametrize("callee_setting", ["auto", None])
async def test_a_striped_lane_dials_few_stripes_when_both_ends_use_the_long_path_control(
    monkeypatch, callee_setting
):
    """Real hosts, every path counted as long (``lane_stripe_min_rtt=0``), the long-path
    control patched to a loaded algorithm this process may set: the caller dials
    ``LONG_PATH_STRIPES`` connections when the callee's ticket says it uses that control too,
    all granted ones when it keeps the system's."""
    from swarmtrain.p2p import lane_connections

    monkeypatch.setattr(lane_connections, "LONG_PATH_CONGESTION", another_algorithm())
    options = {"lane_stripe_min_rtt": 0.0, "lane_stripes": 8}
    async with (
        P2P.create(lane_congestion=callee_setting, **options) as a,
        P2P.create(initial_peers=a.get_visible_maddrs(), **options) as b,
    ):
        a.add_protobuf_handler("t::C.total_size", total_size, BytesValue, stream_input=True)
        await bulk_call(b, a)
        assert b.statistics()["striped_lanes_opened"] == 1
        dialled = len(lane_sockets(a.lanes.port)["caller"])
        expected = lane_connections.LONG_PATH_STRIPES if callee_setting == "auto" else 8
        assert dialled == expected
