"""Tensor codecs (hivemind's names), the tensor wire format and chunked streaming."""

from swarmtrain.compression.adaptive import AdaptiveCompressionBase as AdaptiveCompressionBase
from swarmtrain.compression.adaptive import PerTensorCompression as PerTensorCompression
from swarmtrain.compression.adaptive import RoleAdaptiveCompression as RoleAdaptiveCompression
from swarmtrain.compression.adaptive import SizeAdaptiveCompression as SizeAdaptiveCompression
from swarmtrain.compression.base import CompressionBase as CompressionBase
from swarmtrain.compression.base import CompressionInfo as CompressionInfo
from swarmtrain.compression.base import NoCompression as NoCompression
from swarmtrain.compression.base import TensorDescriptor as TensorDescriptor
from swarmtrain.compression.base import TensorRole as TensorRole
from swarmtrain.compression.base import WireCodec as WireCodec
from swarmtrain.compression.blockwise import Blockwise4BitQuantization as Blockwise4BitQuantization
from swarmtrain.compression.blockwise import BlockwiseQuantization as BlockwiseQuantization
from swarmtrain.compression.blockwise import bitsandbytes_available as bitsandbytes_available
from swarmtrain.compression.chunking import DEFAULT_CHUNK_SIZE as DEFAULT_CHUNK_SIZE
from swarmtrain.compression.chunking import TensorAssembler as TensorAssembler
from swarmtrain.compression.chunking import combine_from_streaming as combine_from_streaming
from swarmtrain.compression.chunking import split_for_streaming as split_for_streaming
from swarmtrain.compression.errors import CompressionError as CompressionError
from swarmtrain.compression.errors import WireFormatError as WireFormatError
from swarmtrain.compression.errors import WireLimitError as WireLimitError
from swarmtrain.compression.floating import Float16Compression as Float16Compression
from swarmtrain.compression.floating import ScaledFloat16Compression as ScaledFloat16Compression
from swarmtrain.compression.offload import compress_async as compress_async
from swarmtrain.compression.offload import extract_async as extract_async
from swarmtrain.compression.offload import receive_tensor as receive_tensor
from swarmtrain.compression.quantization import Quantile8BitQuantization as Quantile8BitQuantization
from swarmtrain.compression.quantization import Quantization as Quantization
from swarmtrain.compression.quantization import Uniform8BitQuantization as Uniform8BitQuantization
from swarmtrain.compression.serialization import (
    deserialize_torch_tensor as deserialize_torch_tensor,
)
from swarmtrain.compression.serialization import get_codec as get_codec
from swarmtrain.compression.serialization import serialize_torch_tensor as serialize_torch_tensor
from swarmtrain.compression.topk import ErrorFeedback as ErrorFeedback
from swarmtrain.compression.topk import TopKSparsification as TopKSparsification
from swarmtrain.compression.wire import DEFAULT_LIMITS as DEFAULT_LIMITS
from swarmtrain.compression.wire import CompressionType as CompressionType
from swarmtrain.compression.wire import TensorHeader as TensorHeader
from swarmtrain.compression.wire import WireLimits as WireLimits
from swarmtrain.compression.wire import check_header as check_header
from swarmtrain.compression.wire import dtype_from_name as dtype_from_name
from swarmtrain.compression.wire import dtype_name as dtype_name

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_LIMITS",
    "AdaptiveCompressionBase",
    "Blockwise4BitQuantization",
    "BlockwiseQuantization",
    "CompressionBase",
    "CompressionError",
    "CompressionInfo",
    "CompressionType",
    "ErrorFeedback",
    "Float16Compression",
    "NoCompression",
    "PerTensorCompression",
    "Quantile8BitQuantization",
    "Quantization",
    "RoleAdaptiveCompression",
    "ScaledFloat16Compression",
    "SizeAdaptiveCompression",
    "TensorAssembler",
    "TensorDescriptor",
    "TensorHeader",
    "TensorRole",
    "TopKSparsification",
    "Uniform8BitQuantization",
    "WireCodec",
    "WireFormatError",
    "WireLimitError",
    "WireLimits",
    "bitsandbytes_available",
    "check_header",
    "combine_from_streaming",
    "compress_async",
    "deserialize_torch_tensor",
    "dtype_from_name",
    "dtype_name",
    "extract_async",
    "get_codec",
    "receive_tensor",
    "serialize_torch_tensor",
    "split_for_streaming",
]
