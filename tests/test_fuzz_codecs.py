"""Property tests of every codec: random tensors round-trip within the codec's bound; a random
payload under any valid header decodes to a tensor of that header or fails with
``WireFormatError``, never another exception."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmtrain.compression import (
    Blockwise4BitQuantization,
    BlockwiseQuantization,
    CompressionType,
    Float16Compression,
    NoCompression,
    Quantile8BitQuantization,
    ScaledFloat16Compression,
    TopKSparsification,
    Uniform8BitQuantization,
    WireFormatError,
    deserialize_torch_tensor,
    get_codec,
)
from swarmtrain.compression.wire import TensorHeader, TensorMessage, dtype_from_name, numpy_dtype
from swarmtrain.proto import tensor_pb2

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
WIRE_DTYPES = ["float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64"]
WIRE_DTYPES += ["int32", "int16", "int8", "uint8", "bool"]
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=9)


@st.composite
def tensors(draw, dtype=None, bound=1e4):
    """A float tensor of finite values in [-bound, bound] (0-d and empty ones included)."""
    dtype = dtype or draw(st.sampled_from(FLOAT_DTYPES))
    shape = draw(shapes)
    elements = st.floats(-bound, bound, allow_nan=False, width=32)
    values = draw(hnp.arrays(np.float32, shape, elements=elements))
    tensor = torch.from_numpy(values).to(dtype)
    return tensor


def round_trip(codec, tensor: torch.Tensor) -> torch.Tensor:
    message = codec.compress(tensor)
    decoded = deserialize_torch_tensor(message.to_proto())
    assert decoded.shape == tensor.shape and decoded.dtype == tensor.dtype
    return decoded


def as64(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to(torch.float64)


def rounding(dtype: torch.dtype) -> float:
    """Relative rounding of a value stored in ``dtype`` (the decoded tensor's own dtype)."""
    return {torch.float16: 2**-11, torch.bfloat16: 2**-8}.get(dtype, 2**-24)


@given(tensors())
def test_lossless_and_float16_round_trip(tensor):
    assert torch.equal(round_trip(NoCompression(), tensor), tensor)
    decoded = as64(round_trip(Float16Compression(), tensor))
    # float16 keeps ~11 bits; bfloat16 travels uncompressed
    bound = as64(tensor).abs() * 2**-11 + 2**-24
    assert torch.all((decoded - as64(tensor)).abs() <= bound)


@given(tensors())
def test_scaled_float16_round_trip(tensor):
    decoded = as64(round_trip(ScaledFloat16Compression(), tensor))
    source = as64(tensor)
    if source.numel() == 0:
        return
    rows = source.reshape(-1, source.shape[-1]) if source.dim() else source.reshape(1, 1)
    error = (decoded.reshape(rows.shape) - rows).abs()
    # (x - mean) / std in float16: a relative error of 2**-11 of |x - mean| per value, plus
    # float32 arithmetic on the statistics and the rounding of the decoded dtype
    spread = (rows - rows.mean(dim=1, keepdim=True)).abs().amax(dim=1, keepdim=True)
    scale = rows.abs().amax(dim=1, keepdim=True)
    bound = spread * 2**-10 + scale * (2**-20 + 2 * rounding(tensor.dtype)) + 1e-6
    assert torch.all(error <= bound)


@pytest.mark.parametrize("codec", [Uniform8BitQuantization(), Quantile8BitQuantization()])
@given(tensor=tensors(bound=1e3))
def test_codebook_quantization_keeps_range_and_sum(codec, tensor):
    """Each code is the mean of its bucket: decoded values stay within the tensor's range and
    their sum is the tensor's (up to float32 arithmetic)."""
    decoded = as64(round_trip(codec, tensor))
    source = as64(tensor)
    if source.numel() == 0:
        return
    low, high = source.min(), source.max()
    slack = (high.abs() + low.abs()) * (2**-20 + rounding(tensor.dtype))
    assert torch.all(decoded >= low - slack) and torch.all(decoded <= high + slack)
    if tensor.dtype in (torch.float32, torch.float64):  # the decoded dtype rounds each value
        total = source.abs().sum()
        assert abs(float(decoded.sum() - source.sum())) <= float(total) * 1e-5 + 1e-9


@pytest.mark.parametrize(
    "codec, levels",
    [
        (BlockwiseQuantization(block_size=16, backend="torch"), 127),
        (Blockwise4BitQuantization(16), 7),
    ],
)
@given(tensor=tensors())
def test_blockwise_error_is_half_a_step_of_its_block(codec, levels, tensor):
    decoded = as64(round_trip(codec, tensor)).reshape(-1)
    source = as64(tensor).reshape(-1)
    for start in range(0, source.numel(), 16):
        block, got = source[start : start + 16], decoded[start : start + 16]
        absmax = float(block.abs().max())
        bound = absmax / levels * (0.5 + 1e-5) + absmax * 2 * rounding(tensor.dtype)
        if absmax < levels / FLOAT32_MAX:
            bound = absmax  # such a block decodes as zeros (the module docstring)
        assert float((got - block).abs().max()) <= bound + 1e-30


@given(tensors(), st.floats(0.01, 1.0))
def test_topk_keeps_the_largest_values_exactly(tensor, ratio):
    codec = TopKSparsification(ratio=ratio)
    decoded = round_trip(codec, tensor).reshape(-1)
    source = tensor.reshape(-1)
    kept = decoded != 0
    assert torch.equal(decoded[kept], source[kept])
    if source.numel():
        k = codec.k_for(source.numel())
        assert int(kept.sum()) <= k
        dropped = source[~kept].abs()
        if dropped.numel() and int(kept.sum()):
            # every kept value is at least as large as every dropped one (zeros may be kept)
            assert (
                float(dropped.max()) <= float(source[kept].abs().min()) or float(dropped.max()) == 0
            )


@st.composite
def headers_and_payloads(draw):
    """A tensor message with a random header and a payload of a size that header allows."""
    compression = draw(st.sampled_from(list(CompressionType)))
    dtype = draw(st.sampled_from(WIRE_DTYPES))
    shape = tuple(draw(shapes))
    header = TensorHeader(shape, dtype_from_name(dtype), dtype, compression, False)
    low, high = get_codec(compression).payload_bounds(header)
    size = draw(st.integers(low, min(high, low + 2048)))
    payload = bytearray(draw(st.binary(min_size=size, max_size=size)))
    if draw(st.booleans()):
        # a valid-looking prefix (codebook size; block and code size; k and index width), so
        # that decoding goes past the first check
        prefix = draw(st.sampled_from(list(PREFIXES.get(compression, [b""]))))
        payload[: len(prefix)] = prefix[: len(payload)]
    return np.frombuffer(bytes(payload), np.uint8).copy(), shape, dtype, compression


PREFIXES = {
    CompressionType.UNIFORM_8BIT: [(256).to_bytes(8, "little")],
    CompressionType.QUANTILE_8BIT: [(256).to_bytes(8, "little")],
    CompressionType.BLOCKWISE_8BIT: [(16).to_bytes(4, "little") + (256).to_bytes(4, "little")],
    CompressionType.BLOCKWISE_4BIT: [(16).to_bytes(4, "little") + (16).to_bytes(4, "little")],
    CompressionType.TOPK: [
        k.to_bytes(8, "little") + width.to_bytes(4, "little") + bytes(4)
        for k in (0, 1, 2)
        for width in (4, 8)
    ],
}


@given(headers_and_payloads(), st.booleans())
def test_any_payload_decodes_or_raises_wire_format_error(item, as_proto):
    buffer, shape, dtype, compression = item
    message = TensorMessage(buffer, shape, dtype, compression)
    source = message.to_proto() if as_proto else message
    try:
        tensor = deserialize_torch_tensor(source)
    except WireFormatError:
        return
    assert tuple(tensor.shape) == shape
    assert str(tensor.dtype) == f"torch.{dtype}"
    if dtype == "bool":  # a bool tensor holds only 0 and 1 bytes
        assert tensor.numel() == 0 or int(tensor.view(torch.uint8).max()) <= 1


@given(st.binary(max_size=200))
def test_random_tensor_protobufs_fail_cleanly(raw):
    """Bytes that parse as a Tensor protobuf (or not): a tensor or WireFormatError."""
    from google.protobuf.message import DecodeError

    try:
        proto = tensor_pb2.Tensor.FromString(raw)
    except DecodeError:
        return
    try:
        deserialize_torch_tensor(proto)
    except WireFormatError:
        pass


def test_numpy_dtypes_cover_the_wire():
    for name in WIRE_DTYPES:
        assert numpy_dtype(name).itemsize >= 1
    assert math.isfinite(rounding(torch.float32))
