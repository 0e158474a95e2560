"""Verify-width padding: verify over a wider window when that is measured to be cheaper.

A target forward's cost is not monotone in its width (tokens per row). Matrix kernels pick their
blocking by shape: on a 2-core CPU at batch 1, verifying 3 tokens took 81 ms and 4 or 5 tokens 64 ms
(the 576 x 49k output head alone: 21 ms at 3 rows, 10 ms at 4). GPU stacks see the same thing at
other shapes; vLLM pads batches to the sizes it captured CUDA graphs for.

So the engine times each round's verification (target forward, verdict, bookkeeping, up to the
round's host sync) per (batch-size bucket, width), as if the bucket were full, and when a round needs
width w0 = k + 1 >= 2 runs it at the width w in [w0, w0 + max_pad] with the lowest measured time, if
that is at least `margin` cheaper than w0 itself. Rounds without drafts (w0 = 1) are plain decoding
steps and are never padded. Padding is free of semantics: the extra positions carry junk tokens, their logits are
dropped, and the target-cache slots they write lie past the row's length (masked now, overwritten
before they are read). Every width in reach is timed `samples` times before it is trusted (the
estimate is the minimum: timing noise only adds), smallest first; that is the whole exploration. A
round that explores a width is no sample of its draft length's cost (at batch 8, ten of one run were
1.3-1.7x a steady round of their length), so the engine does not show its time to the length policy.
"""

from __future__ import annotations

from .costmodel import bucket


class VerifyWidths:
    max_pad = 4
    margin = 0.95
    samples = 2

    def __init__(self, max_width: int):
        self.max_width = max_width  # max_draft_tokens + 1: the cache has room for this many
        self.times: dict[tuple[int, int], list[float]] = {}

    def choose(self, n: int, w0: int) -> int:
        w = self.untimed(n, w0)
        return self.best(n, w0) if w is None else w

    def untimed(self, n: int, w0: int) -> int | None:
        """The smallest width in reach of w0 not yet timed `samples` times at n's bucket, if any."""
        top = min(self.max_width, w0 + self.max_pad)
        if w0 == 1 or w0 >= top:
            return None
        b = bucket(n)
        return next((w for w in range(w0, top + 1) if len(self.times.get((b, w), ())) < self.samples), None)

    def best(self, n: int, w0: int) -> int:
        """The width a round needing w0 runs at, among the widths timed `samples` times (no exploration)."""
        b = bucket(n)
        timed = [w for w in range(w0, min(self.max_width, w0 + self.max_pad) + 1)
                 if len(self.times.get((b, w), ())) >= self.samples]
        if w0 == 1 or w0 not in timed:
            return w0
        best = min(timed, key=lambda w: min(self.times[(b, w)]))
        return best if min(self.times[(b, best)]) < self.margin * min(self.times[(b, w0)]) else w0

    def observe(self, n: int, w: int, seconds: float) -> None:
        b = bucket(n)
        kept = self.times.setdefault((b, w), [])
        kept.append(seconds * b / n)
        del kept[:-8]  # the recent ones: a machine's load drifts
