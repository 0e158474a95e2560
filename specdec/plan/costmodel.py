"""What speculative rounds cost, measured and predicted (SpecDec++: T = N_draft * t_draft + N_target * t_target),
and the width each round verifies at: the one owner of verification cost.

A `Profile` holds seconds measured on one machine per batch-size bucket (rows rounded up to a power of
two): the draft's work for a round of one and of two drafts, one target forward (with verification)
per width, and what an admission costs beyond its rows' own prefill. It saves to and loads from JSON.

`VerifyWidths` decides the width a round verifies at. A target forward's cost is not monotone in its width
(tokens per row): matrix kernels pick their blocking by shape (bench/results/README.md has measured cases), and
vLLM pads batches to the sizes it captured CUDA graphs for. So each round's verification is timed per (bucket,
width), as if the bucket were full, and a chain round that needs width w0 = k + 1 >= 2 runs at the width in
[w0, w0 + `Tuning.pad`] (within max_draft_tokens + 1) with the lowest time once every width in reach was timed
`Tuning.width_samples` times, if that is `Tuning.pad_margin` cheaper than w0 itself. Until then the smallest
untimed width runs (the whole exploration), and that round is no sample of its length's cost. Rounds without
drafts (w0 = 1) and token trees are never padded. Padding is free of semantics: the extra positions carry junk
tokens, their logits are dropped, and the cache slots they write lie past the row's length.

`CostModel` predicts a round of K drafts at a bucket: the draft's work for K tokens plus the target forward at
the width `VerifyWidths` will run it at; a token tree's K levels are verified at the width of its nodes (1 + K *
nodes per level), so a wide tree costs what its width costs where width is not free (a CPU, a GPU at large
batch). Live rounds correct the prediction per bucket: the length that keeps running tracks the bucket's level
(machine load and growing contexts move every cost together); a length run after another is measured against
that level, which corrects its own cost (medians of the last few samples: speculative rounds vary more than
plain ones).

`chain_tokens` (per-depth pass rates; `expected_tokens` is its constant-rate case) and `best_length` are the
one rule for choosing K from acceptance and costs: goodput, the profiler and `specbatch estimate` use them.
`Tuning` holds goodput's constants and those of the costs it plans from.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

import numpy as np

from ..exec.graphs import pow2_at_least


@dataclass(frozen=True)
class Tuning:
    """goodput's tuning constants, and those of the costs it plans from (verify padding, the start-up profile)."""

    row_weight: float = 64.0
    """Tested tokens the pair's acceptance rate is worth in a row's estimate (a row's rate is shrunk towards it)."""
    pair_prior: tuple[float, float] = (8.0, 16.0)
    """Accepted and tested tokens the pair's rate starts from: a rate of 0.5, worth 16 tested tokens."""
    depth_weight: float = 16.0
    """Tested levels the pass rate of the depth above is worth in a depth's pass rate."""
    width_weight: float = 16.0
    """Tested levels all rounds' pass rate at a depth is worth in a tree width's rate there."""
    fan_prior_levels: float = 8.0
    """Levels of depth the prior of a tree's nodes per level (1 + s / 2 at s siblings per node) is worth."""
    optimism: float = 1.0
    """Standard deviations of a length's expected tokens counted when asking whether it could win (re-timing)."""
    refresh: int = 24
    """Rounds after which a length's last cost sample is stale: a length that could win is then re-timed."""
    retime_within: float = 0.85
    """A stale length is re-timed while its hoped-for tokens per second are within this share of the choice's."""
    max_wait: int = 1 << 12
    """The most rounds a length waits between re-timings (a re-timing that leaves it unable to win doubles its
    wait, up to this)."""
    probe_samples: int = 2
    """Live samples a re-timing takes of a length."""
    timing_floor: float = 0.005
    """Seconds a start-up timing's runs add up to at least (up to 16 runs): the least of a few sub-millisecond runs
    is noisy enough to make a second draft token look nearly free."""
    settle: int = 8
    """Rounds the lengths' scores stand while no row drafts, none is admitted and the batch keeps its size (plain
    rounds then cost almost no policy work; re-timings still fall due on time)."""
    probe_rounds: int = 3
    """Rounds a re-timing may run to take them."""
    step_margin: float = 0.15
    """Rows in step leave it (K = 0) only for a length that earns this much more per second: spreading their
    finish also leaves slots idle at the end of a batch and rows joining one by one, which no round time shows."""
    kept: int = 8
    """Finished rows' lengths and admission sizes averaged (the most recent)."""
    live_samples: int = 3
    """Live samples kept per bucket's level and per length's correction (their median counts)."""
    pad: int = 4
    """Widths past k + 1 a chain round may verify at (verify padding)."""
    pad_margin: float = 0.95
    """A wider width runs only where its measured time is below this share of k + 1's."""
    width_samples: int = 2
    """Timings of a width before verify padding trusts it (the estimate is their minimum: noise only adds)."""
    width_kept: int = 8
    """A width's most recent timings kept (a machine's load drifts)."""
    optimistic_rate: float = 0.8
    """Per-token acceptance the start-up profile assumes when asking whether a longer length could win (whether
    to time its width)."""


