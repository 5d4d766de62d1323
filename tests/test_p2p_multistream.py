"""Multistream-select sends the header and the protocol in one write (p2p._multistream)."""

import pytest
import trio
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.utils import encode_delim

from swarmtrain.p2p import P2P, PeerUnreachableError
from swarmtrain.p2p._multistream import PipelinedMultiselectClient

pytestmark = pytest.mark.trio

HEADER = b"/multistream/1.0.0"


class ScriptedPeer:
    """The far end of a stream: records what the client writes, answers from a script."""

    def __init__(self, answers: bytes):
        self.writes: list[bytes] = []
        self._answers = answers

    async def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    async def read(self, n: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        n = len(self._answers) if n is None or n < 0 else n
        chunk, self._answers = self._answers[:n], self._answers[n:]
        return chunk

    async def close(self) -> None:
        pass


async def select(answers: bytes, protocol="/swarmtrain/rpc/1.0.0"):
    peer = ScriptedPeer(answers)
    chosen = await PipelinedMultiselectClient().select_one_of(
        [protocol], MultiselectCommunicator(peer)
    )
    return chosen, peer.writes


async def test_header_and_protocol_go_out_in_one_write():
    protocol = "/swarmtrain/rpc/1.0.0"
    chosen, writes = await select(encode_delim(HEADER) + encode_delim(protocol.encode()))
    assert chosen == protocol
    assert writes == [encode_delim(HEADER) + encode_delim(protocol.encode())]


@pytest.mark.parametrize(
    "answers, error",
    [
        (encode_delim(HEADER) + encode_delim(b"na"), "not supported"),
        (encode_delim(b"/multistream/2.0.0") + encode_delim(b"x"), "protocol ID mismatch"),
        (encode_delim(HEADER) + encode_delim(b"/other/1.0"), "unrecognized response"),
        (encode_delim(HEADER), "read failed"),  # the peer closed the stream
    ],
)
async def test_bad_answers_fail_clearly(answers, error):
    with pytest.raises(MultiselectClientError, match=error):
        await select(answers)


async def test_real_hosts_negotiate_and_refuse_unknown_protocols():
    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        with pytest.raises(PeerUnreachableError, match="cannot open a /not/served/1"):
            await b.new_stream(a.peer_id, "/not/served/1.0.0")
        # the connection stays usable: the next stream negotiates a served protocol
        from google.protobuf.wrappers_pb2 import BytesValue

        async def echo(request, context):
            return request

        a.add_protobuf_handler("test::Echo.echo", echo, BytesValue)
        reply = await b.call_protobuf_handler(
            a.peer_id, "test::Echo.echo", BytesValue(value=b"ok"), BytesValue
        )
        assert reply.value == b"ok"


async def test_a_lazily_negotiated_stream_reports_a_refusal_on_its_first_read():
    from libp2p.network.stream.exceptions import StreamError

    async with P2P.create() as a, P2P.create(initial_peers=a.get_visible_maddrs()) as b:
        stream = await b.new_stream(a.peer_id, "/not/served/1.0.0", lazily=True)
        await stream.write(b"\x05hello")  # reaches a's multistream-select reader
        with trio.fail_after(10), pytest.raises(StreamError, match="does not serve"):
            await stream.read(100)
        await stream.reset()


async def test_a_lazy_stream_sends_the_lines_with_its_first_write_and_checks_the_answers():
    from libp2p.network.stream.exceptions import StreamError

    from swarmtrain.p2p._multistream import LazilyNegotiatedStream

    protocol = "/swarmtrain/rpc/1.0.0"
    lines = encode_delim(HEADER) + encode_delim(protocol.encode())
    peer = ScriptedPeer(lines + b"reply")
    stream = LazilyNegotiatedStream(peer, protocol)
    await stream.write(b"first")
    await stream.write(b"second")
    assert peer.writes == [lines + b"first", b"second"]
    assert await stream.read(100) == b"reply"
    # a large first write is not copied behind the lines: two writes
    peer = ScriptedPeer(lines)
    await LazilyNegotiatedStream(peer, protocol).write(bytes(1 << 20))
    assert [len(w) for w in peer.writes] == [len(lines), 1 << 20]
    # a read before any write sends the lines first; a refusal fails that read
    peer = ScriptedPeer(encode_delim(HEADER) + encode_delim(b"na"))
    with pytest.raises(StreamError, match="does not serve"):
        await LazilyNegotiatedStream(peer, protocol).read(10)
    assert peer.writes == [lines]
