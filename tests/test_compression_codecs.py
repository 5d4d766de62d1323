"""Error bounds, dtypes, shapes and selectors of swarmtrain.compression codecs."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import swarmtrain.compression.blockwise as blockwise_module
from swarmtrain.compression import (
    Blockwise4BitQuantization,
    BlockwiseQuantization,
    CompressionInfo,
    CompressionType,
    ErrorFeedback,
    Float16Compression,
    NoCompression,
    PerTensorCompression,
    Quantile8BitQuantization,
    RoleAdaptiveCompression,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    TensorRole,
    TopKSparsification,
    Uniform8BitQuantization,
    bitsandbytes_available,
    deserialize_torch_tensor,
    serialize_torch_tensor,
)
from swarmtrain.compression.errors import CompressionError

ALL_CODECS = [
    NoCompression(),
    Float16Compression(),
    ScaledFloat16Compression(),
    Uniform8BitQuantization(),
    Quantile8BitQuantization(),
    BlockwiseQuantization(backend="torch"),
    Blockwise4BitQuantization(),
    TopKSparsification(0.25),
]
WIRE_DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.complex64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b.double()) ** 2).mean())


@pytest.fixture(scope="module")
def normal() -> torch.Tensor:
    return torch.randn(1_000_003, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    ("codec", "bound"),
    [
        (Float16Compression(), 5e-8),
        (ScaledFloat16Compression(), 5e-8),
        (Uniform8BitQuantization(), 8e-4),
        (Quantile8BitQuantization(), 8e-4),
        (BlockwiseQuantization(backend="torch"), 8e-4),
        (Blockwise4BitQuantization(), 2e-2),
    ],
    ids=lambda value: type(value).__name__ if not isinstance(value, float) else str(value),
)
def test_error_bounds_on_standard_normal(codec, bound, normal):
    restored = codec.extract(codec.compress(normal))
    assert restored.shape == normal.shape and restored.dtype == normal.dtype
    assert mse(normal, restored) < bound


def test_error_bounds_hold_for_several_seeds_and_shapes():
    for seed, shape in [(1, (4096, 257)), (2, (3, 5, 70001)), (3, (999_999,))]:
        tensor = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        for codec in (Uniform8BitQuantization(), Quantile8BitQuantization()):
            assert mse(tensor, codec.extract(codec.compress(tensor))) < 8e-4


@pytest.mark.skipif(not bitsandbytes_available(), reason="bitsandbytes is not importable")
def test_bitsandbytes_backend_matches_wire_format_and_bound(normal):
    import bitsandbytes.functional as functional

    bnb_codec = BlockwiseQuantization(backend="bitsandbytes")
    message = bnb_codec.compress(normal)
    assert message.compression == CompressionType.BLOCKWISE_8BIT
    assert message.nbytes == BlockwiseQuantization(backend="torch").compress(normal).nbytes
    ours = BlockwiseQuantization(backend="torch").extract(message)  # decoded without bnb
    indices, state = functional.quantize_blockwise(normal, blocksize=4096)
    theirs = functional.dequantize_blockwise(indices, state)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert mse(normal, ours) < 8e-4


def test_bitsandbytes_backend_unavailable_is_a_clear_error(monkeypatch):
    # Make the import fail the way a missing package does, whether or not it is installed.
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    blockwise_module._bitsandbytes.cache_clear()
    try:
        assert not bitsandbytes_available()
        with pytest.raises(CompressionError, match="bitsandbytes"):
            BlockwiseQuantization(backend="bitsandbytes")
        # the automatic choice falls back to the torch path
        assert BlockwiseQuantization().compress(torch.ones(8)).compression == (
            CompressionType.BLOCKWISE_8BIT
        )
    finally:
        monkeypatch.undo()
        blockwise_module._bitsandbytes.cache_clear()


def test_auto_backend_uses_torch_path_for_cpu_tensors(normal):
    message = BlockwiseQuantization().compress(normal[:10_000])
    assert message.compression == CompressionType.BLOCKWISE_8BIT
    assert BlockwiseQuantization(backend="torch").compress(normal[:10_000]).buffer.tobytes() == (
        message.buffer.tobytes()
    )


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=str)
def test_every_dtype_round_trips(codec, dtype):
    generator = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        tensor = torch.rand(3, 70, generator=generator) > 0.5
    elif dtype.is_floating_point or dtype.is_complex:
        tensor = torch.randn(3, 70, generator=generator).to(dtype)
    else:
        tensor = torch.randint(-100 if dtype != torch.uint8 else 0, 100, (3, 70)).to(dtype)
    restored = codec.extract(codec.compress(tensor))
    assert restored.dtype == dtype and restored.shape == tensor.shape
    if not dtype.is_floating_point:  # integers, bool and complex are never quantized
        assert torch.equal(restored, tensor)
    elif isinstance(codec, TopKSparsification):
        kept = restored != 0
        assert torch.equal(restored[kept], tensor[kept])
    else:
        tolerance = 0.5 if isinstance(codec, Blockwise4BitQuantization) else 0.1
        assert torch.allclose(restored.double(), tensor.double(), atol=tolerance)


def test_bfloat16_is_not_upcast_unless_asked():
    tensor = torch.randn(1000).to(torch.bfloat16)
    for codec in (NoCompression(), Float16Compression()):
        message = codec.compress(tensor)
        assert message.dtype == "bfloat16" and message.nbytes == 2000
        assert torch.equal(codec.extract(message), tensor)
    upcast = deserialize_torch_tensor(NoCompression().compress(tensor), as_dtype=torch.float32)
    assert upcast.dtype == torch.float32 and torch.equal(upcast, tensor.float())


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (5,), (4097,), (2, 3, 65)], ids=str)
def test_shapes_and_requires_grad(codec, shape):
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(2)).requires_grad_()
    restored = codec.extract(codec.compress(tensor))
    assert restored.shape == tensor.shape and restored.requires_grad
    assert codec.extract(codec.compress(tensor.detach())).requires_grad is False
    if tensor.numel() and not isinstance(codec, TopKSparsification):
        # the outer quantile buckets of a few thousand normal values span more than 0.5
        assert torch.allclose(restored, tensor, atol=1.0)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: type(c).__name__)
def test_extract_into_out(codec):
    tensor = torch.randn(10, 1000, generator=torch.Generator().manual_seed(3))
    message = codec.compress(tensor)
    out = torch.full_like(tensor, 123.0)
    result = codec.extract(message, out=out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(result, codec.extract(message))
    with pytest.raises(ValueError, match="out must"):
        codec.extract(message, out=torch.empty(5))


def test_float16_saturates_finite_overflow():
    tensor = torch.tensor([1e6, -1e6, 65504.0, 1.0], dtype=torch.float64)
    restored = Float16Compression().extract(Float16Compression().compress(tensor))
    assert restored.tolist() == [65504.0, -65504.0, 65504.0, 1.0]


def test_compression_ratios_and_sizes(normal):
    info = CompressionInfo.from_tensor(normal)
    assert NoCompression().estimate_compression_ratio(info) == 1.0
    assert Float16Compression().estimate_compression_ratio(info) == 0.5
    assert Uniform8BitQuantization().estimate_compression_ratio(info) == 0.25
    assert Blockwise4BitQuantization().estimate_compression_ratio(info) < 0.15
    assert Blockwise4BitQuantization().compress(normal).nbytes < 0.15 * normal.numel() * 4


def test_topk_keeps_largest_magnitudes():
    tensor = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 4.0, 0.05])
    restored = TopKSparsification(ratio=0.375).extract(TopKSparsification(0.375).compress(tensor))
    assert restored.tolist() == [0.0, -5.0, 0.0, 3.0, 0.0, 0.0, 4.0, 0.0]


def test_error_feedback_carries_residual():
    tensor = torch.tensor([1.0, 0.6, 0.5, 0.1])
    feedback = ErrorFeedback(TopKSparsification(ratio=0.25))
    info = CompressionInfo.from_tensor(tensor, key="w")
    first = feedback.extract(feedback.compress(tensor, info))
    assert first.tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(feedback.residual("w"), torch.tensor([0.0, 0.6, 0.5, 0.1]))
    second = feedback.extract(feedback.compress(tensor, info))
    assert second.tolist() == pytest.approx([0.0, 1.2, 0.0, 0.0])  # 0.6 + 0.6 now beats 1.0
    total = first + second
    for _ in range(20):
        total += feedback.extract(feedback.compress(tensor, info))
    torch.testing.assert_close(total + feedback.residual("w"), 22 * tensor)
    feedback.reset()
    assert feedback.residual("w") is None


def test_error_feedback_keeps_one_residual_per_part():
    """All-reduce compresses several parts of one tensor (same key): each part's error must
    come back to that part, not to whichever part is compressed next."""
    whole = CompressionInfo.from_tensor(torch.empty(8), key="w")
    feedback = ErrorFeedback(TopKSparsification(ratio=0.5))
    low, high = torch.tensor([1.0, 0.2, 0.3, 0.0]), torch.tensor([5.0, 4.0, 0.1, 0.0])
    feedback.compress(low, dataclasses.replace(whole, part_index=0, part_size=4, part_offset=0))
    feedback.compress(high, dataclasses.replace(whole, part_index=0, part_size=4, part_offset=4))
    assert feedback.num_residuals == 2
    torch.testing.assert_close(feedback.residual("w", 0), torch.tensor([0.0, 0.2, 0.0, 0.0]))
    torch.testing.assert_close(feedback.residual("w", 4), torch.tensor([0.0, 0.0, 0.1, 0.0]))
    # the next round of the low part sends its own carried 0.2 (0.4 now beats 0.3)
    again = feedback.compress(low, dataclasses.replace(whole, part_offset=0, part_size=4))
    assert feedback.extract(again).tolist() == pytest.approx([1.0, 0.4, 0.0, 0.0])


def test_size_adaptive_uses_whole_tensor_size():
    codec = SizeAdaptiveCompression(1000, less=NoCompression(), greater_equal=Float16Compression())
    assert codec.compress(torch.randn(999)).compression == CompressionType.NONE
    assert codec.compress(torch.randn(1000)).compression == CompressionType.FLOAT16
    big = CompressionInfo.from_tensor(torch.empty(10_000))
    part = codec.compress(torch.randn(10), big.get_part(3, 10))
    assert part.compression == CompressionType.FLOAT16
    assert codec.estimate_compression_ratio(big) == 0.5


def test_role_adaptive_selection_and_default():
    codec = RoleAdaptiveCompression(
        gradient=Uniform8BitQuantization(), optimizer=Float16Compression()
    )
    tensor = torch.randn(100)
    expected = {
        TensorRole.GRADIENT: CompressionType.UNIFORM_8BIT,
        TensorRole.OPTIMIZER: CompressionType.FLOAT16,
        TensorRole.PARAMETER: CompressionType.NONE,
        TensorRole.ACTIVATION: CompressionType.NONE,
        TensorRole.UNSPECIFIED: CompressionType.NONE,
    }
    for role, compression in expected.items():
        message = codec.compress(tensor, CompressionInfo.from_tensor(tensor, role=role))
        assert message.compression == compression
        assert codec.extract(message).shape == tensor.shape
    assert RoleAdaptiveCompression(default=Float16Compression()).compress(tensor).compression == (
        CompressionType.FLOAT16
    )


def test_per_tensor_by_sequence_and_mapping():
    tensor = torch.randn(100)
    by_index = PerTensorCompression([NoCompression(), Float16Compression()])
    by_name = PerTensorCompression({"a": Uniform8BitQuantization()})
    message = by_index.compress(tensor, CompressionInfo.from_tensor(tensor, key=1))
    assert message.compression == CompressionType.FLOAT16
    message = by_name.compress(tensor, CompressionInfo.from_tensor(tensor, key="a"))
    assert message.compression == CompressionType.UNIFORM_8BIT
    with pytest.raises(CompressionError, match="no codec for key 'b'"):
        by_name.compress(tensor, CompressionInfo.from_tensor(tensor, key="b"))
    with pytest.raises(CompressionError):
        by_name.compress(tensor)


def test_serialize_by_compression_type_and_proto_round_trip():
    tensor = torch.randn(7, 9)
    for compression in CompressionType:
        message = serialize_torch_tensor(tensor, compression)
        proto = message.to_proto()
        restored = deserialize_torch_tensor(proto)
        assert torch.equal(restored, deserialize_torch_tensor(message))
        assert restored.shape == tensor.shape


def test_invalid_inputs_raise_compression_error():
    with pytest.raises(CompressionError, match=r"torch\.Tensor"):
        NoCompression().compress([1.0, 2.0])  # type: ignore[arg-type]
    with pytest.raises(CompressionError, match="not supported"):
        NoCompression().compress(torch.zeros(3, dtype=torch.uint16))
    with pytest.raises(ValueError, match="block_size"):
        BlockwiseQuantization(block_size=100)
    with pytest.raises(ValueError, match="ratio"):
        TopKSparsification(ratio=0.0)


def test_codecs_do_not_modify_their_input(normal):
    reference = normal.clone()
    for codec in ALL_CODECS:
        codec.compress(normal, allow_inplace=False)
    assert torch.equal(normal, reference)
