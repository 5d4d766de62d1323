"""Header validation and hostile messages: nothing large is allocated before the checks."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from swarmtrain.compression import (
    Blockwise4BitQuantization,
    BlockwiseQuantization,
    CompressionType,
    NoCompression,
    TopKSparsification,
    Uniform8BitQuantization,
    WireFormatError,
    WireLimitError,
    WireLimits,
    check_header,
    deserialize_torch_tensor,
)
from swarmtrain.compression.wire import TensorMessage
from swarmtrain.proto import tensor_pb2


def proto(**fields) -> tensor_pb2.Tensor:
    defaults = {"dtype": "float32", "size": [4], "buffer": bytes(16)}
    defaults.update(fields)
    return tensor_pb2.Tensor(**defaults)


def test_valid_header():
    header = check_header(proto())
    assert header.shape == (4,) and header.dtype == torch.float32 and header.nbytes == 16


@pytest.mark.parametrize(
    ("size", "dtype"),
    [
        ([2**40], "float32"),
        ([2**20, 2**20], "int8"),
        ([2**31], "float64"),
        ([2**62, 2**62], "bool"),
    ],
)
def test_huge_declared_shape_is_rejected_before_allocating(size, dtype):
    message = proto(size=size, dtype=dtype, buffer=b"")
    with pytest.raises(WireLimitError, match="limit"):
        deserialize_torch_tensor(message)
    with pytest.raises(WireLimitError):
        NoCompression().extract(message)


def test_dimension_above_int64_is_rejected():
    with pytest.raises(WireLimitError, match="dimension"):
        check_header(proto(size=[2**64 - 1, 0], buffer=b""))


def test_limits_are_configurable():
    message = proto(size=[1000], buffer=bytes(4000))
    deserialize_torch_tensor(message)
    with pytest.raises(WireLimitError, match="4000 bytes, limit is 100"):
        deserialize_torch_tensor(message, limits=WireLimits(max_bytes=100))
    with pytest.raises(WireLimitError, match="dims"):
        check_header(proto(size=[1] * 5, buffer=bytes(4)), WireLimits(max_ndim=4))
    with pytest.raises(WireLimitError, match="dtype float32 is not accepted"):
        check_header(message, WireLimits(dtypes=frozenset({"float16"})))
    with pytest.raises(WireLimitError, match="compression NONE"):
        check_header(message, WireLimits(compressions=frozenset({CompressionType.FLOAT16})))
    with pytest.raises(WireLimitError, match="payload"):
        check_header(message, WireLimits(max_buffer_bytes=10))
    with pytest.raises(ValueError, match="max_bytes"):
        WireLimits(max_bytes=-1)


def test_expected_shape_and_dtype():
    message = proto(size=[2, 2])
    deserialize_torch_tensor(message, expected_shape=(2, 2), expected_dtype=torch.float32)
    with pytest.raises(WireFormatError, match="expected shape"):
        deserialize_torch_tensor(message, expected_shape=(4,))
    with pytest.raises(WireFormatError, match="expected dtype"):
        deserialize_torch_tensor(message, expected_dtype=torch.float16)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"dtype": "float128"}, "unknown dtype"),
        ({"dtype": ""}, "unknown dtype"),
        ({"compression": 99}, "unknown compression"),
        ({"dtype": "int32", "requires_grad": True}, "requires_grad"),
        ({"buffer": bytes(15)}, "must be 16 bytes, got 15"),
        ({"buffer": bytes(17)}, "must be 16 bytes, got 17"),
        ({"compression": CompressionType.FLOAT16}, "must be 8 bytes"),
        ({"compression": CompressionType.UNIFORM_8BIT}, "UNIFORM_8BIT payload"),
        ({"chunks": 3}, "one chunk of a stream"),
        ({"chunk_index": 1}, "one chunk of a stream"),
    ],
)
def test_malformed_headers(fields, match):
    with pytest.raises(WireFormatError, match=match):
        deserialize_torch_tensor(proto(**fields))


def corrupt(message: TensorMessage, offset: int, data: bytes) -> TensorMessage:
    buffer = message.buffer.copy()
    buffer[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
    return TensorMessage(buffer, message.size, message.dtype, message.compression)


def test_blockwise_corrupted_prefix():
    message = BlockwiseQuantization(block_size=64, backend="torch").compress(torch.randn(1000))
    assert BlockwiseQuantization().extract(message).shape == (1000,)
    with pytest.raises(WireFormatError, match="block size 100"):
        deserialize_torch_tensor(corrupt(message, 0, struct.pack("<I", 100)))
    with pytest.raises(WireFormatError, match="expected 2064"):  # 2**k, but the wrong one
        deserialize_torch_tensor(corrupt(message, 0, struct.pack("<I", 128)))
    with pytest.raises(WireFormatError, match="code size"):
        deserialize_torch_tensor(corrupt(message, 4, struct.pack("<I", 16)))
    four = Blockwise4BitQuantization().compress(torch.randn(1000))
    with pytest.raises(WireFormatError, match="BLOCKWISE_8BIT payload"):
        BlockwiseQuantization().extract(
            TensorMessage(four.buffer, four.size, four.dtype, CompressionType.BLOCKWISE_8BIT)
        )


def test_quantization_codebook_size_is_checked():
    message = Uniform8BitQuantization().compress(torch.randn(100))
    with pytest.raises(WireFormatError, match="codebook size"):
        deserialize_torch_tensor(corrupt(message, 0, struct.pack("<q", 2**40)))


def test_topk_corrupted_indices_and_counts():
    message = TopKSparsification(ratio=0.5).compress(torch.randn(10))  # k = 5, width 4
    deserialize_torch_tensor(message)
    with pytest.raises(WireFormatError, match="ascending"):
        deserialize_torch_tensor(corrupt(message, 16, struct.pack("<I", 10)))
    with pytest.raises(WireFormatError, match="ascending"):
        deserialize_torch_tensor(corrupt(message, 20, struct.pack("<I", 0)))
    with pytest.raises(WireFormatError, match="does not match"):
        deserialize_torch_tensor(corrupt(message, 0, struct.pack("<Q", 4)))
    with pytest.raises(WireFormatError, match="invalid"):
        deserialize_torch_tensor(corrupt(message, 0, struct.pack("<Q", 2**60)))
    with pytest.raises(WireFormatError, match="invalid"):
        deserialize_torch_tensor(corrupt(message, 8, struct.pack("<I", 3)))


def test_topk_hostile_dense_shape_is_limited():
    message = TopKSparsification().compress(torch.randn(100))
    hostile = TensorMessage(message.buffer, (2**40,), "float32", CompressionType.TOPK)
    with pytest.raises(WireLimitError):
        deserialize_torch_tensor(hostile)


def test_proto_round_trip_keeps_every_field():
    tensor = torch.randn(3, 4, requires_grad=True)
    message = Uniform8BitQuantization().compress(tensor)
    parsed = tensor_pb2.Tensor.FromString(message.to_proto().SerializeToString())
    restored = deserialize_torch_tensor(parsed)
    assert restored.requires_grad and restored.shape == (3, 4)
    assert TensorMessage.from_proto(parsed).compression == CompressionType.UNIFORM_8BIT
