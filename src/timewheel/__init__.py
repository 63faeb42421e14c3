"""timewheel: hierarchical timing wheels and a Kafka-style request purgatory for Python.

Layers, lowest first: :class:`TimingWheel` (the core, Cython with a pure-Python twin).
"""

from ._version import __version__
from .sources import Fair, PreferThenFair, QueueingSource, Scheduler, SetQueue
from .wheel import IMPLEMENTATION, TimingWheel

__all__ = [
    "IMPLEMENTATION",
    "Fair",
    "PreferThenFair",
    "QueueingSource",
    "Scheduler",
    "SetQueue",
    "TimingWheel",
    "__version__",
]
