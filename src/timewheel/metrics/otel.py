"""timewheel's metrics as OpenTelemetry observable instruments
(``pip install timewheel-purgatory[opentelemetry]``).

Call :func:`instrument` once, after the application has set its meter provider (or pass
one)::

    from timewheel.metrics.otel import instrument
    instrument()

Every metric of :data:`timewheel.metrics.METRICS` becomes an observable instrument named
``timewheel.<kind>.<field>`` (unit in ``unit``: ``s`` or a count such as
``{operations}``), with a ``name`` attribute per object: counters are
``ObservableCounter``, gauges ``ObservableGauge``. The OpenTelemetry API has no
asynchronous histogram, so a histogram such as the timers' lateness becomes two
observable counters: ``timewheel.timer.lateness`` (the sum, in s) and
``timewheel.timer.lateness.bucket`` (cumulative counts with an ``le`` attribute, the
upper bound in seconds or ``+Inf``; the ``+Inf`` one is the count), the same numbers
the Prometheus collector exports. Callbacks read the objects only when the SDK
collects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Callable

try:
    from opentelemetry.metrics import (
        CallbackOptions,
        Instrument,
        Meter,
        MeterProvider,
        Observation,
        get_meter,
    )
except ImportError as exc:  # pragma: no cover - only without the extra
    raise ImportError(
        f"{__name__} needs opentelemetry: pip install 'timewheel-purgatory[opentelemetry]' ({exc})"
    ) from exc

from .._version import __version__
from . import METRICS, Histogram, Metric, values

__all__ = ["instrument"]

Callback = Callable[[CallbackOptions], Iterable[Observation]]


def _observe(metric: Metric) -> Callback:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(value, {"name": name}) for name, value in values(metric)]

    return callback


def _observe_sum(metric: Metric) -> Callback:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(hist.sum, {"name": name}) for name, hist in values(metric)]

    return callback


def _observe_buckets(metric: Metric) -> Callback:
    def callback(options: CallbackOptions) -> Iterable[Observation]:
        observed = []
        for name, hist in values(metric):
            assert isinstance(hist, Histogram)
            bounds = [repr(float(bound)) for bound in hist.bounds] + ["+Inf"]
            for le, count in zip(bounds, hist.cumulative):
                observed.append(Observation(count, {"name": name, "le": le}))
        return observed

    return callback


def instrument(meter_provider: MeterProvider | None = None) -> list[Instrument]:
    """Create timewheel's observable instruments on a ``timewheel`` meter; return them.

    ``meter_provider`` defaults to the global one. Call once per provider: the
    instruments observe every timewheel object alive at each collection.
    """
    meter: Meter = get_meter("timewheel", __version__, meter_provider)
    made: list[Instrument] = []
    for metric in METRICS:
        create: Any
        if metric.type == "histogram":
            made.append(
                meter.create_observable_counter(
                    metric.otel_name,
                    [_observe_sum(metric)],
                    metric.otel_unit,
                    f"{metric.help} (the sum)",
                )
            )
            made.append(
                meter.create_observable_counter(
                    f"{metric.otel_name}.bucket",
                    [_observe_buckets(metric)],
                    "{tasks}",
                    f"{metric.help} (cumulative counts by upper bound le)",
                )
            )
            continue
        if metric.type == "counter":
            create = meter.create_observable_counter
        else:
            create = meter.create_observable_gauge
        made.append(create(metric.otel_name, [_observe(metric)], metric.otel_unit, metric.help))
    return made
