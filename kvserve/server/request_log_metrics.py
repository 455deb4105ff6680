"""`kvserve:request_log_*` counters: lines the request log dropped (queue full) and its failed writes, so an
operator sees a lossy log on a dashboard, not only in the server's own log."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.server.metrics import LABELS
from kvserve.server.request_log import RequestLog


class RequestLogCollector(Collector):
    def __init__(self, current_log: Callable[[], RequestLog | None], model_name: str) -> None:
        self.current_log = current_log  # the log opens with the app's lifespan, after the registry is built
        self.labels = [model_name, "0"]

    def collect(self) -> Iterator[Metric]:
        request_log = self.current_log()
        if request_log is None:
            return
        yield self._counter("kvserve:request_log_dropped_lines", "Request-log lines dropped because the writer was "
                            "behind (its queue full).", request_log.num_dropped)
        yield self._counter("kvserve:request_log_write_errors", "Failed request-log writes; each loses the lines "
                            "buffered at the time.", request_log.num_write_errors)

    def _counter(self, name: str, doc: str, value: int) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family
