"""Coupled sampling's Gumbel noise (`sampling.gumbel`): Philox4x32-10 in torch integer ops, drawn on the model's
device, each value a function of (row key, output position, token id) alone.

Philox is checked against Random123's published known-answer vectors and against a scalar reference written here
from the Random123 spec; the noise's distribution by tests with a stated false-failure probability (ALPHA)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_models import DEVICE
from specdec.spec import sampling

U32 = 0xFFFFFFFF
ALPHA = 1e-6  # each distribution test's false-failure probability

# Random123 tests/kat_vectors, philox4x32 10: counter words, key words, output words
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((U32,) * 4, (U32,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


def philox_reference(ctr, key, rounds=10):
    """Scalar Philox4x32-R after Random123's philox.h, in Python's exact integers: a round takes the 64-bit
    products M0 * c0 and M1 * c2 and yields (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0)); the
    key gains (0x9E3779B9, 0xBB67AE85) mod 2^32 before every round but the first."""
    (c0, c1, c2, c3), (k0, k1) = ctr, key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & U32, (k1 + 0xBB67AE85) & U32
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & U32, (p0 >> 32) ^ c3 ^ k1, p0 & U32
    return c0, c1, c2, c3


def philox_torch(ctr, key, rounds=10, device="cpu"):
    words = lambda ws: tuple(torch.as_tensor(np.asarray(w, dtype=np.int64), device=device) for w in ws)
    return tuple(w.cpu().numpy() for w in sampling.philox4x32(words(ctr), words(key), rounds))


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_matches_random123_known_answers(ctr, key, want):
    assert philox_reference(ctr, key) == want  # the reference is Philox4x32-10
    assert [int(w) for w in philox_torch(ctr, key, device=DEVICE)] == list(want)


def test_philox_matches_the_scalar_reference_on_random_words():
    """Random words, most of them with the top bit set (where a 32x32-bit product leaves int64), and the edges."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, size=(600, 6), dtype=np.uint64).astype(np.int64)
    words[:300] |= 1 << 31
    words[-3:] = [[0] * 6, [U32] * 6, [1 << 31] * 6]
    ctr, key = words[:, :4].T, words[:, 4:].T
    for rounds in (1, 10):
        got = np.stack(philox_torch(ctr, key, rounds, DEVICE), axis=1)
        want = np.array([philox_reference(c, k, rounds) for c, k in zip(words[:, :4].tolist(), words[:, 4:].tolist())])
        assert np.array_equal(got, want), rounds


def test_noise_is_a_function_of_key_position_and_token_alone():
    """Overlapping windows drawn in other batches (other rows, order, start, width, vocab and pass size) agree
    value for value; a greedy row is zeros; no two (row, position) streams coincide."""
    keys, start = [11, None, 2**63 + 5, 7], np.array([0, 3, 100, 2**31 + 4])
    full = sampling.gumbel(keys, start, 6, 101, "cpu")  # [4, 6, 101], odd vocab
    assert full.shape == (4, 6, 101) and not full[1].any()
    other = sampling.gumbel([7, None, 11, 2**63 + 5], np.array([2**31 + 6, 0, 2, 101]), 3, 60, "cpu", blocks=7)
    assert torch.equal(other[0], full[3, 2:5, :60]) and torch.equal(other[2], full[0, 2:5, :60])
    assert torch.equal(other[3], full[2, 1:4, :60]) and not other[1].any()
    alone = sampling.gumbel([2**63 + 5], np.array([100]), 6, 101, "cpu", blocks=1)  # one Philox block per pass
    assert torch.equal(alone[0], full[2])
    streams = full[[0, 2, 3]].flatten(0, 1)  # [18, 101]
    assert len({tuple(s.tolist()) for s in streams}) == 18
    # the same key at another position, or another key: other values
    assert not torch.equal(sampling.gumbel([12], np.array([0]), 1, 101, "cpu")[0, 0], full[0, 0])
    # positions the device holds (a round in flight's lengths) draw what the same host positions draw
    assert torch.equal(sampling.gumbel(keys, torch.from_numpy(start), 6, 101, "cpu"), full)


