"""The DHT keys whose records are owned per peer: one place, without torch.

Under each key named here, a record's subkey is the writer's peer id and its value is signed
with that peer's libp2p identity key (:class:`~swarmtrain.dht.PeerRecordValidator`). The
components that write such records (matchmaking, state sharing, DiLoCo presence, training
progress, the metrics publisher, the run directory) import their pattern from this module and
register it on their node; ``swarmtrain node`` registers all of them
(:func:`owned_keys_validator`) without importing those components, so a bootstrap-only node
refuses unsigned and forged records too.

This module holds only key-name patterns: adding a pattern here makes every node that calls
:func:`owned_keys_validator` enforce it.
"""

from __future__ import annotations

import re

from .peer_records import PeerRecordValidator

__all__ = [
    "GROUP_KEY_PATTERN",
    "METRICS_KEY_PATTERN",
    "OWNED_KEY_PATTERNS",
    "PRESENCE_KEY_PATTERN",
    "PROGRESS_KEY_PATTERN",
    "RUNS_KEY",
    "RUNS_KEY_PATTERN",
    "STATE_SHARING_KEY_PATTERN",
    "owned_keys_validator",
]

#: matchmaking declarations, ``{prefix}.0b{group bits}`` (``averaging.matchmaking_types``)
GROUP_KEY_PATTERN = re.compile(r"[^.]+\.0b[01]*")
#: state-sharing declarations, ``{prefix}.all_averagers`` (``averaging.state_sharing``)
STATE_SHARING_KEY_PATTERN = re.compile(r"(?s).+\.all_averagers")
#: DiLoCo presence records, ``{run_id}_diloco.peers`` (``optim.diloco_peers``)
PRESENCE_KEY_PATTERN = re.compile(r"(?s).*_diloco\.peers")
#: training progress, ``{run_id}_progress`` (``optim.progress_records``): one vote per peer id
PROGRESS_KEY_PATTERN = re.compile(r"(?s).*_progress")
#: training metrics, ``{run_id}_metrics`` (``monitor.metrics``)
METRICS_KEY_PATTERN = re.compile(r"(?s).+_metrics")
#: the run directory's one key (``monitor.runs``): one announcement per announcing peer
RUNS_KEY = "swarmtrain_runs"
RUNS_KEY_PATTERN = re.compile(re.escape(RUNS_KEY))

#: every owned key pattern, of every run
OWNED_KEY_PATTERNS: tuple[re.Pattern[str], ...] = (
    GROUP_KEY_PATTERN,
    STATE_SHARING_KEY_PATTERN,
    PRESENCE_KEY_PATTERN,
    PROGRESS_KEY_PATTERN,
    METRICS_KEY_PATTERN,
    RUNS_KEY_PATTERN,
)


def owned_keys_validator() -> PeerRecordValidator:
    """A validator registering every owned key pattern; add it to a node with
    ``dht.add_validators([owned_keys_validator()])`` (it merges into the node's own
    :class:`~swarmtrain.dht.PeerRecordValidator`, which signs and checks)."""
    return PeerRecordValidator(OWNED_KEY_PATTERNS)
