"""What loading a block from a tier and computing a prompt token cost here, measured online: what the
component decides load-or-recompute by, and what a router weighs a tier hit by."""

from __future__ import annotations


class Costs:
    """What loading and recomputing measure here, as moving averages: seconds per byte from each tier
    (a disk load also pays the host copy), seconds per prompt token computed. The priors only
    decide until the first measurements: a host copy at 4 GB/s, a disk at 1 GB/s, 10,000 prompt
    tokens a second (more than a CPU prefills: recompute is not underrated)."""

    def __init__(self):
        self.per_byte = {"host": 1 / 4e9, "disk": 1 / 1e9}
        self.per_token = 1e-4
        self.samples = {"host": 0, "disk": 0, "recompute": 0}

    def _mix(self, old: float, new: float, what: str) -> float:
        self.samples[what] += 1
        return new if self.samples[what] == 1 else 0.7 * old + 0.3 * new

    def loaded(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 20:  # smaller copies measure the call, not the bandwidth
            self.per_byte[tier] = self._mix(self.per_byte[tier], seconds / nbytes, tier)

    def computed(self, tokens: int, seconds: float) -> None:
        self.per_token = self._mix(self.per_token, seconds / tokens, "recompute")

    def load(self, host_bytes: int, disk_bytes: int) -> float:
        return (host_bytes + disk_bytes) * self.per_byte["host"] + disk_bytes * self.per_byte["disk"]

    def recompute(self, tokens: int) -> float:
        return tokens * self.per_token

    def saving(self, tier: str, token_bytes: float) -> float:
        """The share of a prompt token's compute time that loading its KV from `tier` saves (0 where
        loading measures slower): what a router weighs a hit in that tier by."""
        load = self.load(token_bytes, 0) if tier == "host" else self.load(0, token_bytes)
        return max(0.0, 1.0 - load / self.per_token)
