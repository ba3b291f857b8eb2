"""The time models' refit by the normal equations (normal_fit.normal_nnls) is the SVD
fit's least squares solution (np.linalg.lstsq, rcond=None), rounding aside: on full-rank
windows, on windows whose features are exactly dependent (every prompt of one length, as
bench_conductor's; one request repeated), where the SVD fit's minimum-norm solution is
the answer, and under the non-negativity rule; a window it cannot tell (features nearly
but not exactly dependent, NaN, infinity) is left to the SVD fit (None)."""

from __future__ import annotations

import random

import pytest

from kvmesh.services.conductor import estimator as E
from kvmesh.services.conductor.normal_fit import normal_nnls


def _fits(m):
    start = m._head if m._rows == m._window else 0
    xt, y = m._xbuf[:, start : start + m._rows], m._ybuf[start : start + m._rows]
    scales = m._scales(xt)
    normal = normal_nnls(m._xraw, m._yraw, start, m._rows, 2 * m._window, scales)
    return normal, m._gelsd_nnls(xt, y, scales)


def _one_length(rng):  # n + c constant: n (n + c) is a multiple of n
    c = rng.randint(0, 32) * 256
    n = 8209 - c
    return n, c, 20 + 0.05 * n + 2e-6 * n * (n + c) + rng.gauss(0, 5)


def _varied(rng):
    n, c = rng.randint(1, 9000), rng.randint(0, 32) * 256
    return n, c, 20 + 0.05 * n + 2e-6 * n * (n + c) + rng.gauss(0, 5)


def _repeated(rng):  # rank one: every feature a multiple of the constant
    return 1000, 0, 30 + rng.gauss(0, 1)


def _negative(rng):  # coefficients that come out negative: features dropped
    n, c = rng.randint(1, 4000), rng.randint(0, 4000)
    return n, c, rng.uniform(0.5, 50) if rng.random() < 0.85 else rng.uniform(-5, 1)


@pytest.mark.parametrize("window", [_one_length, _varied, _repeated, _negative])
def test_the_normal_equations_give_the_svd_fit(window):
    rng = random.Random(5)
    for _ in range(60):
        m = E.PrefillModel(20, 0.05, 2e-6)
        m.fit = lambda: None
        for _ in range(rng.randint(2, 400)):
            m.observe(*window(rng))
        normal, svd = _fits(m)
        assert normal is not None
        assert [c == 0 for c in normal] == [c == 0 for c in svd]
        assert normal == pytest.approx(svd, rel=1e-9, abs=0)


def test_decode_windows_too():
    rng = random.Random(6)
    for _ in range(60):
        m = E.DecodeModel()
        m.fit = lambda: None
        for _ in range(rng.randint(2, 400)):
            b = rng.randint(1, 64)
            m.observe(b, b * rng.randint(100, 3000), 5 + 0.3 * b + rng.gauss(0, 1))
        normal, svd = _fits(m)
        assert normal is not None
        assert normal == pytest.approx(svd, rel=1e-9, abs=0)


def test_a_window_the_normal_equations_cannot_tell_is_left_to_the_svd_fit():
    # the third feature the second times a constant but for one row in 10^9: nearly,
    # not exactly, dependent (the SVD fit keeps it, the normal equations cannot see it)
    m = E.DecodeModel()
    m.fit = lambda: None
    rng = random.Random(7)
    for i in range(100):
        b = rng.randint(1, 64)
        m.observe(b, b * 1000 * (1 + (1e-9 if i == 50 else 0.0)), 5 + 0.3 * b)
    normal, svd = _fits(m)
    assert normal is None
    m2 = E.DecodeModel()
    m2.fit = lambda: None
    m2.observe(1, float("nan"), 5.0)
    m2.observe(2, 3.0, 6.0)
    m2.observe(3, 1.0, 7.0)
    assert _fits(m2)[0] is None


def test_the_refit_keeps_what_the_fits_agree_on():
    """A model refit through its window lands on the SVD fit's coefficients."""
    rng = random.Random(8)
    m = E.PrefillModel(20, 0.05, 2e-6)
    for _ in range(300):
        m.observe(*_one_length(rng))
    _, svd = _fits(m)
    m.fit()
    assert m.coef == pytest.approx(svd, rel=1e-9, abs=0)
