"""Every assumption swarmtrain makes about py-libp2p's internals, asserted in one place.

When py-libp2p changes (a version bump), this file fails first, naming the assumption and the
swarmtrain module that relies on it, instead of a round failing deep inside the averager.

Two kinds of checks:
- **facts** about stock py-libp2p (names, attributes, constants, wire shapes, reason strings),
  read in a fresh interpreter that never imports swarmtrain, so nothing is tuned there;
- **interop** between a swarmtrain host and a stock py-libp2p peer in another process
  (``tests/stock_libp2p_peer.py``), both directions, with payloads large enough to cross
  Noise's 64 KiB message limit, yamux's frame size and several receive windows: our
  re-implementations of Noise message framing, yamux data frames and window updates, and
  pipelined multistream-select must speak the stock wire.

(``tests/test_libp2p_scoped.py`` checks the other side: that none of this leaks into py-libp2p
itself, so stock hosts in the same process stay stock.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import stock_libp2p_peer
import tomllib
import trio

from swarmtrain.p2p import P2P
from swarmtrain.p2p._tuning import SUPPORTED_LIBP2P_VERSION

ROOT = Path(__file__).resolve().parent.parent
STOCK_PEER = Path(__file__).resolve().parent / "stock_libp2p_peer.py"

# (what must hold in stock py-libp2p, a Python expression, its expected value, who relies on it)
FACTS: list[tuple[str, str, object, str]] = [
    # -- dialling and the swarm
    (
        "the happy-eyeballs delay is a module constant",
        "hasattr(swarm, '_HAPPY_EYEBALLS_DELAY') and "
        "'_HAPPY_EYEBALLS_DELAY' in Swarm.dial_peer.__code__.co_names",
        True,
        "p2p/_tuning.py remove_dial_delay (our swarm's dial_peer reads it as 0)",
    ),
    (
        "the swarm has a retry_config of type RetryConfig",
        "'retry_config' in Swarm.__init__.__code__.co_names",
        True,
        "p2p/host.py (_build_host)",
    ),
    (
        "an accepted connection's handler is a swarm method that upgrades, then waits for the "
        "swarm's end",
        "all(n in Swarm._do_handle_inbound_connection.__code__.co_names for n in "
        "('upgrade_inbound_raw_conn', 'wait_finished')) and "
        "'_do_handle_inbound_connection' in Swarm._handle_inbound_connection.__code__.co_names",
        True,
        "p2p/_inbound_handler.py (our swarm's handler waits for its connection instead)",
    ),
    (
        "connections and muxers signal their close with an event",
        "'event_closed' in SwarmConn.__init__.__code__.co_names and "
        "'event_closed' in Yamux.__init__.__code__.co_names",
        True,
        "p2p/_inbound_handler.py",
    ),
    (
        "the swarm's own inbound cap is max_connections - min_connections",
        "'_inbound_limiter' in Swarm._init_connection_management.__code__.co_names and "
        "'min_connections' in Swarm._init_connection_management.__code__.co_names",
        True,
        "p2p/connection_limits.py (build_connection_config)",
    ),
    (
        "the pruner runs on request and the auto-connector calls its own maybe_connect",
        "callable(getattr(Swarm, '_schedule_prune', None)) and 'maybe_connect' in "
        "AutoConnector._periodic_check_task.__code__.co_names",
        True,
        "p2p/host.py (on_inbound), p2p/connection_limits.py (keep_auto_connector_idle)",
    ),
    (
        "the swarm remembers failed dials in a cache whose entries live _ttl seconds",
        "'_negative_peer_cache' in Swarm.__init__.__code__.co_names and "
        "'_ttl' in swarm._NegativePeerCache.__init__.__code__.co_names",
        True,
        "p2p/host.py (FAILED_DIAL_MEMORY)",
    ),
    (
        "the swarm lists connections per peer",
        "'connections' in Swarm.__init__.__code__.co_names",
        True,
        "p2p/dialling.py",
    ),
    (
        "the swarm can drop a dead connection",
        "callable(getattr(Swarm, 'remove_conn', None))",
        True,
        "p2p/dialling.py",
    ),
    (
        "new_host takes sec_opt, muxer_preference, listen_addrs, connection_config",
        "{'sec_opt', 'muxer_preference', 'listen_addrs', 'connection_config', 'announce_addrs'}"
        " <= set(inspect.signature(new_host).parameters)",
        True,
        "p2p/host.py (_build_host)",
    ),
    (
        "a connection's direction prints as 'inbound' for accepted connections",
        "str(Direction.INBOUND)",
        "inbound",
        "p2p/_tuning.py (identify_dialled_peers_only)",
    ),
    (
        "connections expose their direction",
        "hasattr(SwarmConn, 'direction')",
        True,
        "p2p/_tuning.py (identify_dialled_peers_only)",
    ),
    # -- identify
    (
        "identify is scheduled through BasicHost._schedule_identify(peer_id, *, reason)",
        "list(inspect.signature(BasicHost._schedule_identify).parameters)",
        ["self", "peer_id", "reason"],
        "p2p/_tuning.py, p2p/dialling.py",
    ),
    (
        "every new connection schedules identify with reason 'notifee-connected'",
        "'reason=\"notifee-connected\"' in inspect.getsource(basic_host)",
        True,
        "p2p/_tuning.py (identify_dialled_peers_only)",
    ),
    (
        "identify replaces all of a peer's addresses: its listen addresses through "
        "PeerStore.clear_addrs, its signed record through consume_peer_record (which clears "
        "the peer's PeerData itself)",
        "['clear_addrs' in identify_update.update_peerstore_from_identify.__code__.co_names, "
        "'clear_addrs' in PeerStore.consume_peer_record.__code__.co_names, "
        "type(new_host().get_peerstore()) is PeerStore]",
        [True, True, True],
        "p2p/_libp2p_fixes.py (CircuitKeepingPeerStore keeps /p2p-circuit addresses)",
    ),
    # -- circuit relay v2
    (
        "the relay splices each direction of a circuit in "
        "CircuitV2Protocol._relay_data(src, dst, peer, deadline, data limit), started by "
        "_handle_connect; it cleans up through _active_relays, a dict with one circuit per peer",
        "[list(inspect.signature(CircuitV2Protocol._relay_data).parameters), "
        "'_relay_data' in CircuitV2Protocol._handle_connect.__code__.co_names, "
        "'_active_relays' in CircuitV2Protocol._relay_data.__code__.co_names]",
        [
            ["self", "src_stream", "dst_stream", "peer_id", "deadline", "circuit_data_limit"],
            True,
            True,
        ],
        "p2p/_relay_splice.py (SplicingCircuitRelay: our copy loop, cleanup per circuit)",
    ),
    # -- TCP and Noise
    (
        "TrioTCPStream.read reads under read_lock from a trio stream",
        "all(n in inspect.getsource(TrioTCPStream) for n in ('read_lock', 'receive_some'))",
        True,
        "p2p/_io_tuning.py (BufferedTCPStream)",
    ),
    (
        "Noise length prefixes are 2 bytes",
        "noise_io.NoisePacketReadWriter.size_len_bytes",
        2,
        "p2p/_io_tuning.py (BatchingNoiseReadWriter)",
    ),
    (
        "a Noise message carries at most 65535 - 16 bytes of plaintext",
        "noise_io.MAX_PLAINTEXT_LENGTH",
        65535 - 16,
        "p2p/_io_tuning.py (BatchingNoiseReadWriter)",
    ),
    (
        "Noise writers encrypt with self.encrypt and write to read_writer.read_write_closer",
        "all(n in inspect.getsource(noise_io) for n in ('def encrypt', 'read_write_closer'))",
        True,
        "p2p/_io_tuning.py (BatchingNoiseReadWriter)",
    ),
    (
        "write_msg(msg, prefix_encoded=False)",
        "list(inspect.signature(noise_io.BaseNoiseMsgReadWriter.write_msg).parameters)",
        ["self", "msg", "prefix_encoded"],
        "p2p/_io_tuning.py",
    ),
    (
        "DCUtR's source-bound dials go through TCP._dial_resolved(maddr, source)",
        "[list(inspect.signature(tcp.TCP._dial_resolved).parameters),"
        " '_dial_resolved(maddr, source=source)' in inspect.getsource(tcp.TCP.dial_with_source)]",
        [["self", "maddr", "source"], True],
        "p2p/_libp2p_fixes.py (HolePunchTCP)",
    ),
    (
        "tcp has _set_reuse_flags; dials return RawConnection(TrioTCPStream(stream), True)",
        "hasattr(tcp, '_set_reuse_flags') and 'RawConnection(read_write_closer, True)'"
        " in inspect.getsource(tcp.TCP._dial_resolved)",
        True,
        "p2p/_libp2p_fixes.py (HolePunchTCP)",
    ),
    (
        "the swarm's transports are listed by transport_manager.get_transports()",
        "callable(getattr(TransportManager, 'get_transports', None))",
        True,
        "p2p/_libp2p_fixes.py (use_hole_punch_tcp)",
    ),
    (
        "raw connections keep their TrioTCPStream in .stream; it reads from .stream",
        "[sorted({'stream', 'read_lock'} - set(TrioTCPStream.__init__.__code__.co_names)),"
        " 'stream' in RawConnection.__init__.__code__.co_names]",
        [[], True],
        "p2p/_io_tuning.py (adopt_raw_connection)",
    ),
    (
        "Noise sessions are SecureSession(conn=NoiseTransportReadWriter(...))",
        "[inspect.getsource(noise_patterns).count('NoiseTransportReadWriter(conn, noise_state)'),"
        " 'conn' in SecureSession.__init__.__code__.co_names]",
        [2, True],
        "p2p/_io_tuning.py (adopt_secured_connection)",
    ),
    # -- yamux
    (
        "yamux headers are '!BBHII', 12 bytes",
        "(yamux.YAMUX_HEADER_FORMAT, yamux.HEADER_SIZE)",
        ["!BBHII", 12],
        "p2p/_yamux.py (TunedYamuxStream.write)",
    ),
    (
        "yamux data frames are type 0",
        "yamux.TYPE_DATA",
        0,
        "p2p/_yamux.py (TunedYamuxStream.write)",
    ),
    (
        "yamux frames carry at most 64 KiB by default",
        "yamux.MAX_MESSAGE_SIZE",
        64 * 1024,
        "p2p/_yamux.py (our streams send 1 MiB)",
    ),
    (
        "yamux windows grow to 16 MiB",
        "yamux.MAX_WINDOW_SIZE",
        16 * 1024 * 1024,
        "p2p/_yamux.py (batched window updates)",
    ),
    (
        "YamuxStream sets the attributes our write and window code use",
        "sorted({'rw_lock', 'window_lock', 'send_closed', 'send_window', 'closed', 'stream_id',"
        " 'conn', 'recv_window', 'target_recv_window', '_pending_recv_release'}"
        " - set(YamuxStream.__init__.__code__.co_names))",
        [],
        "p2p/_yamux.py",
    ),
    (
        "a blocked yamux writer polls every 10 ms (what TunedYamuxStream.write replaces)",
        "'trio.sleep(0.01)' in inspect.getsource(YamuxStream.write)",
        True,
        "p2p/_yamux.py (woken writers)",
    ),
    (
        "credit arrives by assigning stream.send_window (+=) in the connection's read loop",
        "'stream.send_window += ' in inspect.getsource(yamux.Yamux)",
        True,
        "p2p/_yamux.py (the send_window property wakes writers)",
    ),
    (
        "window updates go through _auto_tune_and_send_window_update(bytes_read=...)",
        "'bytes_read' in inspect.signature(YamuxStream._auto_tune_and_send_window_update)"
        ".parameters",
        True,
        "p2p/_yamux.py (batched window updates)",
    ),
    (
        "send_window_update(increment, skip_lock=False) and _grow_to_delta(buffered)",
        "[list(inspect.signature(YamuxStream.send_window_update).parameters),"
        " list(inspect.signature(YamuxStream._grow_to_delta).parameters)]",
        [["self", "increment", "skip_lock"], ["self", "buffered"]],
        "p2p/_yamux.py",
    ),
    (
        "Yamux keeps unread bytes in stream_buffers",
        "'stream_buffers' in Yamux.__init__.__code__.co_names",
        True,
        "p2p/_yamux.py (batched window updates)",
    ),
    (
        "received DATA goes into stream_buffers[sid].extend(...) before recv_window drops "
        "(3 places: SYN, ACK, data), and new buffers are assigned as bytearray()",
        "[inspect.getsource(yamux.Yamux).count('self.stream_buffers[stream_id].extend('),"
        " inspect.getsource(yamux.Yamux).count('.recv_window -= len('),"
        " inspect.getsource(yamux.Yamux).count('self.stream_buffers[stream_id] = bytearray()')]",
        [3, 3, 2],
        "p2p/_yamux.py (_WindowedBuffer: receive windows enforced)",
    ),
    (
        "a peer past a receive window is only logged (what _WindowedBuffer replaces)",
        "'peer exceeded' in inspect.getsource(yamux.Yamux.handle_incoming)",
        True,
        "p2p/_yamux.py (_WindowedBuffer)",
    ),
    (
        "Yamux keeps its nursery in _nursery and closes with close()",
        "['_nursery' in Yamux.__init__.__code__.co_names, hasattr(Yamux, 'close')]",
        [True, True],
        "p2p/_yamux.py (TunedYamux.window_exceeded)",
    ),
    (
        "frames are written by Yamux._write_frame under _write_lock to secured_conn",
        "all(n in inspect.getsource(Yamux._write_frame) for n in ('_write_lock', 'secured_conn'))",
        True,
        "p2p/_yamux.py (TunedYamux._write_frame)",
    ),
    (
        "RTT pings run in Yamux._measure_rtt_loop",
        "hasattr(Yamux, '_measure_rtt_loop')",
        True,
        "p2p/_yamux.py (batched window updates)",
    ),
    (
        "muxed streams expose closed/recv_closed/send_closed/reset_received flags",
        "sorted({'closed', 'recv_closed', 'send_closed', 'reset_received'}"
        " - set(YamuxStream.__init__.__code__.co_names))",
        [],
        "p2p/rpc_stream.py (is_reusable)",
    ),
    (
        "MuxerMultistream.new_conn builds yamux connections as Yamux(...) by name",
        "'Yamux(' in inspect.getsource(MuxerMultistream.new_conn)",
        True,
        "p2p/_yamux.py (TunedMuxerMultistream adopts them)",
    ),
    (
        "Yamux builds its streams as YamuxStream(...) and stores them in self.streams[id]",
        "[inspect.getsource(Yamux).count('YamuxStream(stream_id, self, '),"
        " inspect.getsource(Yamux).count('self.streams[stream_id] = stream'),"
        " inspect.getsource(Yamux).count('self.streams = ')]",
        [2, 2, 0],
        "p2p/_yamux.py (_AdoptingStreams)",
    ),
    (
        "the upgrader keeps security_multistream and muxer_multistream (instance attributes)",
        "sorted({'security_multistream', 'muxer_multistream'}"
        " - set(TransportUpgrader.__init__.__code__.co_names))",
        [],
        "p2p/_yamux.py, p2p/_multistream.py",
    ),
    # -- multistream-select
    (
        "hosts and selectors hold their own MultiselectClient() in .multiselect_client",
        "['multiselect_client' in BasicHost.__init__.__code__.co_names,"
        " 'multiselect_client' in GenericMultistreamSelector.__init__.__code__.co_names,"
        " '_selector' in SecurityMultistream.__init__.__code__.co_names,"
        " '_selector' in MuxerMultistream.__init__.__code__.co_names]",
        [True] * 4,
        "p2p/_multistream.py (use_pipelined_multistream)",
    ),
    (
        "multistream-select header and refusal",
        "(client.MULTISELECT_PROTOCOL_ID, client.PROTOCOL_NOT_FOUND_MSG)",
        ["/multistream/1.0.0", "na"],
        "p2p/_multistream.py",
    ),
    (
        "select_one_of(protocols, communicator, negotiate_timeout)",
        "list(inspect.signature(client.MultiselectClient.select_one_of).parameters)",
        ["self", "protocols", "communicator", "negotiate_timeout"],
        "p2p/_multistream.py",
    ),
    (
        "multistream lines are varint-length-prefixed and end with a newline",
        "encode_delim(b'/x')",
        list(b"\x03/x\n"),
        "p2p/_multistream.py (selection_lines)",
    ),
    # -- logging
    (
        "swarm_connection logs through the logging module's functions (the root logger)",
        "swarm_connection.logging is logging",
        True,
        "p2p/_tuning.py (log_connections_to_module_logger)",
    ),
    (
        "Swarm.add_conn builds its SwarmConn after a function-local import",
        "'SwarmConn' in Swarm.add_conn.__code__.co_names",
        True,
        "p2p/_tuning.py (log_connections_to_module_logger)",
    ),
    # -- pubsub
    (
        "GossipSub hooks we override exist",
        "[hasattr(GossipSub, n) for n in ('_handle_dropped_rpc', '_check_spam_protection')]",
        [True, True],
        "p2p/_gossipsub.py (_Router)",
    ),
    (
        "Pubsub hooks we override or call exist",
        "[hasattr(Pubsub, n) for n in ('notify_subscriptions', 'push_msg', 'stream_handler',"
        " 'ensure_peer_stream', '_handle_dead_peer')]",
        [True] * 5,
        "p2p/_gossipsub.py (_Pubsub)",
    ),
]

FACT_SCRIPT = """
import inspect, json, logging, sys
from libp2p import new_host
import libp2p.network.swarm as swarm
from libp2p.network.swarm import Swarm
from libp2p.network.connection import swarm_connection
from libp2p.network.connection.swarm_connection import SwarmConn
from libp2p.rcmgr import Direction
import libp2p.host.basic_host as basic_host
from libp2p.host.basic_host import BasicHost
from libp2p.io.trio import TrioTCPStream
import libp2p.security.noise.io as noise_io
from libp2p.transport.tcp import tcp
from libp2p.transport.manager import TransportManager
from libp2p.transport.upgrader import TransportUpgrader
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.peerstore import PeerStore
from libp2p.identity import update as identify_update
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.network.auto_connector import AutoConnector
import libp2p.security.noise.patterns as noise_patterns
from libp2p.security.secure_session import SecureSession
from libp2p.security.security_multistream import SecurityMultistream
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.protocol_muxer.generic_selector import GenericMultistreamSelector
import libp2p.stream_muxer.yamux.yamux as yamux
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream
from libp2p.protocol_muxer import multiselect_client as client
from libp2p.utils import encode_delim
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub

