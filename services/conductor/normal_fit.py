"""The time models' refit (estimator.py) by the normal equations of their window: the
least squares solution of ``np.linalg.lstsq`` (rcond=None, the minimum-norm one where
features are exactly dependent) and its non-negativity rule, differing from it by
rounding only, in a few thousand float operations instead of LAPACK's SVD (50-90 us
with numpy's wrapping, every 8th report of every node). Where the normal equations
cannot tell (features nearly but not exactly dependent, a NaN, an infinity) it answers
None, and the model runs the SVD fit.

Compiled (setup.py), the window's sums are loops over typed memory; as plain Python,
numpy computes the same sums (``np.add.accumulate``, strictly in order) to the same bits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

_EPS = float(np.finfo(np.float64).eps)
# where setup.py compiled this module: its loops run as C (else numpy does their sums)
_COMPILED = not __file__.endswith(".py")

# a pivot of the scaled normal equations below this share of its diagonal: the feature
# is nearly a combination of the ones before it (checked on the window itself, below)
_COLLINEAR = 1e-6
# the SVD fit's cut-off (``np.linalg.lstsq``, rcond=None): a singular value below eps x
# max(rows, features) of the largest counts as zero. A feature whose distance from the
# span of the others (on the window) is below 1/16 of that cut-off has such a singular
# value for sure: it is dropped as the SVD fit drops it
_DEPENDENT = _EPS / 16


def _ring_gram(
    xr: Any, yr: Any, start: int, rows: int, stride: int, scales: list[float]
) -> tuple[list[list[float]], list[float]]:
    """X^T X and X^T y of the window's three features, each scaled by ``scales`` (its
    largest |x|), summed row by row in order: ``xr`` holds feature f of row j at
    ``f * stride + j`` and ``yr`` the times (``_Regression``'s rings). (A loop over
    typed memory where compiled; numpy's ``@`` may hand a 3 x 3 product to BLAS's
    threads, milliseconds on a loaded machine.)"""
    if not _COMPILED:  # the same sums by numpy (each a sequential accumulate)
        return _ring_gram_numpy(xr, yr, start, rows, stride, scales)
    s0, s1, s2 = scales[0], scales[1], scales[2]
    g00 = g01 = g02 = g11 = g12 = g22 = r0 = r1 = r2 = 0.0
    for j in range(start, start + rows):
        a = xr[j] / s0
        b = xr[j + stride] / s1
        c = xr[j + 2 * stride] / s2
        v = yr[j]
        g00 += a * a
        g01 += a * b
        g02 += a * c
        g11 += b * b
        g12 += b * c
        g22 += c * c
        r0 += a * v
        r1 += b * v
        r2 += c * v
    return [[g00, g01, g02], [g01, g11, g12], [g02, g12, g22]], [r0, r1, r2]


def _ring_residual(
    xr: Any, start: int, rows: int, stride: int, scales: list[float], w: list[float]
) -> float:
    """The squared norm of the window's scaled features combined by ``w`` (one weight per
    feature), row by row."""
    if not _COMPILED:
        return _ring_residual_numpy(xr, start, rows, stride, scales, w)
    s0, s1, s2 = scales[0], scales[1], scales[2]
    w0, w1, w2 = w[0], w[1], w[2]
    total = 0.0
    for j in range(start, start + rows):
        e = w0 * (xr[j] / s0) + w1 * (xr[j + stride] / s1) + w2 * (xr[j + 2 * stride] / s2)
        total += e * e
    return total


def _features3(xr: Any, start: int, rows: int, stride: int, scales: list[float]) -> list:
    x = np.frombuffer(xr, dtype=np.float64)
    return [x[f * stride + start : f * stride + start + rows] / scales[f] for f in range(3)]


def _ring_gram_numpy(
    xr: Any, yr: Any, start: int, rows: int, stride: int, scales: list[float]
) -> tuple[list[list[float]], list[float]]:
    """``_ring_gram`` as plain Python computes it: the same products, each sum by
    ``np.add.accumulate`` (strictly in order, unlike ``np.sum``'s pairwise sums), so
    the same bits as the compiled loop, at numpy's speed rather than the interpreter's."""
    a, b, c = _features3(xr, start, rows, stride, scales)
    v = np.frombuffer(yr, dtype=np.float64)[start : start + rows]
    acc = np.add.accumulate
    g = [[float(acc(p * q)[-1]) for q in (a, b, c)] for p in (a, b, c)]
    return g, [float(acc(p * v)[-1]) for p in (a, b, c)]


def _ring_residual_numpy(
    xr: Any, start: int, rows: int, stride: int, scales: list[float], w: list[float]
) -> float:
    """``_ring_residual`` as plain Python computes it (see ``_ring_gram_numpy``)."""
    a, b, c = _features3(xr, start, rows, stride, scales)
    e = w[0] * a + w[1] * b + w[2] * c
    return float(np.add.accumulate(e * e)[-1])


def _least_squares(
    g: list[list[float]],
    r: list[float],
    active: list[int],
    ring: tuple[Any, int, int, int, list[float]],
) -> list[float] | None:
    """The minimum-norm least squares solution over the features ``active`` from the
    scaled normal equations (``g``: X^T X, ``r``: X^T y of the scaled features
    ``ring``: the window, ``_ring_gram``'s arguments): an LDL^T factorisation of the active
    block; a feature that is a combination of the ones before it (its pivot below
    ``_COLLINEAR`` of its diagonal, and the window confirms it to the last bits,
    ``_DEPENDENT``) is rank deficiency, which the solution is projected off (the
    minimum-norm solution, as the SVD fit's). None where the normal equations cannot
    tell (a feature nearly but not exactly dependent, a NaN, an infinity)."""
    k = len(active)
    xr, start, rows, stride, scales = ring
    cut = _DEPENDENT * (rows if rows > k else k)
    top = 0.0  # the largest column norm: the largest singular value is no less
    for p in range(k):
        v = g[active[p]][active[p]]
        if v > top:
            top = v
    top = math.sqrt(top)
    basis: list[int] = []  # positions in ``active`` of the independent features
    lo: list[list[float]] = []  # LDL^T of the basis: lo[i][m] (m < i), pivots piv[i]
    piv: list[float] = []
    nulls: list[list[float]] = []  # a vector of the null space per dependent feature
    for p in range(k):
        gp = g[active[p]]
        row = [0.0] * len(basis)
        for i in range(len(basis)):
            v = gp[active[basis[i]]]
            for m in range(i):
                v -= row[m] * lo[i][m] * piv[m]
            row[i] = v / piv[i]
        diag = gp[active[p]]
        v = diag
        for m in range(len(basis)):
            v -= row[m] * row[m] * piv[m]
        if not diag - diag == 0.0 or not v == v:  # a NaN or an infinity
            return None
        if v > _COLLINEAR * diag:
            basis.append(p)
            lo.append(row)
            piv.append(v)
            continue
        # the weights w of the basis that make this feature (G_BB w = G_Bp, by the
        # factorisation: row is D^-1 L^-1 G_Bp), then its residual on the window
        w = row[:]
        for i in range(len(basis) - 1, -1, -1):
            for m in range(i + 1, len(basis)):
                w[i] -= lo[m][i] * w[m]
        nv = [0.0] * k  # the null vector: this feature less its weights of the basis
        nv[p] = 1.0
        norm = 1.0
        for i in range(len(basis)):
            nv[basis[i]] = -w[i]
            norm += w[i] * w[i]
        full = [0.0] * len(scales)
        for i in range(k):
            full[active[i]] = nv[i]
        res = _ring_residual(xr, start, rows, stride, scales, full)
        if not res < (cut * top) * (cut * top) * norm:
            return None  # near, not exactly, dependent: the SVD fit decides
        nulls.append(nv)
    nb = len(basis)
    z = [0.0] * nb  # the basic solution: L z = r_B, then D L^T x = z
    for i in range(nb):
        v = r[active[basis[i]]]
        for m in range(i):
            v -= lo[i][m] * z[m]
        z[i] = v
    sol = [0.0] * k
    for i in range(nb - 1, -1, -1):
        v = z[i] / piv[i]
        for m in range(i + 1, nb):
            v -= lo[m][i] * sol[basis[m]]
        sol[basis[i]] = v
    # the minimum-norm one: the basic solution less its part in the null space (the
    # null vectors made orthonormal first)
    ortho: list[list[float]] = []
    for nv in nulls:
        for q in ortho:
            d = 0.0
            for i in range(k):
                d += q[i] * nv[i]
            for i in range(k):
                nv[i] -= d * q[i]
        d = 0.0
        for i in range(k):
            d += nv[i] * nv[i]
        d = math.sqrt(d)
        for i in range(k):
            nv[i] /= d
        ortho.append(nv)
    for q in ortho:
        d = 0.0
        for i in range(k):
            d += q[i] * sol[i]
        for i in range(k):
            sol[i] -= d * q[i]
    for v in sol:
        if not v - v == 0.0:  # a NaN or an infinity
            return None
    return sol


def normal_nnls(
    xr: Any, yr: Any, start: int, rows: int, stride: int, scales: list[float]
) -> list[float] | None:
    """The window's non-negative least squares fit of three features by its normal
    equations (the window as ``_ring_gram`` reads it): the same active-set rule as the
    SVD fit (features whose coefficient comes out negative are dropped, the rest solved
    again), each solve the same minimum-norm least squares solution as
    ``np.linalg.lstsq``'s (``_least_squares``), differing from it by rounding only, in
    a few thousand float operations instead of LAPACK's SVD (50-90 us with numpy's
    wrapping, every 8th report of every node). None where the normal equations cannot
    tell: the SVD fit then."""
    g, r = _ring_gram(xr, yr, start, rows, stride, scales)
    ring = (xr, start, rows, stride, scales)
    active = [0, 1, 2]
    coef = [0.0, 0.0, 0.0]
    while active:
        sol = _least_squares(g, r, active, ring)
        if sol is None:
            return None
        kept = [active[i] for i in range(len(active)) if sol[i] >= 0]
        if len(kept) == len(active):
            for i in range(len(active)):
                coef[active[i]] = sol[i] / scales[active[i]]
            return coef
        active = kept
    return coef
