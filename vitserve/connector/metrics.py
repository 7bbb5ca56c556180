"""The connector's counters in vLLM's own /metrics and periodic log (counters.py has the names and the data).

Imported lazily by glue.py's classmethods: it loads vLLM's EC metrics module and prometheus_client, which
vLLM's API server has loaded anyway and the connector's import need not add
(tests/integration/test_vllm_connector_imports.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics, ECConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from vitserve.connector import counters


@dataclass
class VitserveECConnectorStats(ECConnectorStats):  # type: ignore[misc]  # vLLM is not in vitserve's venv
    """One or more reports of counters.delta, merged."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        self.data = counters.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(counters.flat(self.data))

    def is_empty(self) -> bool:
        return not self.data.get("counts") and not self.data.get("gauges")


class VitservePromMetrics(ECConnectorPromMetrics):  # type: ignore[misc]
    """vllm:vitserve_connector_* in vLLM's registry, labelled by model and engine as vLLM's own metrics are."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._per_engine(self._counter_cls, name, doc, labelnames)
            for name, doc in counters.COUNTERS.items()
        }
        self._gauges = {
            name: self._per_engine(self._gauge_cls, name, doc, labelnames)
            for name, doc in counters.GAUGES.items()
        }
        self._labelled = {
            metric_name: self._counter_cls(
                name=counters.PREFIX + metric_name, documentation=doc, labelnames=[*labelnames, "reason"]
            )
            for metric_name, doc in counters.LABELLED.values()
        }

    def _per_engine(self, cls: type, name: str, doc: str, labelnames: list[str]) -> dict[int, Any]:
        kwargs = {"multiprocess_mode": "mostrecent"} if cls is self._gauge_cls else {}
        metric = cls(name=counters.PREFIX + name, documentation=doc, labelnames=labelnames, **kwargs)
        per_engine: dict[int, Any] = create_metric_per_engine(metric, self.per_engine_labelvalues)
        return per_engine

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.get("counts", {}).items():
            metric_name, reason = counters.metric(name)
            if reason is not None and metric_name in self._labelled:
                labels = [*self.per_engine_labelvalues[engine_idx], reason]
                self._labelled[metric_name].labels(*labels).inc(value)
            elif metric_name in self._counters:
                self._counters[metric_name][engine_idx].inc(value)
        for name, value in transfer_stats_data.get("gauges", {}).items():
            if name in self._gauges:
                self._gauges[name][engine_idx].set(value)