TUNING = Tuning()


bucket = pow2_at_least  # rows -> the bucket whose costs they are charged


def expected_tokens(rates: np.ndarray, max_k: int) -> np.ndarray:
    """[rows, max_k + 1]: the tokens a round of k = 0..max_k drafts emits for a row whose drafted tokens pass
    at per-token rate a: the accepted prefix plus the recovered or bonus token, (1 - a^(k+1)) / (1 - a)."""
    a = np.asarray(rates, dtype=np.float64)
    return chain_tokens(np.repeat(a[:, None], max_k, axis=1))


def chain_tokens(passes: np.ndarray, reach: np.ndarray | None = None) -> np.ndarray:
    """[rows, max_k + 1]: the tokens a round of k = 0..max_k drafts emits for rows whose d-th drafted token passes
    with probability passes[row, d - 1] once the ones before it passed: 1 + the sum over d <= k of the
    chance the first d pass; a row drafts at most reach[row] tokens (None: k)."""
    p = np.clip(np.asarray(passes, dtype=np.float64), 0.0, 0.999)
    survive = np.cumprod(p, axis=1)  # [rows, max_k]
    if reach is not None:
        survive = np.where(np.arange(1, p.shape[1] + 1)[None, :] <= np.asarray(reach)[:, None], survive, 0.0)
    return 1.0 + np.concatenate([np.zeros((p.shape[0], 1)), np.cumsum(survive, axis=1)], axis=1)


def tree_width(k: int, fan: float) -> int:
    """Tokens per row verifying k levels of a draft with `fan` nodes per level (a chain: fan 1, width k + 1)."""
    return 1 + int(np.ceil(k * fan - 1e-9))


def best_length(tokens: np.ndarray, seconds: np.ndarray) -> int:
    """The K whose expected tokens [K + 1] per predicted second [K + 1] (nan: unknown) is highest; 0 if none."""
    per_second = np.where(np.isnan(seconds), -np.inf, tokens / np.where(np.isnan(seconds), 1.0, seconds))
    return int(np.argmax(per_second)) if np.isfinite(per_second).any() else 0


