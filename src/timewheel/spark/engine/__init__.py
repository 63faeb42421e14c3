"""The per-partition machinery: :mod:`.contract` (what an engine is), :mod:`.partition`
(the engine the wing ships, on the package's timer, purgatory and resource manager),
:mod:`.batcher` (many rows per request), :mod:`.admission` (how fast a task may send)
and :mod:`.attempt` (one call in flight). The only room that uses both
:mod:`timewheel.spark.quota` and :mod:`timewheel.spark.batch`."""
