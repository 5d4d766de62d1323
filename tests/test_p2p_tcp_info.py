"""The walk from a libp2p connection down to its TCP socket (``tcp_info.tcp_socket_of``), used
by our yamux (long-path tuning) and AutoNAT (the RTT of a direct connection): between real
hosts on loopback, direct and through a relay."""

import pytest
import trio
from google.protobuf.wrappers_pb2 import StringValue

from swarmtrain.p2p import P2P
from swarmtrain.p2p._yamux import TunedYamux
from swarmtrain.p2p.tcp_info import tcp_rtt, tcp_socket_of

ECHO = "test::TcpInfo.echo"


async def echo(request, context):
    return request


def connections(p2p: P2P, peer) -> list:
    conns = p2p.host.get_network().connections.get(peer) or []
    return conns if isinstance(conns, list) else [conns]


@pytest.mark.trio
async def test_every_layer_of_a_direct_connection_leads_to_its_one_socket():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        a.add_protobuf_handler(ECHO, echo, StringValue)
        await b.call_protobuf_handler(a.peer_id, ECHO, StringValue(value="x"), StringValue)
        (conn,) = connections(b, a.peer_id)
        muxer = conn.muxed_conn
        assert isinstance(muxer, TunedYamux)
        sock = tcp_socket_of(conn)
        assert sock is not None
        assert tcp_socket_of(muxer) is sock
        assert tcp_socket_of(muxer.secured_conn) is sock
        assert tcp_socket_of(sock) is sock
        # the socket is this connection's: it goes to the address the muxer reports
        remote = muxer.get_remote_address()
        raw = getattr(sock, "socket", sock)  # a trio SocketStream answers getsockopt itself
        assert remote is not None and raw.getpeername()[:2] == tuple(remote)[:2]
        assert muxer.path_rtt is not None and muxer.path_rtt == pytest.approx(
            tcp_rtt(sock), abs=0.05
        )


@pytest.mark.trio
async def test_a_relayed_connection_has_no_socket_of_its_own():
    # the only socket under a relayed connection is the one to the relay: not this path's
    async with P2P.create() as relay:
        async with P2P.create(
            initial_peers=relay.get_visible_maddrs(), client_mode=True, use_hole_punching=False
        ) as target:
            target.add_protobuf_handler(ECHO, echo, StringValue)
            circuit = next(a for a in target.get_visible_maddrs() if "/p2p-circuit" in a)
            async with P2P.create(use_hole_punching=False) as dialer:
                await dialer.connect(circuit)
                with trio.fail_after(10):
                    await dialer.call_protobuf_handler(
                        target.peer_id, ECHO, StringValue(value="x"), StringValue
                    )
                for p2p, peer in ((dialer, target.peer_id), (target, dialer.peer_id)):
                    conns = connections(p2p, peer)
                    assert conns
                    for conn in conns:
                        assert tcp_socket_of(conn) is None
                        assert tcp_socket_of(conn.muxed_conn) is None
                        assert getattr(conn.muxed_conn, "path_rtt", None) is None