def test_noise_uniforms_are_uniform():
    """Kolmogorov-Smirnov against U(0, 1) for the 53-bit uniforms and against the Gumbel CDF for the noise itself,
    at the DKW-Massart bound P(D > eps) <= 2 exp(-2 n eps^2) = ALPHA; a slightly skewed sample is refused."""
    def ks(u: np.ndarray) -> float:
        u, n = np.sort(u), len(u)
        return max((np.arange(1, n + 1) / n - u).max(), (u - np.arange(n) / n).max())

    n = 200_000
    eps = math.sqrt(math.log(2 / ALPHA) / (2 * n))
    x = sampling.philox4x32((torch.arange(n // 2), torch.tensor(5), torch.tensor(U32), torch.tensor(1 << 31)),
                            (torch.tensor(0x12345678), torch.tensor(0xDEADBEEF)))
    u = torch.cat([sampling.uniform53(x[0], x[1]), sampling.uniform53(x[2], x[3])]).numpy()
    assert u.dtype == np.float64 and u.min() >= 0 and u.max() < 1
    assert ks(u) < eps
    assert ks(u**1.05) > eps  # the test can fail
    g = sampling.gumbel([3, 4, 5, 6], np.array([0, 0, 9, 2**20]), 5, n // 20, "cpu").double().flatten().numpy()
    assert ks(np.exp(-np.exp(-g))) < eps
    # all 53 bits vary: the low bits of the uniforms are uniform too (chi-square over their last byte)
    low = np.round(u * 2.0**53).astype(np.int64) & 0xFF
    assert chi2_p(np.bincount(low, minlength=256), np.full(256, 1 / 256)) > ALPHA


def chi2_p(counts: np.ndarray, p: np.ndarray) -> float:
    """Pearson's chi-square test's p-value of `counts` against the probabilities `p`."""
    expected = counts.sum() * p
    stat = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(p) - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_gumbel_max_draws_follow_softmax():
    """The argmax of logits + noise at each (row, position) follows softmax(logits) (chi-square), and the draws of
    consecutive positions of a row are independent (chi-square on their contingency table)."""
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    rows, width = 400, 60
    noise = sampling.gumbel(list(range(rows)), np.zeros(rows, dtype=np.int64), width, len(p), "cpu")
    draws = (torch.tensor(np.log(p), dtype=torch.float32) + noise).argmax(-1).numpy()  # [rows, width]
    assert chi2_p(np.bincount(draws.flatten(), minlength=len(p)), p) > ALPHA
    assert chi2_p(np.bincount(draws.flatten(), minlength=len(p)), np.roll(p, 1)) < ALPHA  # the test can fail
    pairs = draws[:, :-1] * len(p) + draws[:, 1:]
    assert chi2_p(np.bincount(pairs.flatten(), minlength=len(p) ** 2), np.outer(p, p).flatten()) > ALPHA


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", sorted({"cpu", DEVICE}))
def test_noise_is_drawn_on_the_device_in_a_fixed_number_of_ops(device, monkeypatch):
    """float32 on the requested device; no numpy generator and no work per (row, position): as many tensor ops
    for 2 rows x 2 positions as for 16 x 8 (one pass each); on a GPU the CPU's values."""
    monkeypatch.setattr(np.random, "Generator", None)  # the old host path's generator
    counts = {}
    for n, width in ((2, 2), (16, 8)):
        with CountOps() as mode:
            out = sampling.gumbel(list(range(n)), np.arange(n), width, 50, device)
        counts[n, width] = mode.ops
        assert out.shape == (n, width, 50) and out.dtype == torch.float32 and out.device.type == device
    assert counts[2, 2] == counts[16, 8]
    # the positions on the device (the rows' lengths a round in flight advanced): the same values
    assert torch.equal(sampling.gumbel(list(range(16)), torch.arange(16, device=device), 8, 50, device), out)
    if device != "cpu":  # integer words bit for bit; the device's float64 log may differ from the CPU's in an ulp
        cpu = sampling.gumbel(list(range(16)), np.arange(16), 8, 50, "cpu")
        torch.testing.assert_close(out.cpu(), cpu, rtol=1e-6, atol=1e-6)
        assert (out.cpu() == cpu).float().mean() > 0.999
