"""What a store fetch really costs a prefill node, learned from the fetches it reports.

The fetch-versus-recompute decision (``policy.Scheduler``) weighs the time to pull a run
of blocks from the cluster store against the prefill time it saves. That time is the
store's remote path (a prefix lookup at the store master, then one read per holder
over the transfer engine, landing in the node's pool), not the transfer engine's raw
bandwidth between two nodes: the store path adds its control round trips and its
per-block work, and its bytes come from a store node, not from the peer the engine's
bandwidth was measured against.

Each prefill node reports every fetch it made (bytes, ms from lookup to the last byte in
its pool) in its WatchEvents load report; :class:`StoreFetchModel` fits
``ms = fixed + bytes / bandwidth`` over a window of them (least squares, both terms
non-negative). Until it has seen a fetch it falls back to the engine's bandwidth it is
given (the only figure there is), and with fetches of one size only it keeps a plain
throughput (bytes over ms of those fetches).
"""

from __future__ import annotations

from collections import deque


class StoreFetchModel:
    """``ms = fixed_ms + bytes / bytes_per_ms``, fitted over the last ``window`` fetches."""

    def __init__(self, window: int = 64) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.fixed_ms = 0.0
        self.bytes_per_ms = 0.0  # 0: nothing measured yet
        self.observations = 0

    def observe(self, nbytes: float, ms: float) -> None:
        if not (nbytes > 0 and ms > 0):
            return
        self._samples.append((float(nbytes), float(ms)))
        self.observations += 1
        self._fit()

    def _fit(self) -> None:
        xs = [b for b, _ in self._samples]
        ys = [m for _, m in self._samples]
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        if sxx > 0:
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
            fixed = my - slope * mx
            if slope > 0 and fixed >= 0:
                self.fixed_ms, self.bytes_per_ms = fixed, 1.0 / slope
                return
            if slope > 0:  # a negative intercept: a line through the origin instead
                slope = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
                self.fixed_ms, self.bytes_per_ms = 0.0, 1.0 / slope
                return
        # one size only, or a slope the noise made non-positive: the plain throughput
        self.fixed_ms, self.bytes_per_ms = 0.0, sum(xs) / sum(ys)

    def predict_ms(self, nbytes: float, fallback_bytes_per_ms: float) -> float:
        """Predicted ms to fetch ``nbytes``; ``fallback_bytes_per_ms`` (the engine's
        measured bandwidth) until a fetch has been observed."""
        if self.bytes_per_ms <= 0:
            return nbytes / fallback_bytes_per_ms
        return self.fixed_ms + nbytes / self.bytes_per_ms
