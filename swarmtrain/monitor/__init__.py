"""Watching a run: per-peer metrics in the DHT (and, on top, the monitor).

The public names are re-exported here; the modules are :mod:`.metrics` (records, schema, rate
bound; no I/O) and :mod:`.publisher` (publishing and reading over a DHT).
"""

from .metrics import LocalMetrics as LocalMetrics
from .metrics import MetricsSchema as MetricsSchema
from .metrics import RecentFailure as RecentFailure
from .metrics import metrics_key as metrics_key
from .publisher import AsyncMetricsPublisher as AsyncMetricsPublisher
from .publisher import MetricsPublisher as MetricsPublisher
from .publisher import MetricsPublisherStatistics as MetricsPublisherStatistics
from .publisher import read_metrics as read_metrics

__all__ = [
    "AsyncMetricsPublisher",
    "LocalMetrics",
    "MetricsPublisher",
    "MetricsPublisherStatistics",
    "MetricsSchema",
    "RecentFailure",
    "metrics_key",
    "read_metrics",
]
