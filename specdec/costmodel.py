"""What speculative rounds cost, measured and predicted (SpecDec++: T = N_draft * t_draft + N_target * t_target).

A `Profile` holds seconds measured on one machine per batch-size bucket (rows rounded up to a power of
two): the draft's work for a round of one and of two drafts, one target forward (with verification)
per width, and what an admission costs beyond its rows' own prefill. It saves to and loads from JSON.

`CostModel` predicts a round of K drafts at a bucket: the draft's work for K tokens plus the cheapest
target forward over K + 1 tokens or a few more (verify padding); a token tree's K levels are verified
at the width of its nodes (1 + K * nodes per level), so a wide tree costs what its width costs where
width is not free (a CPU, a GPU at large batch). Live rounds correct the prediction
per bucket: the length that keeps running tracks the bucket's level (machine load and growing
contexts move every cost together); a length run after another is measured against that level, which
corrects its own cost (medians of the last few samples: speculative rounds vary more than plain ones).

`chain_tokens` (per-depth pass rates; `expected_tokens` is its constant-rate case) and `best_length` are the
one rule for choosing K from acceptance and costs: goodput, the profiler and `specbatch estimate` use them.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field

import numpy as np


def pow2_at_least(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


bucket = pow2_at_least  # rows -> the bucket whose costs they are charged


def expected_tokens(rates: np.ndarray, top: int) -> np.ndarray:
    """[rows, top + 1]: the tokens a round of k = 0..top drafts emits for a row whose drafted tokens pass
    at per-token rate a: the accepted prefix plus the recovered or bonus token, (1 - a^(k+1)) / (1 - a)."""
    a = np.asarray(rates, dtype=np.float64)
    return chain_tokens(np.repeat(a[:, None], top, axis=1))


def chain_tokens(passes: np.ndarray, reach: np.ndarray | None = None) -> np.ndarray:
    """[rows, top + 1]: the tokens a round of k = 0..top drafts emits for rows whose d-th drafted token passes
    with probability passes[row, d - 1] once the ones before it passed: 1 + the sum over d <= k of the
    chance the first d pass; a row drafts at most reach[row] tokens (None: k)."""
    p = np.clip(np.asarray(passes, dtype=np.float64), 0.0, 0.999)
    survive = np.cumprod(p, axis=1)  # [rows, top]
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

    def verifying(self, b: int, width: int, pad: int = 0) -> float | None:
        """Seconds of the target's forward over `width` tokens per row at bucket b, at the cheapest measured
        width up to `pad` wider; between measured widths, on the line between the nearest two; beyond the
        widest measured, the widest (a forward never gets cheaper)."""
        b = self._near(self.target, b)
        if b is None:
            return None
        times = self.target[b]
        reach = [t for w, t in times.items() if width <= w <= width + pad]
        if reach:
            return min(reach)
        if max(times) < width:
            return times[max(times)]
        below, above = [w for w in times if w < width], min(w for w in times if w > width)
        if not below:
            return None
        lo = max(below)
        return times[lo] + (times[above] - times[lo]) * (width - lo) / (above - lo)

    def round(self, b: int, k: int, pad: int = 0, width: int | None = None) -> float | None:
        """A round of k drafts verified at `width` tokens per row (None: k + 1, a chain)."""
        d, v = self.drafting(b, k), self.verifying(b, width or k + 1, pad)
        return None if d is None or v is None else d + v

    def rounds(self, b: int, top: int, pad: int = 0, fan: float = 1.0) -> np.ndarray:
        """[top + 1] seconds of a round of k = 0..top drafts at bucket b whose draft has `fan` nodes per level of
        depth (1: chains; a tree's k levels are verified at width 1 + ceil(k * fan)); nan where the profile
        cannot say."""
        return np.array([np.nan if (t := self.round(b, k, pad, tree_width(k, fan))) is None else t
                         for k in range(top + 1)])

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


class CostModel:
    samples = 3  # live samples kept per level and per correction (their median counts)

    def __init__(self, profile: Profile, pad: int = 0):
        self.profile = profile
        self.pad = pad  # verify padding's reach (0: off)
        self.level: dict[int, list[float]] = {}  # bucket -> live / predicted, of the running choice's rounds
        self.correction: dict[tuple[int, int, int], list[float]] = {}  # (bucket, K, s) -> live / (predicted * level)
        self.stamp: dict[tuple[int, int, int], int] = {}  # (bucket, K, s) -> round of its last sample
        self.last: dict[int, tuple[int, int]] = {}  # bucket -> the (K, s) of its last sampled round
        self.rounds = 0
        self._base: dict[tuple, np.ndarray] = {}  # (bucket, top, widths...) -> the profile's round times

    def seconds(self, n: int, top: int, s: int = 0, fan: float = 1.0) -> np.ndarray:
        """[top + 1] predicted seconds of a round of k = 0..top drafts at n rows (as if its bucket were full;
        nan where the profile cannot say), drafting trees of at most s siblings per node with `fan` nodes per
        level (s = 0: chains, fan 1)."""
        b = bucket(n)
        key = (b, top, *(tree_width(k, fan) for k in range(top + 1)))  # fan acts only through the widths
        if key not in self._base:
            self._base[key] = self.profile.rounds(b, top, self.pad, fan)
        t = self._base[key] * (statistics.median(self.level[b]) if b in self.level else 1.0)
        for (bb, k, ss), fix in self.correction.items():
            if bb == b and ss == s and k <= top:
                t[k] *= statistics.median(fix)
        return t

    def observe(self, n: int, k: int, seconds: float, s: int = 0, width: int | None = None) -> None:
        """A live round of k drafts (of at most s siblings per node, verified at `width`; None: a chain's k + 1)
        at n rows took `seconds`: the same choice as the bucket's last sampled round tracks the level; another
        corrects its own cost against that level."""
        b, key = bucket(n), (k, s if k else 0)
        base = self.profile.round(b, k, self.pad, width)
        self.rounds += 1
        if not base:
            return
        fix = statistics.median(self.correction[(b, *key)]) if (b, *key) in self.correction else 1.0
        if self.last.get(b, key) == key or b not in self.level:
            keep_last(self.level.setdefault(b, []), seconds / (base * fix), self.samples)
        else:
            keep_last(self.correction.setdefault((b, *key), []), seconds / (base * statistics.median(self.level[b])),
                      self.samples)
        self.last[b] = key
        self.stamp[(b, *key)] = self.rounds


def keep_last(samples: list, x, last: int) -> None:
    """Append x to samples, keeping the last `last` of them."""
    samples.append(x)
    del samples[:-last]
