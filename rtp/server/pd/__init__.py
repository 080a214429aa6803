"""Prefill/decode disaggregation: a node that prefills here and decodes on a peer, or decodes
for a peer. The whole exchange, step by step, is in node.py's docstring.

    node.py       PDNode: the RPC routes (stats, reserve, push_kv, decode, abort), the leases
                  and the abort bookkeeping; on a prefill node, the start of a relay
    relay.py      Relay: a prefill node's request through its decode node (the KV push, the
                  decode stream relayed back as a local Stream)
    kv_intake.py  Intake, KVPort: a decode node's side of the KV hand-off (HTTP push_kv and
                  the KV port write each layer into the reserved blocks)
    context.py    PDContext: what the node shares with the relays and intakes (engine, the
                  reservations and relays, the HTTP client, spawn / abort_peer /
                  drop_reservation); Reservation; PeerError

The wire format of the RPC and the KV frames is rtp/wire/rpc.py (the FlexLB master reads it
too, for /rpc/stats). Imports inside the package go one way, with no circle: node imports
relay, kv_intake and context; relay and kv_intake import context.
"""

from rtp.server.pd.context import PDContext, PeerError, Reservation
from rtp.server.pd.kv_intake import KVPort
from rtp.server.pd.node import ROLES, PDNode, new_request_id
from rtp.server.pd.relay import Relay

__all__ = ["KVPort", "PDContext", "PDNode", "PeerError", "ROLES", "Relay", "Reservation", "new_request_id"]