def value(expression):
    try:
        result = eval(expression)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if isinstance(result, (bytes, tuple)):
        result = list(result)
    return {"value": result}

expressions = json.loads(sys.stdin.read())
assert "swarmtrain" not in sys.modules
print(json.dumps([value(e) for e in expressions]))
"""


@pytest.fixture(scope="module")
def stock_facts() -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-c", FACT_SCRIPT],
        input=json.dumps([expression for _, expression, _, _ in FACTS]),
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",  # never our checkout: a stock interpreter
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_the_installed_libp2p_is_the_one_we_pin():
    pinned = [
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.replace(" ", "").startswith("libp2p==")
    ]
    assert pinned == [f"libp2p=={SUPPORTED_LIBP2P_VERSION}"]
    assert version("libp2p") == SUPPORTED_LIBP2P_VERSION


@pytest.mark.parametrize("index", range(len(FACTS)), ids=[fact[0] for fact in FACTS])
def test_stock_libp2p_is_shaped_as_we_assume(stock_facts, index):
    what, expression, expected, relied_on_by = FACTS[index]
    got = stock_facts[index]
    assert got == {"value": expected}, (
        f"py-libp2p {version('libp2p')} changed: {what}\n  {expression}\n  expected "
        f"{expected!r}, got {got}\n  relied on by swarmtrain/{relied_on_by}"
    )


# ------------------------------------------------------------------------------------- interop

SIZE = 3 * 1024 * 1024 + 12345  # > Noise's 64 KiB messages, > our 1 MiB yamux frames, > windows
# the same echo protocol on both sides (the stock peer's module imports no swarmtrain)
ECHO_PROTOCOL, pattern, read_to_end, echo_handler = (
    stock_libp2p_peer.ECHO_PROTOCOL,
    stock_libp2p_peer.pattern,
    stock_libp2p_peer.read_to_end,
    stock_libp2p_peer.echo_handler,
)


class StockPeer:
    """tests/stock_libp2p_peer.py in a subprocess, driven by JSON lines."""

    def __init__(self, process: trio.Process):
        self.process = process
        self._buffer = b""

    async def receive(self) -> dict:
        with trio.fail_after(60):
            while b"\n" not in self._buffer:
                chunk = await self.process.stdout.receive_some()
                if not chunk:
                    raise AssertionError("the stock peer exited")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    async def send(self, command: dict) -> None:
        await self.process.stdin.send_all((json.dumps(command) + "\n").encode())


@pytest.mark.trio
async def test_swarmtrain_and_stock_libp2p_peers_interoperate_both_ways():
    process = await trio.lowlevel.open_process(
        [sys.executable, str(STOCK_PEER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd="/",  # a stock interpreter: swarmtrain is not importable from here
    )
    try:
        stock = StockPeer(process)
        hello = await stock.receive()
        async with P2P.create(initial_peers=[f"{hello['addrs'][0]}"]) as ours:
            ours._host.set_stream_handler(ECHO_PROTOCOL, echo_handler)
            # we dial, pipeline multistream-select, and send through our Noise/yamux paths
            data = pattern(SIZE)
            with trio.fail_after(60):
                stream = await ours.new_stream(hello["peer_id"], ECHO_PROTOCOL)
                async with trio.open_nursery() as nursery:

                    async def send():
                        await stream.write(data)
                        await stream.close()

                    nursery.start_soon(send)
                    echoed = await read_to_end(stream)
            assert echoed == data
            # the stock peer opens a stream to us and sends through its stock paths
            await stock.send(
                {
                    "echo_to": str(ours.get_visible_maddrs()[0]).split("/p2p/")[0],
                    "peer_id": str(ours.peer_id),
                    "size": SIZE,
                }
            )
            assert await stock.receive() == {"echo_ok": True, "got": SIZE}
        await stock.send({"quit": True})
        with trio.fail_after(30):
            await process.wait()
        assert process.returncode == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        for pipe in (process.stdin, process.stdout):
            await pipe.aclose()
