"""Measuring a cost profile (specdec/plan/costmodel.py) by timing the engine's own round parts on synthetic rows
(`rounds.SyntheticRounds`, handed in as `Workload`).

For every batch-size bucket up to the batch size: the draft's work for a round of one and of two drafts, and
one target forward with verification per width (which also seeds verify padding's width timings), each the
minimum of `samples` runs taken back to back; widths are timed upwards while a length could still win at an
optimistic acceptance (`Tuning.optimistic_rate`), given that drafting more never makes a round cheaper; for
token trees, also the widest tree of the longest such length (narrower trees' costs lie on the line between).
Every width is then timed once more after all of them, so a slowdown of the machine lasting a few timings cannot
bias neighbouring widths together. Then a 1-row and a 2-row prefill (their difference is a prefill call's fixed
cost) and one row's draft prefill.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from .costmodel import TUNING, Profile, Tuning, best_length, bucket, expected_tokens

log = logging.getLogger(__name__)


def hardware(device: torch.device) -> str:
    """What a profile was measured on: the GPU's name, or the CPU's model and the threads torch computes with."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"CPU x{torch.get_num_threads()} ({name})"


def kept(folder: str | None, depends: dict, measure: Callable[[], Profile]) -> tuple[Profile, bool]:
    """(The profile kept in `folder` under a digest of what its costs `depends` on (JSON-able), or one measured now
    and kept there; whether it was kept from before). A kept file that cannot be read is measured again; a folder
    that cannot be written costs the keeping, never the profile. None: measured, not kept."""
    if folder is None:
        return measure(), False
    digest = hashlib.sha256(json.dumps(depends, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = os.path.join(folder, f"profile-{digest}.json")
    if os.path.exists(path):
        try:
            return Profile.load(path), True
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("specbatch: the kept cost profile %s cannot be read (%s); measuring it again", path, exc)
    profile = measure()
    try:
        os.makedirs(folder, exist_ok=True)
        part = f"{path}.{os.getpid()}.part"
        profile.save(part)
        os.replace(part, path)  # whole or not at all: another process may read it now
    except OSError as exc:
        log.warning("specbatch: could not keep the cost profile in %s (%s)", folder, exc)
    return profile, False


class Workload(Protocol):
    """Round parts on synthetic rows, each leaving the rows as it found them and the device idle."""

    def draft(self, n: int, k: int) -> None:
        """The draft's work for k tokens of rows [0, n)."""

    def verify(self, n: int, width: int, depth: int | None = None) -> None:
        """A target forward with verification over rows [0, n) at `width` tokens per row (with `depth`: a token
        tree that deep)."""

    def prefill(self, rows: int, draft: bool = False) -> None:
        """The target's (or the draft's) prefill of rows [0, rows)."""


def measure(work: Workload, batch_size: int, max_draft: int, draft_model: bool, siblings: int,
            clock: Callable[[], float], hardware: str = "", samples: int = 2, every_width: bool = False,
            tuning: Tuning = TUNING) -> Profile:
    """The cost profile of rounds of up to `max_draft` drafts at up to `batch_size` rows: drafting by a draft
    model (else free: prompt lookup), token trees of up to `siblings` siblings per node; `every_width` times every
    verification width up to max_draft + 1 (for estimates of other policies), not only those that could win."""
    profile = Profile(hardware=hardware)

    def best(fn, runs: int = samples) -> float:
        """The least of `runs` timings of fn, or of as many more as make `Tuning.timing_floor` seconds (at most 16)."""
        times = []
        while len(times) < runs or (sum(times) < tuning.timing_floor and len(times) < 16):
            t0 = clock()
            fn()
            times.append(clock() - t0)
        return min(times)

    for b in sorted({bucket(min(1 << i, batch_size)) for i in range(batch_size.bit_length() + 1)}):
        n = min(b, batch_size)
        if max_draft and draft_model:
            profile.draft_one[b] = best(lambda: work.draft(n, 1))
            profile.draft_two[b] = best(lambda: work.draft(n, 2)) if max_draft > 1 else profile.draft_one[b]
        elif max_draft:  # prompt lookup: drafting costs the host's lookup only, inside the round
            profile.draft_one[b] = profile.draft_two[b] = 0.0
        target = profile.target[b] = {}
        shapes: dict[int, int | None] = {}  # width -> a tree's depth (None: a chain)
        for w in range(1, max_draft + 2):
            k = w - 1
            if k and not every_width and not worth_timing(profile, b, k, tuning):
                break
            target[w], shapes[w] = best(lambda: work.verify(n, w)), None
        deep = max(target) - 1  # the longest chain that could win
        if siblings and deep:  # the widest tree of that depth: trees' widths lie between (specdec/plan/costmodel.py)
            w = 1 + deep * (1 + siblings)
            target[w], shapes[w] = best(lambda: work.verify(n, w, deep)), deep
        for w, depth in shapes.items():  # once more each, after all the others
            target[w] = min(target[w], best(lambda: work.verify(n, w, depth), runs=1))

    if batch_size > 1:
        profile.prefill_fixed = max(0.0, 2 * best(lambda: work.prefill(1)) - best(lambda: work.prefill(2)))
    if draft_model:
        profile.draft_prefill = best(lambda: work.prefill(1, draft=True))
    return profile


def worth_timing(profile: Profile, b: int, k: int, tuning: Tuning = TUNING) -> bool:
    """Could k drafts win at an optimistic acceptance, at no less than the longest timed width's cost?"""
    tokens = expected_tokens(np.array([tuning.optimistic_rate]), k)[0]  # [k + 1]
    seconds = profile.rounds(b, k)  # the widest timed width stands in for the untimed one: a lower bound
    return best_length(tokens, seconds) == k
