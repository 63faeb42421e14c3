"""Hierarchical timing wheels for Python, and the layers a service builds on them.

Kafka's timing wheel cancels in O(1), schedules in O(levels) and only wakes for buckets that
hold something. Around it:

* :class:`TimingWheel` -- the core: ``schedule(deadline, item)``, ``cancel(handle)``,
  ``advance(now)`` and ``next_deadline()``, plus NumPy batch calls. Time is an integer
  in a unit the caller picks; the wheel has no clock of its own. It is the Cython
  extension when built (:data:`IMPLEMENTATION` says which), else a pure-Python twin
  with the same API; ``TIMEWHEEL_NO_EXTENSIONS=1`` forces the twin.
* Timer (:mod:`timewheel.timer`) -- :class:`Timer` owns a clock (monotonic, or a
  :class:`ManualClock` for event time) and runs expired :class:`TimerTask` callbacks,
  from a reaper thread or from your own loop.
* Purgatory (:mod:`timewheel.purgatory`) -- Kafka's :class:`DelayedOperation` and
  :class:`Purgatory`: operations wait on keys until they complete or time out; watcher
  lists hold weak references, so a completed operation is freed at once.
* Resources (:mod:`timewheel.resources`) -- :class:`ResourceManager` checks out several
  keys all-or-nothing, with no global lock; requests that must wait park in a purgatory
  and each missing key is loaded once.
* Execution (:mod:`timewheel.execution`) -- :class:`ThreadPool`, :class:`TaskQueue` and
  Jetty's strategies :class:`ProduceConsume`, :class:`ProduceExecuteConsume` and
  :class:`ExecuteProduceConsume` for running produced tasks.
* Sources (:mod:`timewheel.sources`) -- the de-duplicating :class:`SetQueue`,
  :class:`QueueingSource` (refills a slow source in the background) and a
  :class:`Scheduler` with :class:`Fair` / :class:`PreferThenFair` strategies and back
  pressure.

Every class is safe to use from several threads, and bad arguments raise ValueError or
TypeError naming the argument. Quick start::

    >>> from timewheel import TimingWheel
    >>> wheel = TimingWheel(tick=1, wheel_size=20)
    >>> handle = wheel.schedule(30, "reply timed out")
    >>> wheel.advance(29), wheel.advance(30)
    ([], ['reply timed out'])
"""

import logging

from ._impl import IMPLEMENTATION, TimingWheel

# Either core whole, for tests and benchmarks (docs/architecture.md): importable, not in
# __all__, which lists what an application uses.
from ._implementation import Implementation as Implementation
from ._implementation import implementation as implementation
from ._version import __version__
from .execution import (
    ExecuteProduceConsume,
    ExecutionStats,
    ExecutionStrategy,
    Executor,
    PoolShutDown,
    ProduceConsume,
    ProduceExecuteConsume,
    Producer,
    TaskQueue,
    ThreadPool,
)
from .purgatory import DelayedOperation, Purgatory
from .resources import Checkout, ResourceManager
from .sources import (
    Fair,
    PreferThenFair,
    QueueingSource,
    Scheduler,
    SchedulingStrategy,
    SetQueue,
    Sink,
    Source,
)
from .timer import ManualClock, Timer, TimerFullError, TimerTask

# The library convention: silent unless the application configures logging. Every module
# logs on its own logger under this one (timewheel.timer, timewheel.purgatory, ...).
logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "IMPLEMENTATION",
    "Checkout",
    "DelayedOperation",
    "ExecuteProduceConsume",
    "ExecutionStats",
    "ExecutionStrategy",
    "Executor",
    "Fair",
    "ManualClock",
    "PoolShutDown",
    "PreferThenFair",
    "ProduceConsume",
    "ProduceExecuteConsume",
    "Producer",
    "Purgatory",
    "QueueingSource",
    "ResourceManager",
    "Scheduler",
    "SchedulingStrategy",
    "SetQueue",
    "Sink",
    "Source",
    "TaskQueue",
    "ThreadPool",
    "Timer",
    "TimerFullError",
    "TimerTask",
    "TimingWheel",
    "__version__",
]
