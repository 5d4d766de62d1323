"""Chunked streaming: reassembly, limits before allocation, truncation and corruption."""

from __future__ import annotations

import anyio
import pytest
import torch

from swarmtrain.compression import (
    BlockwiseQuantization,
    CompressionInfo,
    Float16Compression,
    NoCompression,
    TensorAssembler,
    WireFormatError,
    WireLimitError,
    WireLimits,
    combine_from_streaming,
    compress_async,
    deserialize_torch_tensor,
    extract_async,
    receive_tensor,
    split_for_streaming,
)
from swarmtrain.proto import tensor_pb2


@pytest.fixture
def message():
    return NoCompression().compress(torch.arange(1000, dtype=torch.float32))  # 4000 bytes


@pytest.mark.parametrize("chunk_size", [1, 999, 1000, 1024, 4000, 10**6])
def test_round_trip_for_chunk_sizes(message, chunk_size):
    chunks = list(split_for_streaming(message, chunk_size))
    assert len(chunks) == max(1, -(-4000 // chunk_size))
    assert all(len(chunk.buffer) <= chunk_size for chunk in chunks)
    assert chunks[0].chunks == len(chunks) and chunks[0].buffer_size == 4000
    assert [chunk.chunk_index for chunk in chunks] == list(range(len(chunks)))
    wire = [tensor_pb2.Tensor.FromString(chunk.SerializeToString()) for chunk in chunks]
    restored = deserialize_torch_tensor(combine_from_streaming(wire))
    assert torch.equal(restored, torch.arange(1000, dtype=torch.float32))


def test_empty_and_zero_dim_tensors_stream():
    for tensor in (torch.empty(0, 3), torch.tensor(2.5)):
        chunks = list(split_for_streaming(NoCompression().compress(tensor), 16))
        restored = deserialize_torch_tensor(combine_from_streaming(chunks))
        assert restored.shape == tensor.shape and torch.equal(restored, tensor)


def test_whole_message_passes_through_assembler(message):
    assembler = TensorAssembler()
    result = assembler.feed(message.to_proto())
    assert result is not None and assembler.done
    assembler.finish()


def test_truncated_stream(message):
    chunks = list(split_for_streaming(message, 1000))
    with pytest.raises(WireFormatError, match="truncated: ended after 3 of 4 chunks"):
        combine_from_streaming(chunks[:3])
    with pytest.raises(WireFormatError, match="truncated"):
        combine_from_streaming([])


def test_short_last_chunk_is_truncation(message):
    chunks = list(split_for_streaming(message, 1000))
    chunks[-1].buffer = chunks[-1].buffer[:10]
    with pytest.raises(WireFormatError, match="truncated: 3010 of 4000"):
        combine_from_streaming(chunks)


def test_reordered_lost_and_extra_chunks(message):
    chunks = list(split_for_streaming(message, 1000))
    with pytest.raises(WireFormatError, match="expected chunk 1, got chunk 2"):
        combine_from_streaming([chunks[0], chunks[2], chunks[1], chunks[3]])
    with pytest.raises(WireFormatError, match="expected chunk 0"):
        combine_from_streaming(chunks[1:])
    with pytest.raises(WireFormatError, match="after the stream was complete"):
        combine_from_streaming([*chunks, chunks[3]])


def test_overrun_and_repeated_header(message):
    chunks = list(split_for_streaming(message, 1000))
    chunks[1].buffer += b"x"
    with pytest.raises(WireFormatError, match="overruns"):
        combine_from_streaming(chunks)
    chunks = list(split_for_streaming(message, 1000))
    chunks[2].dtype = "float16"
    with pytest.raises(WireFormatError, match="repeats header"):
        combine_from_streaming(chunks)


def test_checksum_detects_corruption(message):
    chunks = list(split_for_streaming(message, 1000))
    data = bytearray(chunks[2].buffer)
    data[7] ^= 0x01
    chunks[2].buffer = bytes(data)
    with pytest.raises(WireFormatError, match="crc32"):
        combine_from_streaming(chunks)
    unchecked = list(split_for_streaming(message, 1000, checksum=False))
    assert not unchecked[0].HasField("crc32")
    combine_from_streaming(unchecked)


def test_hostile_first_chunk_is_rejected_before_allocating():
    hostile = tensor_pb2.Tensor(
        size=[2**40], dtype="float32", chunks=2, chunk_index=0, buffer_size=2**42
    )
    with pytest.raises(WireLimitError):
        TensorAssembler().feed(hostile)
    lying = tensor_pb2.Tensor(size=[10], dtype="float32", chunks=2, buffer_size=2**40)
    with pytest.raises(WireLimitError, match="payload of 1099511627776 bytes"):
        TensorAssembler().feed(lying)
    lying.buffer_size = 41
    with pytest.raises(WireFormatError, match="must be 40 bytes, got 41"):
        TensorAssembler().feed(lying)
    many = tensor_pb2.Tensor(size=[10], dtype="float32", chunks=2**31, buffer_size=40)
    with pytest.raises(WireLimitError, match="chunks"):
        TensorAssembler(WireLimits(max_chunks=1000)).feed(many)
    first = next(split_for_streaming(NoCompression().compress(torch.zeros(100)), 64))
    with pytest.raises(WireLimitError):
        TensorAssembler(WireLimits(max_bytes=100)).feed(first)
    with pytest.raises(WireFormatError, match="expected shape"):
        TensorAssembler(expected_shape=(50,)).feed(first)


def test_invalid_chunk_size(message):
    with pytest.raises(ValueError, match="chunk_size"):
        next(split_for_streaming(message, 0))


def test_async_helpers_run_codecs_in_threads():
    tensor = torch.randn(5000)

    async def main():
        codec = BlockwiseQuantization(backend="torch")
        message = await compress_async(codec, tensor, CompressionInfo.from_tensor(tensor))
        decoded = await extract_async(message)
        assert torch.equal(decoded, codec.extract(message))

        async def stream():
            for chunk in split_for_streaming(Float16Compression().compress(tensor), 1024):
                yield chunk

        received = await receive_tensor(stream())
        assert torch.allclose(received, tensor, atol=1e-2)

        async def short():
            for chunk in list(split_for_streaming(message, 1024))[:-1]:
                yield chunk

        with pytest.raises(WireFormatError, match="truncated"):
            await receive_tensor(short())

    anyio.run(main)
