"""Property tests of the tensor wire format: headers are validated or refused with
``WireFormatError``; chunked streams reassemble exactly or fail typed; declared sizes beyond
the limits allocate nothing; all-reduce parts decode to what was expected or to None."""

from __future__ import annotations

import tracemalloc

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmtrain.averaging.allreduce_parts import decode_part, part_header, part_to_proto
from swarmtrain.compression import (
    CompressionType,
    Float16Compression,
    NoCompression,
    TensorAssembler,
    WireFormatError,
    WireLimitError,
    WireLimits,
    check_header,
    combine_from_streaming,
    split_for_streaming,
)
from swarmtrain.compression.wire import TensorHeader, TensorMessage
from swarmtrain.proto import averaging_pb2, tensor_pb2

DTYPE_NAMES = ["float32", "float16", "bfloat16", "float64", "int64", "bool", "uint8", "complex64"]
LIMITS = WireLimits(max_bytes=1 << 16, max_buffer_bytes=1 << 17, max_ndim=8, max_chunks=64)


@st.composite
def tensor_protos(draw):
    """A Tensor message with arbitrary header fields and a short buffer."""
    return tensor_pb2.Tensor(
        buffer=draw(st.binary(max_size=64)),
        size=draw(st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 9), max_size=10)),
        requires_grad=draw(st.booleans()),
        dtype=draw(st.sampled_from([*DTYPE_NAMES, "", "float8", "x" * 100])),
        compression=draw(st.integers(0, 12)),
        chunks=draw(st.sampled_from([0, 0, 1, 2, 2**32 - 1])),
        chunk_index=draw(st.sampled_from([0, 0, 1])),
        buffer_size=draw(st.sampled_from([0, 8, 64, 2**40, 2**64 - 1])),
    )


@given(tensor_protos())
def test_any_header_is_validated_or_refused(proto):
    try:
        header = check_header(proto, LIMITS)
    except WireFormatError:
        return
    assert isinstance(header, TensorHeader)
    assert header.nbytes <= LIMITS.max_bytes and len(header.shape) <= LIMITS.max_ndim
    assert len(proto.buffer) <= LIMITS.max_buffer_bytes


@st.composite
def messages(draw):
    """A lossless or float16 message of a random float tensor."""
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=8))
    values = draw(hnp.arrays(np.float32, shape, elements=st.floats(-1e3, 1e3, width=32)))
    codec = draw(st.sampled_from([NoCompression(), Float16Compression()]))
    return codec.compress(torch.from_numpy(values))


@given(messages(), st.integers(1, 300), st.booleans())
def test_streams_reassemble_exactly(message, chunk_size, checksum):
    chunks = list(split_for_streaming(message, chunk_size, checksum=checksum))
    result = combine_from_streaming(chunks, WireLimits(max_chunks=len(chunks)))
    assert result.size == message.size and result.dtype == message.dtype
    assert bytes(result.buffer) == bytes(message.buffer)


@given(messages(), st.integers(1, 64), st.data())
def test_damaged_streams_fail_with_wire_format_error(message, chunk_size, data):
    chunks = list(split_for_streaming(message, chunk_size, checksum=True))
    attack = data.draw(
        st.sampled_from(["drop", "repeat", "swap", "truncate", "flip", "extra", "header"])
    )
    at = data.draw(st.integers(0, len(chunks) - 1))
    if attack == "drop":
        del chunks[at]
    elif attack == "repeat":
        chunks.insert(at, chunks[at])
    elif attack == "swap" and len(chunks) > 1:
        other = (at + 1) % len(chunks)
        chunks[at], chunks[other] = chunks[other], chunks[at]
    elif attack == "truncate" and chunks[at].buffer:
        chunks[at] = tensor_pb2.Tensor(**_fields(chunks[at], buffer=chunks[at].buffer[:-1]))
    elif attack == "flip" and chunks[at].buffer:
        flipped = bytearray(chunks[at].buffer)
        flipped[data.draw(st.integers(0, len(flipped) - 1))] ^= 1
        chunks[at] = tensor_pb2.Tensor(**_fields(chunks[at], buffer=bytes(flipped)))
    elif attack == "header" and at:
        chunks[at] = tensor_pb2.Tensor(**_fields(chunks[at], dtype="float32"))
    else:  # one chunk too many
        chunks.append(tensor_pb2.Tensor(buffer=b"x", chunk_index=len(chunks)))
    try:
        combine_from_streaming(chunks, LIMITS)
    except WireFormatError:
        return
    raise AssertionError(f"a {attack} stream was accepted")


def _fields(chunk: tensor_pb2.Tensor, **changes) -> dict:
    fields = {field.name: value for field, value in chunk.ListFields()}
    return {**fields, **changes}


@given(
    st.integers(LIMITS.max_buffer_bytes + 1, 2**64 - 1),
    st.integers(LIMITS.max_chunks + 1, 2**32 - 1),
    st.booleans(),
)
def test_declared_sizes_beyond_the_limits_allocate_nothing(buffer_size, chunks, too_many):
    first = tensor_pb2.Tensor(
        buffer=b"\x00" * 8,
        size=[2],
        dtype="float32",
        chunks=chunks if too_many else 2,
        buffer_size=buffer_size,
    )
    tracemalloc.start()
    try:
        try:
            TensorAssembler(LIMITS).feed(first)
        except WireLimitError:
            pass
        else:
            raise AssertionError("an oversized stream was accepted")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # (declared sizes above 2 MiB are measurable; the rest is room for other threads)
    assert peak < min(max(buffer_size // 2, 1 << 20), 16 << 20)


@st.composite
def parts(draw):
    """An all-reduce part as a peer might send it: valid, or with any field changed."""
    numel = draw(st.integers(0, 40))
    values = torch.from_numpy(
        draw(hnp.arrays(np.float32, (numel,), elements=st.floats(-10, 10, width=32)))
    )
    codec = draw(st.sampled_from([NoCompression(), Float16Compression()]))
    message = codec.compress(values)
    attached = draw(st.booleans())
    proto = part_header(message) if attached else part_to_proto(message)
    payload = message.buffer.copy() if attached else None
    change = draw(st.sampled_from(["none", "size", "dtype", "compression", "payload"]))
    if change == "size":
        proto.size[:] = draw(st.lists(st.integers(0, 2**64 - 1), max_size=3))
    elif change == "dtype":
        proto.dtype = draw(st.sampled_from([*DTYPE_NAMES, "nope"]))
    elif change == "compression":
        proto.compression = draw(st.integers(0, 9))
    elif change == "payload":
        raw = draw(st.binary(max_size=200))
        if attached:
            payload = np.frombuffer(raw, np.uint8).copy()
        else:
            proto.buffer = raw
    return proto, payload, values, change


@given(parts(), st.booleans())
def test_parts_decode_to_the_expected_shape_or_none(item, into):
    proto, payload, values, change = item
    out = torch.empty_like(values) if into else None
    decoded = decode_part(proto, payload, (values.numel(),), torch.float32, out=out)
    if decoded is None:
        assert change != "none"
        return
    assert tuple(decoded.shape) == (values.numel(),) and decoded.dtype == torch.float32
    if change == "none":
        tolerance = 0 if proto.compression == CompressionType.NONE else 1e-2
        assert torch.allclose(decoded, values, atol=tolerance, rtol=tolerance)


def test_parts_message_type():
    assert isinstance(
        part_header(TensorMessage(np.zeros(0, np.uint8), (0,), "float32", 0)),
        averaging_pb2.AveragingTensorPart,
    )
