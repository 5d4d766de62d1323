"""swarmtrain.p2p: a py-libp2p host with a persistent identity, typed protobuf RPC, relays and
hole punching, and gossipsub for loss-tolerant broadcasts."""

from libp2p.peer.id import ID as PeerID

from swarmtrain.p2p.autonat import Reachability as Reachability
from swarmtrain.p2p.errors import (
    AddressInUseError as AddressInUseError,
)
from swarmtrain.p2p.errors import (
    CallNotServedError as CallNotServedError,
)
from swarmtrain.p2p.errors import (
    MessageTooLargeError as MessageTooLargeError,
)
from swarmtrain.p2p.errors import (
    NoSuchMethodError as NoSuchMethodError,
)
from swarmtrain.p2p.errors import (
    P2PError as P2PError,
)
from swarmtrain.p2p.errors import (
    PeerUnreachableError as PeerUnreachableError,
)
from swarmtrain.p2p.errors import (
    RemoteError as RemoteError,
)
from swarmtrain.p2p.errors import (
    ResourceLimitError as ResourceLimitError,
)
from swarmtrain.p2p.errors import (
    RPCCancelledError as RPCCancelledError,
)
from swarmtrain.p2p.errors import (
    RPCError as RPCError,
)
from swarmtrain.p2p.errors import (
    RPCProtocolError as RPCProtocolError,
)
from swarmtrain.p2p.errors import (
    RPCTimeoutError as RPCTimeoutError,
)
from swarmtrain.p2p.errors import (
    SwarmKeyMismatchError as SwarmKeyMismatchError,
)
from swarmtrain.p2p.host import P2P as P2P
from swarmtrain.p2p.host import P2PConfig as P2PConfig
from swarmtrain.p2p.identity import IdentityError as IdentityError
from swarmtrain.p2p.identity import PeerSigner as PeerSigner
from swarmtrain.p2p.identity import load_or_create_identity as load_or_create_identity
from swarmtrain.p2p.identity import verify_peer_signature as verify_peer_signature
from swarmtrain.p2p.limits import ResourceLimits as ResourceLimits
from swarmtrain.p2p.private_network import SwarmKeyError as SwarmKeyError
from swarmtrain.p2p.private_network import generate_swarm_key as generate_swarm_key
from swarmtrain.p2p.private_network import load_swarm_key as load_swarm_key
from swarmtrain.p2p.private_network import save_swarm_key as save_swarm_key
from swarmtrain.p2p.rpc import Attached as Attached
from swarmtrain.p2p.rpc import RPCContext as RPCContext

__all__ = [
    "AddressInUseError",
    "Attached",
    "CallNotServedError",
    "IdentityError",
    "MessageTooLargeError",
    "NoSuchMethodError",
    "P2P",
    "P2PConfig",
    "P2PError",
    "PeerID",
    "PeerSigner",
    "PeerUnreachableError",
    "RPCCancelledError",
    "RPCContext",
    "RPCError",
    "RPCProtocolError",
    "RPCTimeoutError",
    "Reachability",
    "RemoteError",
    "ResourceLimitError",
    "ResourceLimits",
    "SwarmKeyError",
    "SwarmKeyMismatchError",
    "generate_swarm_key",
    "load_or_create_identity",
    "load_swarm_key",
    "save_swarm_key",
    "verify_peer_signature",
]
