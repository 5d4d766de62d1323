"""Kademlia DHT with expiring records, dictionary subkeys and record validators.

The modules below are pure (no I/O); the networked node builds on them.
"""

from .asyncio_node import AsyncioDHTNode as AsyncioDHTNode
from .blacklist import Blacklist as Blacklist
from .blacklist import BlacklistStatistics as BlacklistStatistics
from .dht import DHT as DHT
from .dht import AsyncDHT as AsyncDHT
from .dht import AsyncioDHT as AsyncioDHT
from .identifiers import DHTID as DHTID
from .identifiers import MAX_PEER_ID_BYTES as MAX_PEER_ID_BYTES
from .node import DHTNode as DHTNode
from .node import DHTNodeConfig as DHTNodeConfig
from .node import DHTNodeStatistics as DHTNodeStatistics
from .peer_records import PeerRecordValidator as PeerRecordValidator
from .protocol import DHTProtocol as DHTProtocol
from .protocol import DHTProtocolLimits as DHTProtocolLimits
from .protocol import MalformedRequestError as MalformedRequestError
from .protocol import NodeIdMismatchError as NodeIdMismatchError
from .routing import KBucket as KBucket
from .routing import PingRequest as PingRequest
from .routing import RoutingTable as RoutingTable
from .routing import RoutingTableStatistics as RoutingTableStatistics
from .serialization import MAX_NESTING_DEPTH as MAX_NESTING_DEPTH
from .serialization import MAX_VALUE_ELEMENTS as MAX_VALUE_ELEMENTS
from .serialization import MAX_VALUE_SIZE as MAX_VALUE_SIZE
from .serialization import DHTLimitError as DHTLimitError
from .serialization import DHTValueError as DHTValueError
from .serialization import NestingTooDeepError as NestingTooDeepError
from .serialization import TooManyElementsError as TooManyElementsError
from .serialization import UnsupportedValueTypeError as UnsupportedValueTypeError
from .serialization import ValueTooLargeError as ValueTooLargeError
from .serialization import check_serialized as check_serialized
from .serialization import check_serialized_subkey as check_serialized_subkey
from .serialization import deserialize as deserialize
from .serialization import serialize as serialize
from .storage import CacheRefreshQueue as CacheRefreshQueue
from .storage import DHTExpiration as DHTExpiration
from .storage import DHTLocalStorage as DHTLocalStorage
from .storage import DictionaryDHTValue as DictionaryDHTValue
from .storage import TimedStorage as TimedStorage
from .storage import ValueWithExpiration as ValueWithExpiration
from .storage import get_dht_time as get_dht_time
from .traverse import FoundCallback as FoundCallback
from .traverse import GetNeighbors as GetNeighbors
from .traverse import simple_traverse_dht as simple_traverse_dht
from .traverse import traverse_dht as traverse_dht
from .validation import NO_SUBKEY as NO_SUBKEY
from .validation import BytesWithPublicKey as BytesWithPublicKey
from .validation import CompositeValidator as CompositeValidator
from .validation import DHTRecord as DHTRecord
from .validation import Ed25519SignatureValidator as Ed25519SignatureValidator
from .validation import RecordValidatorBase as RecordValidatorBase
from .validation import SchemaValidator as SchemaValidator
from .validation import generate_private_key as generate_private_key
