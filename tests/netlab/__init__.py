"""netlab: hosts in Linux network namespaces for real-network tests and benchmarks (root only).

- ``Lab`` (``topology``): a public segment, home networks behind cone or symmetric NAT boxes,
  rate limits (``tc tbf``), random loss (``iptables -m statistic``), latency and jitter (a
  transparent userspace delay proxy, ``delay_proxy``: netem is not in this kernel), or
  packet-level delay, jitter and loss on a host's access link (``add_delayed_host``: a
  router namespace whose forwarding path runs through a TUN device, ``delay_line``).
- ``PeerProcess`` (``process``): a script inside a namespace, driven by JSON lines.
- ``peer.py``: the runner a test starts in a namespace: a swarmtrain DHT (+ averagers) that
  answers commands; ``train_peer.py``: an ``Optimizer`` / ``DiLoCoOptimizer`` peer;
  ``nat_swarm.NatSwarm``: public relays and one such peer behind each home's NAT.
- ``probe.py``: stdlib TCP/UDP probes (the harness's own tests).
- ``unavailable_reason`` / ``iptables_unavailable_reason`` / ``delay_line_unavailable_reason``:
  why a lab cannot run here (a test skips with that reason).
"""

from .process import PeerProcess
from .system import (
    delay_line_unavailable_reason,
    iptables_unavailable_reason,
    unavailable_reason,
)
from .topology import HOME_LAN, LAB_SUBNET, Home, Host, Lab, remove_stale_labs

__all__ = [
    "HOME_LAN",
    "LAB_SUBNET",
    "Home",
    "Host",
    "Lab",
    "PeerProcess",
    "delay_line_unavailable_reason",
    "iptables_unavailable_reason",
    "remove_stale_labs",
    "unavailable_reason",
]
