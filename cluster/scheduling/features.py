"""EAGLE-3 features on their way from a request's target worker to its draft worker, through the scheduler.

Each verify reply carries the target's features of the positions it committed (float16, workers/speculation/codec.py);
the next propose call hands them to the draft worker's head. Per request the scheduler keeps only those not
delivered yet, so what it holds never exceeds the committed positions its draft worker has not been given, and at
most MAX_FEATURE_BYTES of them (the oldest are dropped first: the head then starts its cache at a later position).
It works on the encoded bytes, never on tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.protos.wire import MAX_FEATURE_BYTES
from specserve.workers.speculation.wire_format import FeatureBlock, decode_features


@dataclass
class FeatureTraffic:
    """Feature bytes that crossed the wire: received with verify replies, sent with propose calls."""

    received_bytes: int = 0
    replies: int = 0  # verify replies that carried features
    sent_bytes: int = 0
    proposes: int = 0  # propose calls that carried features

    @property
    def bytes_per_reply(self) -> float:
        return self.received_bytes / self.replies if self.replies else 0.0

    @property
    def bytes_per_propose(self) -> float:
        return self.sent_bytes / self.proposes if self.proposes else 0.0

    def to_dict(self) -> dict:
        return {
            "feature_bytes_received": self.received_bytes,
            "feature_bytes_sent": self.sent_bytes,
            "feature_verify_replies": self.replies,
            "feature_proposes": self.proposes,
            "feature_bytes_per_verify_reply": self.bytes_per_reply,
            "feature_bytes_per_propose": self.bytes_per_propose,
        }


@dataclass
class FeatureRelay:
    """One request's features not yet delivered to its draft worker."""

    totals: FeatureTraffic  # the scheduler's, over every request
    pending: FeatureBlock | None = None
    delivered_end: int = 0  # the draft worker's head was given the features of every position before this one
    traffic: FeatureTraffic = field(default_factory=FeatureTraffic)  # this request's

    def received(self, data: bytes) -> None:
        """A verify reply's encoded features: keep those of positions the draft worker has not been given (a target
        that recomputed older positions, after it lost the request, sends them again)."""
        block = decode_features(data)
        if block is None:
            return
        for traffic in (self.traffic, self.totals):
            traffic.received_bytes += len(data)
            traffic.replies += 1
        block = block.since(self.delivered_end)
        if block is None:
            return
        if self.pending is None or block.start > self.pending.end:
            self.pending = block  # a gap after the pending ones (dropped, see `drop`): the head starts later
        else:
            self.pending = self.pending.then(block)
        self.pending = self.pending.newest(MAX_FEATURE_BYTES)

    def to_send(self) -> bytes:
        """The encoded features the next propose call carries (b"" when there are none)."""
        return self.pending.encode() if self.pending is not None else b""

    def delivered(self, sent: bytes) -> None:
        """The draft worker took the features the propose call carried (`sent`)."""
        if self.pending is None or not sent:
            return
        self.delivered_end = self.pending.end
        self.pending = None
        for traffic in (self.traffic, self.totals):
            traffic.sent_bytes += len(sent)
            traffic.proposes += 1

    def drop(self) -> None:
        """The request has no draft worker any more: nothing to keep (a head that comes back starts later)."""
        self.pending = None
