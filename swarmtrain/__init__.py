"""swarmtrain: train one model together on GPUs scattered across the internet.

This module only re-exports the public API; implementations live in the subpackages.
"""

from swarmtrain.averaging import DecentralizedAverager as DecentralizedAverager
from swarmtrain.compression import BlockwiseQuantization as BlockwiseQuantization
from swarmtrain.compression import CompressionInfo as CompressionInfo
from swarmtrain.compression import Float16Compression as Float16Compression
from swarmtrain.compression import NoCompression as NoCompression
from swarmtrain.compression import PerTensorCompression as PerTensorCompression
from swarmtrain.compression import Quantile8BitQuantization as Quantile8BitQuantization
from swarmtrain.compression import RoleAdaptiveCompression as RoleAdaptiveCompression
from swarmtrain.compression import ScaledFloat16Compression as ScaledFloat16Compression
from swarmtrain.compression import SizeAdaptiveCompression as SizeAdaptiveCompression
from swarmtrain.compression import TensorRole as TensorRole
from swarmtrain.compression import Uniform8BitQuantization as Uniform8BitQuantization
from swarmtrain.dht import DHT as DHT
from swarmtrain.dht import get_dht_time as get_dht_time
from swarmtrain.optim import DiLoCoOptimizer as DiLoCoOptimizer
from swarmtrain.optim import GradientAverager as GradientAverager
from swarmtrain.optim import Optimizer as Optimizer
from swarmtrain.optim import ProgressTracker as ProgressTracker
from swarmtrain.optim import TrainingStateAverager as TrainingStateAverager
from swarmtrain.p2p import P2P as P2P

__version__ = "0.1.0.dev0"
