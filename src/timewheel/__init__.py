"""timewheel: hierarchical timing wheels and a Kafka-style request purgatory for Python.

Layers, lowest first: :class:`TimingWheel` (the core, Cython with a pure-Python twin).
"""

from ._version import __version__
from .execution import (
    ExecuteProduceConsume,
    ExecutionStats,
    PoolShutDown,
    ProduceConsume,
    ProduceExecuteConsume,
    Producer,
    TaskQueue,
    ThreadPool,
)
from .sources import Fair, PreferThenFair, QueueingSource, Scheduler, SetQueue
from .wheel import IMPLEMENTATION, TimingWheel

__all__ = [
    "IMPLEMENTATION",
    "ExecuteProduceConsume",
    "ExecutionStats",
    "Fair",
    "PoolShutDown",
    "PreferThenFair",
    "ProduceConsume",
    "ProduceExecuteConsume",
    "Producer",
    "QueueingSource",
    "Scheduler",
    "SetQueue",
    "TaskQueue",
    "ThreadPool",
    "TimingWheel",
    "__version__",
]