@dataclass
class Profile:
    draft_one: dict[int, float] = field(default_factory=dict)  # bucket -> drafting 1 token (catch-up forward)
    draft_two: dict[int, float] = field(default_factory=dict)  # bucket -> drafting 2 tokens
    target: dict[int, dict[int, float]] = field(default_factory=dict)  # bucket -> width -> seconds
    prefill_fixed: float = 0.0  # a prefill call's cost beyond its rows' share
    draft_prefill: float = 0.0  # one row's draft prefill
    prefill_token: float = 0.0  # the target's prefill per prompt token (measured by `specbatch profile`)
    hardware: str = ""

    def drafting(self, b: int, k: int) -> float | None:
        """Seconds of the draft's work for k tokens at bucket b: one catch-up forward, then k - 1 steps."""
        if k == 0:
            return 0.0
        b = self._near(self.draft_one, b)
        if b is None:
            return None
        step = max(0.0, self.draft_two.get(b, self.draft_one[b]) - self.draft_one[b])
        return self.draft_one[b] + (k - 1) * step

    def verifying(self, b: int, width: int) -> float | None:
        """Seconds of the target's forward over `width` tokens per row at bucket b: between measured widths, on the
        line between the nearest two; beyond the widest measured, the widest (a forward never gets cheaper)."""
        b = self._near(self.target, b)
        if b is None:
            return None
        times = self.target[b]
        if width in times:
            return times[width]
        if max(times) < width:
            return times[max(times)]
        below, above = [w for w in times if w < width], min(w for w in times if w > width)
        if not below:
            return None
        lo = max(below)
        return times[lo] + (times[above] - times[lo]) * (width - lo) / (above - lo)

    def round(self, b: int, k: int, width: int | None = None) -> float | None:
        """A round of k drafts verified at `width` tokens per row (None: a chain's k + 1)."""
        d, v = self.drafting(b, k), self.verifying(b, width or k + 1)
        return None if d is None or v is None else d + v

    def rounds(self, b: int, max_k: int, fan: float = 1.0, widths: tuple[int, ...] | None = None) -> np.ndarray:
        """[max_k + 1] seconds of a round of k = 0..max_k drafts at bucket b, verified at widths[k] tokens per row
        (None: 1 + ceil(k * fan), a draft of `fan` nodes per level of depth: a chain's k + 1 at fan 1); nan where
        the profile cannot say."""
        widths = widths or tuple(tree_width(k, fan) for k in range(max_k + 1))
        return np.array([np.nan if (t := self.round(b, k, widths[k])) is None else t for k in range(max_k + 1)])

    @staticmethod
    def _near(table: dict[int, object], b: int) -> int | None:
        return min(table, key=lambda x: (abs(x.bit_length() - b.bit_length()), x)) if table else None

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as f:
            data = json.load(f)
        ints = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731 (JSON keys are strings)
        return cls(draft_one=ints(data["draft_one"]), draft_two=ints(data["draft_two"]),
                   target={int(b): ints(t) for b, t in data["target"].items()},
                   prefill_fixed=data["prefill_fixed"], draft_prefill=data["draft_prefill"],
                   prefill_token=data.get("prefill_token", 0.0), hardware=data.get("hardware", ""))


class VerifyWidths:
    """The width each chain round verifies at, from timings of the engine's own rounds (module docstring)."""

    def __init__(self, max_width: int, tuning: Tuning = TUNING):
        self.max_width = max_width  # max_draft_tokens + 1: the cache has room for this many
        self.tuning = tuning
        self.times: dict[tuple[int, int], list[float]] = {}  # (bucket, width) -> seconds, as if the bucket were full

    def choose(self, n: int, w0: int) -> int:
        """The width a round of n rows needing w0 runs at: an untimed one in reach while there is one, else `best`."""
        w = self.untimed(n, w0)
        return self.best(n, w0) if w is None else w

    def untimed(self, n: int, w0: int) -> int | None:
        """The smallest width in reach of w0 not yet timed `width_samples` times at n's bucket, if any."""
        widest = min(self.max_width, w0 + self.tuning.pad)
        if w0 == 1 or w0 >= widest:
            return None
        b = bucket(n)
        return next((w for w in range(w0, widest + 1) if len(self.times.get((b, w), ())) < self.tuning.width_samples),
                    None)

    def best(self, n: int, w0: int) -> int:
        """The width a round needing w0 runs at, among the widths timed `width_samples` times (no exploration)."""
        b, t = bucket(n), self.tuning
        timed = [w for w in range(w0, min(self.max_width, w0 + t.pad) + 1)
                 if len(self.times.get((b, w), ())) >= t.width_samples]
        if w0 == 1 or w0 not in timed:
            return w0
        best = min(timed, key=lambda w: min(self.times[(b, w)]))
        return best if min(self.times[(b, best)]) < t.pad_margin * min(self.times[(b, w0)]) else w0

    def observe(self, n: int, w: int, seconds: float) -> None:
        b = bucket(n)
        keep_last(self.times.setdefault((b, w), []), seconds * b / n, self.tuning.width_kept)


