"""`GET /metrics` of `tuneforge serve`: counters, gauges and histograms in the Prometheus text format (0.0.4).

A `Metrics` object is filled by the app's request middleware (requests, errors, latency per route) and
by the batchers (batch sizes); the queue depth, running rows and tokens per second are read from the
engine when the page is scraped (`gauges`, a callable the app gives). No client library: the text
format is a few lines.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in labels.values())
    return "{" + ",".join(f'{k}="{v}"' for k, v in zip(labels, escaped)) + "}"


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bucket (+Inf only)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        out, running = [], 0
        for bound, count in zip(self.buckets, self.counts):
            running += count
            out.append(f"{name}_bucket{_labels({**labels, 'le': f'{bound:g}'})} {running}")
        out.append(f"{name}_bucket{_labels({**labels, 'le': '+Inf'})} {self.n}")
        out.append(f"{name}_sum{_labels(labels)} {self.total:.6f}")
        out.append(f"{name}_count{_labels(labels)} {self.n}")
        return out


class Metrics:
    """What the server counts; `render()` is the /metrics page."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (route, status) -> count
        self.errors: dict[str, int] = {}  # route -> responses with status >= 400
        self.latency: dict[str, Histogram] = {}
        self.batch_sizes = Histogram(BATCH_BUCKETS)
        self.gauges: Callable[[], dict[str, tuple[str, float]]] = dict  # name -> (help, value), read when scraped

    def observe_request(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            key = (route, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1
            if status >= 400:
                self.errors[route] = self.errors.get(route, 0) + 1
            self.latency.setdefault(route, Histogram(LATENCY_BUCKETS)).observe(seconds)

    def observe_batch(self, rows: int) -> None:
        with self._lock:
            self.batch_sizes.observe(rows)

    def render(self) -> str:
        with self._lock:
            lines = [
                "# HELP tuneforge_requests_total HTTP requests answered, by route and status.",
                "# TYPE tuneforge_requests_total counter",
            ]
            for (route, status), n in sorted(self.requests.items()):
                lines.append(f"tuneforge_requests_total{_labels({'route': route, 'status': status})} {n}")
            lines += [
                "# HELP tuneforge_request_errors_total HTTP requests answered with a status of 400 or more.",
                "# TYPE tuneforge_request_errors_total counter",
            ]
            for route, n in sorted(self.errors.items()):
                lines.append(f"tuneforge_request_errors_total{_labels({'route': route})} {n}")
            lines += [
                "# HELP tuneforge_request_duration_seconds Time from a request's arrival to the end of its response.",
                "# TYPE tuneforge_request_duration_seconds histogram",
            ]
            for route, hist in sorted(self.latency.items()):
                lines += hist.lines("tuneforge_request_duration_seconds", {"route": route})
            lines += [
                "# HELP tuneforge_batch_size Rows in each forward pass (classifier batches, generation steps).",
                "# TYPE tuneforge_batch_size histogram",
                *self.batch_sizes.lines("tuneforge_batch_size", {}),
            ]
        for name, (help_text, value) in self.gauges().items():
            kind = "counter" if name.endswith("_total") else "gauge"
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"]
        return "\n".join(lines) + "\n"
