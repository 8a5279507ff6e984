"""barrier: one round with no data; every rank posts and waits for every post.

Cost: one post and one wait per rank. The latency path's barrier runs this very round."""

from __future__ import annotations

from ...transport.base import Channel
from .common import same_channel


def one_round(ctx, seq: int, sig: int, channel) -> None:
    k = ctx.open_round(seq, sig, channel)
    ctx.exchange(k, seq, sig, 0, channel)
    ctx.consume(k)


def barrier_slots(ctx, ch: Channel) -> None:
    one_round(ctx, ch.key.seq, ch.signature, same_channel(ch))
