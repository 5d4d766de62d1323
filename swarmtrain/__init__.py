"""swarmtrain: train one model together on GPUs scattered across the internet.

This module only re-exports the public API; implementations live in the subpackages.
"""

from swarmtrain.p2p import P2P as P2P

__version__ = "0.1.0.dev0"
