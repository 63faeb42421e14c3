"""The dispatch engines by name: what ``timewheel pipeline --engine`` and ``timewheel bench
pipeline`` run (``dispatch`` takes the engine itself: ``engine=get_engine(name)``).

The product's one engine, ``timewheel`` (:mod:`timewheel.spark.engine.partition`), and
the benchmark's baselines (:mod:`.baseline_engines`). Adding an engine is one line in
``_ENGINES``; an engine imports :mod:`timewheel.spark.engine.contract` (the contract), never this.
"""

from __future__ import annotations

from ...spark.engine.contract import Engine
from ...spark.engine.partition import timewheel_engine
from .baseline_engines import asyncio_engine, threads_engine

__all__ = ["DEFAULT_ENGINE", "engine_names", "get_engine"]

_ENGINES: dict[str, Engine] = {
    "timewheel": timewheel_engine,
    "threads": threads_engine,
    "asyncio": asyncio_engine,
}

#: The engine ``dispatch`` uses unless told otherwise.
DEFAULT_ENGINE = "timewheel"


def engine_names() -> tuple[str, ...]:
    """Names :func:`get_engine` accepts."""
    return tuple(_ENGINES)


def get_engine(name: str) -> Engine:
    """The engine registered as ``name``."""
    engine = _ENGINES.get(name) if isinstance(name, str) else None
    if engine is None:
        raise ValueError(f"engine must be one of {', '.join(_ENGINES)}, got {name!r}")
    return engine
