"""Every public name of swarmtrain.compression is importable from the package."""

from __future__ import annotations

import importlib

import swarmtrain.compression as compression
from swarmtrain.compression import CompressionType, get_codec
from swarmtrain.proto import tensor_pb2


def test_all_names_are_exported():
    for name in compression.__all__:
        assert getattr(compression, name) is not None, name


def test_hivemind_codec_names_exist():
    for name in (
        "NoCompression",
        "Float16Compression",
        "ScaledFloat16Compression",
        "Uniform8BitQuantization",
        "Quantile8BitQuantization",
        "BlockwiseQuantization",
        "SizeAdaptiveCompression",
        "RoleAdaptiveCompression",
        "PerTensorCompression",
        "TensorRole",
        "CompressionInfo",
        "serialize_torch_tensor",
        "deserialize_torch_tensor",
    ):
        assert hasattr(compression, name), name


def test_enum_matches_proto_and_registry():
    for compression_type in CompressionType:
        proto_name = tensor_pb2.CompressionType.Name(int(compression_type))
        assert proto_name == f"COMPRESSION_{compression_type.name}"
        assert get_codec(compression_type).compression_type == compression_type
    assert len(tensor_pb2.CompressionType.keys()) == len(CompressionType)


def test_codec_modules_do_not_import_async_or_network_libraries():
    for module in (
        "base",
        "floating",
        "quantization",
        "blockwise",
        "topk",
        "adaptive",
        "wire",
        "chunking",
    ):
        source = importlib.import_module(f"swarmtrain.compression.{module}").__file__
        with open(source, encoding="utf-8") as file:
            text = file.read()
        assert "import anyio" not in text and "libp2p" not in text and "import trio" not in text
