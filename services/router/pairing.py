"""Which engines may share KV: the P/D legs' layout pairing and the "on a peer" tier.

Engines with a KV transfer server put its address and their KV layout digest in their heartbeat
(``EngineHeartbeat.kv_transfer_address``, ``kv_layout``). One engine's blocks are another's
only when the digests are equal (model, weights, block size, per-block KV shape), so:

- P/D, prefill leg: prefill engines whose layout some live decode engine shares, when any
  has one (during a rollout, a new prefill engine waits for a new decode engine).
- P/D, decode leg: decode engines of the prefill engine's layout (``RouteRequest.kv_layout``).
  When none has it (the pairing went during a rollout) any decode engine serves: it refuses a
  pull of another layout and computes the prompt itself, so the answer is right, only slower.
- The peer tier (aggregated requests, prefill legs, decode legs without a prefill): for each
  candidate B, the live engine A of B's layout, with a transfer address, holding the most of
  the prompt's leading blocks in its pool or host tier (A serves either); when A holds more
  than B reaches itself, B's ``peer_blocks`` says how many (the policy weighs them as a tier)
  and the answer's ``kv_peer`` names A, so B pulls them.

A decode leg that pulls a prefill engine's blocks never gets a peer; one without a prefill
leg computes its prompt and is routed as an aggregated request (prefix, load, peer tier).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from services.protocol.messages import KVPeer
from services.router.policies import Candidate

logger = logging.getLogger(__name__)


def paired_prefill(candidates: list[Candidate], peers: Sequence[Candidate]) -> list[Candidate]:
    """Prefill candidates whose layout a decode engine among ``peers`` shares; all of them
    when none does (no decode engine reports a layout: nothing to pair)."""
    layouts = {p.kv_layout for p in peers if p.kv_role in ("decode", "both") and p.kv_layout}
    paired = [c for c in candidates if c.kv_layout in layouts]
    return paired or candidates


def paired_decode(candidates: list[Candidate], layout: str | None) -> tuple[list[Candidate],
                                                                           bool]:
    """Decode candidates of the prefill engine's ``layout``, and whether the pairing held
    (False: none has it, all are returned and the decode engine computes the prompt)."""
    if layout is None:
        return candidates, True
    paired = [c for c in candidates if c.kv_layout == layout]
    if paired:
        return paired, True
    logger.info("no decode engine has the prefill engine's KV layout %s: the decode engine "
                "computes the prompt", layout)
    return candidates, False


class PeerTier:
    """For each layout, the engines that could lend the prompt's prefix, best first."""

    def __init__(self, peers: Sequence[Candidate]) -> None:
        # Per layout the two best lenders: the best one other than any given engine is one
        # of them. Best: most blocks, then least load, then id (every replica agrees).
        self._best: dict[str, list[Candidate]] = {}
        for p in peers:
            if p.kv_layout and p.kv_transfer_address and p.local_blocks:
                top = self._best.setdefault(p.kv_layout, [])
                top.append(p)
                top.sort(key=lambda c: (-c.local_blocks, c.load, c.engine_id))
                del top[2:]

    def peer_of(self, c: Candidate) -> KVPeer | None:
        """The engine ``c`` could pull more of the prefix from than it reaches itself."""
        if not c.kv_layout:
            return None
        for p in self._best.get(c.kv_layout, ()):
            if p.engine_id != c.engine_id:
                if p.local_blocks <= c.local_blocks:
                    return None
                assert p.kv_transfer_address is not None
                return KVPeer(p.engine_id, p.kv_transfer_address, p.local_blocks)
        return None

    def annotate(self, candidates: list[Candidate]) -> list[Candidate]:
        """``candidates`` with ``peer_blocks`` set where a peer lends more than they hold."""
        if not self._best:
            return candidates
        out = []
        for c in candidates:
            peer = self.peer_of(c)
            out.append(c if peer is None else replace(c, peer_blocks=peer.blocks))
        return out
