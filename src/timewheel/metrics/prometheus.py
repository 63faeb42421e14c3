"""timewheel's metrics as a ``prometheus_client`` collector.

Needs ``pip install 'timewheel-purgatory[prometheus]'``.

Register it once, on prometheus_client's default ``REGISTRY`` or your own::

    from timewheel.metrics.prometheus import register_collector
    collector = register_collector()

Every metric of :data:`timewheel.metrics.METRICS`, named ``timewheel_<kind>_<field>``, in
base units (seconds), counters ending ``_total``, with a ``name`` label per object. Each
scrape takes one snapshot of every live object; nothing is read between scrapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

try:
    from prometheus_client.core import (
        REGISTRY,
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError(
        f"{__name__} needs prometheus_client: pip install 'timewheel-purgatory[prometheus]' ({exc})"
    ) from exc

from . import METRICS, Histogram, samples
from . import Metric as MetricRow

__all__ = ["TimewheelCollector", "register_collector"]


def _bound(value: float) -> str:
    return repr(float(value))


def _family(row: MetricRow) -> Any:
    """The empty metric family of one row of the table."""
    unit = "seconds" if row.unit == "seconds" else ""
    if row.type == "histogram":
        return HistogramMetricFamily(row.prometheus_name, row.help, labels=["name"], unit=unit)
    kind = CounterMetricFamily if row.type == "counter" else GaugeMetricFamily
    return kind(row.prometheus_name, row.help, labels=["name"], unit=unit)


class TimewheelCollector(Collector):
    """Yields every timewheel metric of every live object at each scrape."""

    def collect(self) -> Iterator[Metric]:
        """One metric family per row of the table, one sample set per live object."""
        for row, values in samples():
            family = _family(row)
            if row.type == "histogram":
                for name, hist in values:
                    assert isinstance(hist, Histogram)
                    buckets = [
                        (_bound(bound), count) for bound, count in zip(hist.bounds, hist.cumulative)
                    ]
                    buckets.append(("+Inf", hist.count))
                    family.add_metric([name], buckets, hist.sum)
            else:
                for name, value in values:
                    family.add_metric([name], value)
            yield family

    def describe(self) -> Iterator[Metric]:
        """Every family, without samples: the registry refuses a second collector that
        would yield the same series."""
        return (_family(row) for row in METRICS)


def register_collector(registry: CollectorRegistry = REGISTRY) -> TimewheelCollector:
    """Register a new :class:`TimewheelCollector` on ``registry`` and return it.

    A registry takes one: a second call on it raises ValueError (every series would be
    doubled). Unregister it with ``registry.unregister(collector)``.
    """
    collector = TimewheelCollector()
    try:
        registry.register(collector)
    except ValueError as exc:
        raise ValueError(
            "registry already has timewheel's series: register_collector() was called on it "
            "before (unregister that collector first)"
        ) from exc
    return collector