class CostModel:
    def __init__(self, profile: Profile, widths: VerifyWidths | None = None, tuning: Tuning = TUNING):
        self.profile = profile
        self.widths = widths  # the width a chain round runs at (None: k + 1, no padding)
        self.tuning = tuning
        self.level: dict[int, list[float]] = {}  # bucket -> live / predicted, of the running choice's rounds
        self.correction: dict[tuple[int, int, int], list[float]] = {}  # (bucket, K, s) -> live / (predicted * level)
        self.stamp: dict[tuple[int, int, int], int] = {}  # (bucket, K, s) -> round of its last sample
        self.last: dict[int, tuple[int, int]] = {}  # bucket -> the (K, s) of its last sampled round
        self.rounds = 0
        self._base: dict[tuple, np.ndarray] = {}  # (bucket, widths) -> the profile's round times

    def width(self, n: int, k: int, fan: float = 1.0) -> int:
        """The width the engine verifies a round of k drafts over n rows at: a tree's nodes + 1 (`fan` nodes per
        level, > 1), a chain's k + 1 or the wider one verify padding runs it at."""
        if fan > 1.0:
            return tree_width(k, fan)
        return self.widths.best(n, k + 1) if self.widths is not None else k + 1

    def seconds(self, n: int, max_k: int, s: int = 0, fan: float = 1.0) -> np.ndarray:
        """[max_k + 1] predicted seconds of a round of k = 0..max_k drafts at n rows (as if its bucket were full;
        nan where the profile cannot say), drafting trees of at most s siblings per node with `fan` nodes per
        level (s = 0: chains, fan 1)."""
        b = bucket(n)
        widths = tuple(self.width(n, k, fan if s else 1.0) for k in range(max_k + 1))
        if (b, widths) not in self._base:
            self._base[(b, widths)] = self.profile.rounds(b, max_k, widths=widths)
        t = self._base[(b, widths)] * (statistics.median(self.level[b]) if b in self.level else 1.0)
        for (bb, k, ss), fix in self.correction.items():
            if bb == b and ss == s and k <= max_k:
                t[k] *= statistics.median(fix)
        return t

    def observe(self, n: int, k: int, seconds: float, s: int = 0, width: int | None = None) -> None:
        """A live round of k drafts (of at most s siblings per node) at n rows, verified at `width` tokens per row
        (None: a chain's, as `width` says), took `seconds`: the same choice as the bucket's last sampled round
        tracks the level; another corrects its own cost against that level."""
        b, key = bucket(n), (k, s if k else 0)
        base = self.profile.round(b, k, width or self.width(n, k))
        self.rounds += 1
        if not base:
            return
        kept = self.tuning.live_samples
        fix = statistics.median(self.correction[(b, *key)]) if (b, *key) in self.correction else 1.0
        if self.last.get(b, key) == key or b not in self.level:
            keep_last(self.level.setdefault(b, []), seconds / (base * fix), kept)
        else:
            keep_last(self.correction.setdefault((b, *key), []), seconds / (base * statistics.median(self.level[b])),
                      kept)
        self.last[b] = key
        self.stamp[(b, *key)] = self.rounds


def keep_last(samples: list, x, last: int) -> None:
    """Append x to samples, keeping the last `last` of them."""
    samples.append(x)
    del samples[:-last]
