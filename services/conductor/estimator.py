"""Per-node time models the conductor fits online (design §2.4).

- :class:`PrefillModel`: ``t(n, c) = a + b·n + k·n·(n + c)`` ms for ``n`` new and ``c``
  cached tokens (the last term is attention's quadratic part). Warm-started from the
  profile a node runs when it joins, refit by least squares over a window of observed
  prefills; its relative prediction error is kept for metrics.
- :class:`DecodeModel`: step time ``t(B, K) = a + b·B + k·K`` ms for a batch of ``B``
  requests attending over ``K`` tokens in all; the TBT a request would see.
"""

from __future__ import annotations

import math
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvmesh.services.conductor.normal_fit import normal_nnls
from kvmesh.services.conductor.rolling import RollingWindow

_gelsd: Any
try:  # the LAPACK routine behind np.linalg.lstsq, without its ~30 us of wrapping
    from numpy.linalg import _umath_linalg

    _gelsd = _umath_linalg.lstsq
except (ImportError, AttributeError):  # pragma: no cover - another numpy layout
    _gelsd = None
_EPS = float(np.finfo(np.float64).eps)


def _lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``np.linalg.lstsq(a, y, rcond=None)[0]`` for a float64 ``a`` of shape (m, n) and
    ``y`` of shape (m,): the same LAPACK call with the same cut-off, so the same bits."""
    if _gelsd is None:  # pragma: no cover
        return np.linalg.lstsq(a, y, rcond=None)[0]
    m, n = a.shape
    with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
        sol = _gelsd(a, y[:, None], _EPS * max(n, m), signature="ddd->ddid")[0]
    return sol[:, 0]


class _Regression:
    """Non-negative least squares on a fixed feature map, over a sliding window."""

    def __init__(self, coef: Sequence[float], window: int = 256, refit_every: int = 8) -> None:
        self.coef = [float(c) for c in coef]
        # the window, oldest first, as a ring written twice (at i and i + window) so that
        # it is always one contiguous slice: the refit reads it without a copy. Feature by
        # feature (``_xbuf[j]`` is feature j over the ring): the refit's per-feature scale
        # is then a reduction along contiguous memory, ~3x faster than down the columns of
        # a row-major window, and LAPACK takes the transposed view as it is (column-major)
        self._window = window
        # (written through flat ``array``s, a few times faster per number than numpy's
        # item assignment; ``_xbuf``/``_ybuf`` are numpy views of the same memory)
        nf = self._nf = len(self.coef)
        self._xraw = array("d", bytes(8 * 2 * window * nf))
        self._yraw = array("d", bytes(8 * 2 * window))
        self._xbuf = np.frombuffer(self._xraw, dtype=np.float64).reshape(nf, 2 * window)
        self._ybuf = np.frombuffer(self._yraw, dtype=np.float64)
        # (the same memory again; compiled, typed views taken once, not on every report)
        self._xr = self._xraw
        self._yr = self._yraw
        self._head = 0  # where the next row goes
        self._rows = 0  # rows held, up to window
        self._errors: deque[float] = deque(maxlen=window)
        self._refit_every = refit_every
        self._pending = 0
        self.observations = 0
        # the refit's per-feature scale (max |x| over the window) kept up from one refit
        # to the next: the largest |x| of each feature and the number of the observation
        # that last brought it (None: to be recomputed over the whole window), and the
        # observations it covers (see ``_scales``)
        self._amax: list[float] = [0.0] * nf
        self._amax_obs: list[int] | None = None
        self._scaled_to = 0

    def _features(self, x: float, y: float, /) -> tuple[float, ...]:
        raise NotImplementedError

    def _predict(self, f: tuple[float, ...]) -> float:
        if len(f) == 3:  # sum()'s order, unrolled
            c = self.coef
            return c[0] * f[0] + c[1] * f[1] + c[2] * f[2]
        return sum([c * x for c, x in zip(self.coef, f)])

    def add(self, args: tuple[float, ...], ms: float, track_error: bool = True) -> None:
        x, y = args
        f = self._features(x, y)
        if track_error and ms > 0:
            self._errors.append(abs(self._predict(f) - ms) / ms)
        i, w = self._head, self._window
        xr, j = self._xr, i
        for v in f:  # feature by feature: at i and i + window of its own ring
            xr[j] = xr[j + w] = v
            j += 2 * w
        yr = self._yr
        yr[i] = yr[i + w] = ms
        self._head = (i + 1) % w
        self._rows = min(self._rows + 1, w)
        self.observations += 1
        self._pending += 1
        if self._pending >= self._refit_every or self.observations <= 4:
            self.fit()

    def fit(self) -> None:
        self._pending = 0
        rows = self._rows
        if rows < 2:
            return
        start = self._head if rows == self._window else 0
        scales = self._scales(None)
        coef = None
        if self._nf == 3:
            w = self._window
            coef = normal_nnls(self._xr, self._yr, start, rows, 2 * w, scales)
        if coef is None:
            # (features x rows; each division and comparison below is elementwise IEEE,
            # the same bits as the row-major arithmetic it replaced)
            xt, y = self._xbuf[:, start : start + rows], self._ybuf[start : start + rows]
            coef = self._gelsd_nnls(xt, y, scales)
        if all(map(math.isfinite, coef)) and any(coef):
            self.coef = coef

    def _gelsd_nnls(self, xt: np.ndarray, y: np.ndarray, scales: list[float]) -> list[float]:
        """The fit by LAPACK's SVD solver (``np.linalg.lstsq``), for the windows the
        normal equations leave to it (``normal_fit.normal_nnls``: too few rows, collinear
        features, non-finite numbers): its minimum-norm solution of a rank-deficient
        window, its cut-off of tiny singular values."""
        scale = np.array(scales)
        nf = self._nf
        active = list(range(nf))
        coef = [0.0] * nf
        # tiny active-set NNLS: drop features whose coefficient comes out negative
        while active:
            full = len(active) == nf  # (no fancy indexing then: a copy each)
            if full:
                a = (xt / scale[:, None]).T
            else:
                a = (xt[active] / scale[active][:, None]).T
            sol = _lstsq(a, y).tolist()
            if all(s >= 0 for s in sol):
                for j, s in zip(active, sol):
                    coef[j] = s / scales[j]
                break
            active = [a for a, s in zip(active, sol) if s >= 0]
        return coef

    def _scales(self, xt: np.ndarray | None) -> list[float]:
        """Each feature's ``max(max |x| over the window, 1e-12)``, as
        ``np.maximum(np.maximum.reduce(np.abs(xt), axis=1), 1e-12)``: from the maxima
        of the last refit and the few rows observed since (in Python: ~8 rows of 3
        features cost less than the two numpy reductions), recomputed over the window
        only when the row holding a maximum has left it (or a NaN came in). ``xt``: the
        window, features x rows (None: this model's own, taken only when needed)."""
        obs, rows, w = self.observations, self._rows, self._window
        gone = obs - rows  # the observations numbered up to this one have left the window
        amax, at = self._amax, self._amax_obs
        if at is not None and self._scaled_to >= gone and min(at) > gone:
            xr, stride = self._xr, 2 * w
            for o in range(self._scaled_to + 1, obs + 1):  # observation o is at (o-1) % w
                j = (o - 1) % w
                for f in range(self._nf):
                    v = abs(xr[j])
                    if v >= amax[f]:
                        amax[f], at[f] = v, o
                    elif v != v:  # a NaN: the reduction's own answer
                        at = None
                        break
                    j += stride
                if at is None:
                    break
        else:
            at = None
        if at is None:
            if xt is None:
                start = self._head if rows == w else 0
                xt = self._xbuf[:, start : start + rows]
            ab = np.abs(xt)
            m = np.maximum.reduce(ab, axis=1)
            amax[:] = m.tolist()
            if np.isnan(m).any():
                self._amax_obs = None
            else:  # the oldest row holding each maximum (a later equal one moves it on)
                self._amax_obs = [gone + 1 + i for i in np.argmax(ab, axis=1).tolist()]
        else:
            self._amax_obs = at
        self._scaled_to = obs
        return [m if m >= 1e-12 or m != m else 1e-12 for m in amax]  # np.maximum's

    def error_quantiles(self, qs: Iterable[float] = (0.5, 0.9)) -> list[float]:
        if not self._errors:
            return [float("nan") for _ in qs]
        e = sorted(self._errors)
        return [e[min(len(e) - 1, int(q * len(e)))] for q in qs]


class PrefillModel(_Regression):
    def __init__(
        self, base_ms: float = 5.0, per_token_ms: float = 0.05, pair_ms: float = 1e-6, **kw
    ) -> None:
        super().__init__((base_ms, per_token_ms, pair_ms), **kw)

    def _features(self, new: float, cached: float) -> tuple[float, ...]:
        return (1.0, new, new * (new + cached))

    def predict(self, new: int, cached: int) -> float:
        a, b, k = self.coef
        return a + b * new + k * new * (new + cached)

    def observe(self, new: int, cached: int, ms: float) -> None:
        self.add((new, cached), ms)

    def warm_start(self, samples: Iterable[Sequence[float]]) -> None:
        """Profile samples ``(new, cached, ms)`` measured by the node at start."""
        for new, cached, ms in samples:
            self.add((new, cached), ms, track_error=False)
        self.fit()


class DecodeModel(_Regression):
    def __init__(
        self, base_ms: float = 5.0, per_request_ms: float = 0.5, per_kv_token_ms: float = 1e-4, **kw
    ) -> None:
        super().__init__((base_ms, per_request_ms, per_kv_token_ms), **kw)

    def _features(self, batch: float, kv_tokens: float) -> tuple[float, ...]:
        return (1.0, batch, kv_tokens)

    def predict(self, batch: int, kv_tokens: int) -> float:
        a, b, k = self.coef
        return a + b * batch + k * kv_tokens

    def observe(self, batch: int, kv_tokens: int, ms: float) -> None:
        self.add((batch, kv_tokens), ms)

    def warm_start(self, samples: Iterable[Sequence[float]]) -> None:
        for batch, kv, ms in samples:
            self.add((batch, kv), ms, track_error=False)
        self.fit()


class ErrorTracker:
    """|estimated − actual| / actual over recent requests (e.g. TTFT)."""

    def __init__(self, window: int = 1024) -> None:
        self._e: deque[float] = deque(maxlen=window)

    def add(self, estimated: float, actual: float) -> None:
        if actual > 0:
            self._e.append(abs(estimated - actual) / actual)

    def quantile(self, q: float) -> float:
        if not self._e:
            return float("nan")
        s = sorted(self._e)
        return s[min(len(s) - 1, int(q * len(s)))]

    def __len__(self) -> int:
        return len(self._e)


class MeasuredRate:
    """How fast a node really serves against its fitted model, learned online from its
    completed prefills: actual / predicted time, where actual is the time the request
    held the node's compute slot (prefix fetch, compute and handoff: what the requests
    queued behind it wait for). It captures what the fitted model misses: a CPU shared
    with other processes, the handoff's tail, a node slowing down under load.

    :meth:`factor` is the median over the last ``window`` prefills of actual / predicted,
    predicted by the model as it is when asked (the model is refit as reports arrive,
    and a ratio kept against an older fit would drift), or the median of the last
    ``recent`` where that is slower: robust to one slow prefill, a slowdown shows within
    two, a recovery once it has lasted half the window (admission must keep its word).
    ``tokens_per_s`` is the same measurement as a plain rate (prompt tokens computed per
    second of slot time).

    A node's first ``warmup`` prefills are not counted: they pay one-time costs (the
    worker thread, the first connection to a decode node, allocations) that say nothing
    of its speed. Until ``least`` are counted a factor above 1 is trusted in proportion:
    ``f ** (n / least)`` for ``n`` of them. One cold or noisy prefill could otherwise make
    the node holding a prefix look several times slower than an unmeasured peer, and the
    conductor would recompute that prefix there (issue 15). A node faster than its model
    is believed at once: no warm-up cost looks fast, and estimates kept high by a shrunk
    rate would teach admission's error tail (``ErrorTail``) to discount every estimate
    by the time the rate has caught up (an overload burst then over-admits)."""

    def __init__(
        self,
        window: int = 20,
        lo: float = 0.25,
        hi: float = 20.0,
        recent: int = 3,
        warmup: int = 1,
        least: int = 4,
    ) -> None:
        if not 1 <= least <= window:
            raise ValueError(f"least ({least}) must be between 1 and the window ({window})")
        self.lo, self.hi, self.recent = lo, hi, recent
        self.warmup, self.least = warmup, least
        self.observations = 0  # the warm-up ones included
        # the last ``window`` counted prefills as a ring of rows (new tokens, cached
        # tokens, ms the model does not cover, actual ms), and beside each its ratio by
        # the fit ``_coef`` (but for the last ``_fresh``, observed since): flat ``array``s,
        # typed where compiled, so that a refit's ratios and their median are plain
        # arithmetic on doubles (no tuple, float object or sorted list per prefill)
        self._window = window
        self._rows = array("d", bytes(8 * 4 * window))
        self._ratio = array("d", bytes(8 * window))
        self._sorted = array("d", bytes(8 * window))  # scratch: the ratios in order
        # (the same memory, compiled: typed views taken once, not on every prefill)
        self._rv, self._qv, self._sv = self._rows, self._ratio, self._sorted
        self._head = 0  # the ring slot the next prefill goes to
        self._count = 0  # prefills held, up to window
        self._factor = 1.0
        self._coef: object = None  # the fit the cached factor was computed against
        self._fresh = 0

    def observe(self, new: int, cached: int, extra_ms: float, actual_ms: float) -> None:
        """A finished prefill of ``new`` tokens after ``cached`` ones that held the slot
        ``actual_ms``, of which the model does not predict ``extra_ms`` (transfers)."""
        if actual_ms > 0:
            self.observations += 1
            if self.observations <= self.warmup:
                return
            h, rows = self._head, self._rv
            rows[4 * h] = new
            rows[4 * h + 1] = cached
            rows[4 * h + 2] = extra_ms
            rows[4 * h + 3] = actual_ms
            self._head = h + 1 if h + 1 < self._window else 0
            if self._count < self._window:
                self._count += 1
            self._fresh += 1

    @property
    def _seen(self) -> list[tuple[float, float, float, float]]:
        """The prefills held, oldest first: (new, cached, extra ms, actual ms)."""
        w, n, rows = self._window, self._count, self._rows
        first = self._head - n + w
        return [
            (rows[4 * s], rows[4 * s + 1], rows[4 * s + 2], rows[4 * s + 3])
            for s in [(first + i) % w for i in range(n)]
        ]

    def factor(self, model: PrefillModel) -> float:
        """Real ms per predicted ms by ``model``'s current fit (1.0 before any counted
        prefill; above 1, shrunk toward 1 while fewer than ``least`` are counted):
        the ratios are recomputed when the fit changes, else only the new ones added."""
        coef = model.coef
        if self._fresh or self._coef is not coef:
            return self._refactor(model, coef)
        return self._factor

    def _refactor(self, model: PrefillModel, coef: list[float]) -> float:
        """``factor`` after a refit or new prefills: the ratios brought up to date. A
        ratio is ``min(hi, max(lo, ms / pred))`` for the prediction ``pred`` by ``coef``
        (as ``PrefillModel.predict``) plus the ms the model does not cover, or 1.0 where
        that is not positive; never a NaN (a NaN ``ms / pred`` is taken as ``lo``)."""
        w, count, fresh = self._window, self._count, self._fresh
        rows, ratio = self._rv, self._qv
        lo, hi = self.lo, self.hi
        full = self._coef is not coef or fresh > count
        todo = count if full else fresh
        s = self._head - todo + w  # the first slot to bring up to date
        if s >= w:
            s -= w
        three = len(coef) == 3
        a = b = k = 0.0
        if three:
            a, b, k = coef
        for _ in range(todo):
            n, c, x, ms = rows[4 * s], rows[4 * s + 1], rows[4 * s + 2], rows[4 * s + 3]
            if three:
                pred = a + b * n + k * n * (n + c) + x
            else:  # pragma: no cover - another model's features
                pred = model.predict(int(n), int(c)) + x
            if not pred > 0:
                r = 1.0
            else:
                r = ms / pred
                r = r if r > lo else lo  # max(lo, r): lo for a NaN
                r = r if r < hi else hi
            ratio[s] = r
            s = s + 1 if s + 1 < w else 0
        self._fresh = 0
        f = _median_of(ratio, count, self._sv) if count else 1.0
        few = self.recent
        if few and count >= few:  # the last few, slower of late?
            last = self._head - 1 + w
            if few == 3:  # the median of three, without a sort (a ratio is never a NaN)
                x, y, z = ratio[last % w], ratio[(last - 1) % w], ratio[(last - 2) % w]
                if x > y:
                    x, y = y, x
                m = z if z < y else y  # min(max(x, y), z)
                m = m if m > x else x  # the middle one: max(min(x, y), that)
            else:
                m = sorted([ratio[(last - i) % w] for i in range(few)])[few // 2]
            f = max(f, m)
        if f > 1.0 and count < self.least:  # too few to say slower: shrunk
            f = f ** (count / self.least)
        self._factor = f
        self._coef = coef
        return f

    @property
    def tokens_per_s(self) -> float:
        seen = self._seen
        ms = sum(s[3] for s in seen)
        return 1000.0 * sum(s[0] for s in seen) / ms if ms > 0 else float("nan")


def _median_of(ring: Any, count: int, out: Any) -> float:
    """The upper median (``sorted(...)[count // 2]``) of the first ``count`` numbers of
    ``ring``, none a NaN, sorted into ``out`` by insertion (a window of ~20: cheaper
    than any call, compiled)."""
    for i in range(count):
        v = ring[i]
        j = i
        while j > 0 and out[j - 1] > v:
            out[j] = out[j - 1]
            j -= 1
        out[j] = v
    return out[count // 2]


class ErrorTail:
    """The slow tail of the estimate's own error: the ``quantile`` of actual / estimated
    TTFT over the last ``window`` accepted requests, 1.0 until ``least`` are seen, within
    ``[lo, hi]``. Admission scales an estimate by it before comparing with the SLO, so the
    margin it keeps is the error this cluster has shown lately (a CPU shared with other
    work, a node slowing down) rather than a fixed guess. By default the worst of the last
    50: the promise is 99% inside the SLO, and of 50 ratios any lower quantile is below
    their p99 (with p98, a 2-core machine under foreign load missed it).

    By the estimate's size, three windows: every request's ratio (``value``); those of
    estimates of at least ``mid_share`` of the TTFT SLO (``mid_value``, ``value`` until
    ``least_sized`` of them are seen: the worst of a few is no tail); of at least
    ``near_share`` (``near_value``, else ``mid_value``). The ratio of a short estimate swings with a few ms of jitter (a 40 ms
    estimate that took 60 is 1.5x), that of a long one with the node's speed; an estimate
    near the SLO, the only kind a tail can push past it, is scaled by the tail of its own
    kind (``factor``). In the evaluation, estimates under 100 ms came up to 2.5-3x late,
    those over 800 ms at most 1.2x.

    A sized tail may lower the factor of its kind below the tail of all, never raise it
    above: ``mid_value`` and ``near_value`` are at most ``value``. A sized window moves
    only when an estimate of its size is accepted, and its own tail refuses those: a few
    late near-SLO ratios (one prefill that ran long, the queue behind it late) would
    otherwise scale every near-SLO estimate by them until ``window`` more near-SLO
    requests got in, which that very factor keeps out (in the paper-scale simulation it
    held at 2.8x for the last third of the trace, while every accepted request came on
    time). The tail of all moves with every accepted request, and holds any sized ratio
    among its last ``window``: so a late ratio of a size still counts as long as it is
    recent.

    By the estimate's wait, one more window: the ratios of estimates of which the wait
    (the queue ahead of the prefill) was at most ``idle_share`` (``idle_value``, once
    ``least_sized`` are seen). An estimate that waits on nothing is scaled by at most that
    tail. A queue's length is what an estimate gets wrong under load (in the evaluation,
    late ratios of 1.5-2.5x came from overloaded probes, those of estimates on idle nodes
    stayed near 1), and an overload's tail, applied to the prefills of an idle cluster
    after it, refused requests the cluster then had time for: every one of a long-prompt
    workload, 3% of the trace at half its capacity.

    "Recent" is also a matter of time: a ratio older than ``horizon_ms`` leaves every
    window (:meth:`expire`, by the caller's clock), and a window left with too few falls
    back as above, to 1.0 at last. Without it the tail could not come down once it had
    gone up: a burst of late TTFTs raised it, it refused every estimate near the SLO,
    and only an accepted request could lower it. In the evaluation's long-prompt
    workload (every estimate near the SLO) one overloaded probe left it at ~2x and the
    cluster refused 150 of 150 requests at a fifth of that rate, ten minutes later."""

    def __init__(
        self,
        window: int = 50,
        quantile: float = 1.0,
        least: int = 5,
        lo: float = 0.5,
        hi: float = 4.0,
        mid_share: float = 0.0625,
        near_share: float = 0.25,
        least_sized: int = 20,
        horizon_ms: float = 60_000.0,
        idle_share: float = 0.1,
    ) -> None:
        self.quantile, self.least, self.lo, self.hi = quantile, least, lo, hi
        self.least_sized = least_sized
        self.mid_share, self.near_share = mid_share, near_share
        self.horizon_ms = horizon_ms
        self.idle_share = idle_share
        self._idle = RollingWindow(window)
        self.idle_value = 0.0  # the idle window's tail; 0.0 while it holds too few
        # every ratio still inside the horizon, oldest first: (time, ratio, mid?, near?,
        # idle?),
        # at most what the three windows can hold; the next time one may be out of it
        self._window = window
        self._log: deque[tuple[float, float, bool, bool, bool]] = deque(maxlen=20 * window)
        self._next_expiry = math.inf
        self._ratios = RollingWindow(window)
        self._mid = RollingWindow(window)
        self._near = RollingWindow(window)
        self.value = 1.0
        self.mid_value = 1.0
        self.near_value = 1.0
        # the sized windows' own tails (each following the one below while it has too
        # few); mid_value and near_value are these, at most ``value``
        self._mid_tail = 1.0
        self._near_tail = 1.0

    def _tail(self, ratios: RollingWindow) -> float:
        r = ratios.sorted()
        last, i = len(r) - 1, int(self.quantile * len(r))
        q = r[i if i < last else last]  # r[min(last, i)]
        q = q if q > self.lo else self.lo  # max(lo, q), written out: every booking
        return q if q < self.hi else self.hi  # min(hi, q)

    def add(
        self,
        estimated: float,
        actual: float,
        limit: float = 0.0,
        size: float | None = None,
        now: float = 0.0,
        wait: float = -1.0,
    ) -> None:
        """One accepted request's estimated and actual TTFT, seen at ``now`` (ms, the
        clock :meth:`expire` is given). Its size is ``size`` (by default ``estimated``)
        against ``limit`` (0: none known, the ratio joins the first window only), and its
        estimated wait ``wait`` ms (negative: not known), as admission sized it
        (``factor``)."""
        if not (estimated > 0 and actual > 0):
            return
        ratios = self._ratios
        ratio = actual / estimated
        ratios.append(ratio)
        if len(ratios) >= self.least:
            self.value = self._tail(ratios)
        mid, near = self._mid, self._near
        sz = estimated if size is None else size
        to_mid = limit > 0 and sz >= self.mid_share * limit
        to_near = to_mid and sz >= self.near_share * limit
        idle = 0.0 <= wait <= self.idle_share * sz
        if idle:
            self._idle.append(ratio)
            if len(self._idle) >= self.least_sized:
                self.idle_value = self._tail(self._idle)
        self._log.append((now, ratio, to_mid, to_near, idle))
        if self._next_expiry == math.inf:
            self._next_expiry = now + self.horizon_ms
        if to_mid:
            mid.append(ratio)
        if to_near:
            near.append(ratio)
        # (a window's tail moves only when a ratio joins it; one with too few follows
        # the window below it)
        if len(mid) < self.least_sized:
            self._mid_tail = self.value
        elif to_mid:
            self._mid_tail = self._tail(mid)
        if len(near) < self.least_sized:
            self._near_tail = self._mid_tail
        elif to_near:
            self._near_tail = self._tail(near)
        # at most the tail of all: a sized window stale above it (its kind refused by its
        # own tail, so no ratio of it joins) does not keep refusing them
        v = self.value
        self.mid_value = self._mid_tail if self._mid_tail < v else v
        self.near_value = self._near_tail if self._near_tail < v else v

    def expire(self, now: float) -> None:
        """Drops the ratios seen before ``now - horizon_ms`` and sets the tails from the
        rest (cheap when none is due: one comparison)."""
        if now < self._next_expiry:
            return
        log, cut = self._log, now - self.horizon_ms
        while log and log[0][0] < cut:
            log.popleft()
        self._next_expiry = log[0][0] + self.horizon_ms if log else math.inf
        w = self._window
        self._ratios.refill([x[1] for x in log][-w:])
        self._mid.refill([x[1] for x in log if x[2]][-w:])
        self._near.refill([x[1] for x in log if x[3]][-w:])
        self._idle.refill([x[1] for x in log if x[4]][-w:])
        self.idle_value = self._tail(self._idle) if len(self._idle) >= self.least_sized else 0.0
        v = self._tail(self._ratios) if len(self._ratios) >= self.least else 1.0
        self.value = v
        mt = self._tail(self._mid) if len(self._mid) >= self.least_sized else v
        nt = self._tail(self._near) if len(self._near) >= self.least_sized else mt
        self._mid_tail, self._near_tail = mt, nt
        self.mid_value = mt if mt < v else v
        self.near_value = nt if nt < v else v

    def factor(self, estimate: float, limit: float, wait: float = -1.0) -> float:
        """What admission scales ``estimate`` by before comparing it with ``limit``; an
        estimate of ``wait`` ms of queue (negative: not known) at most ``idle_share`` of it
        by at most the idle window's tail."""
        if estimate >= self.near_share * limit:
            f = self.near_value
        else:
            f = self.mid_value if estimate >= self.mid_share * limit else self.value
        v = self.idle_value
        if 0.0 < v < f and 0.0 <= wait <= self.idle_share * estimate:
            return v
        return f
