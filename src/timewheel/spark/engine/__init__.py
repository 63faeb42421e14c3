"""The per-partition machinery: :mod:`.contract` (what an engine is and receives),
:mod:`.partition` (the engine the wing ships, on the package's timer, purgatory and
resource manager), :mod:`.batcher` (many rows per request), :mod:`.admission` (how many
calls a task keeps out) and :mod:`.attempt` (one call in flight). The only room that
imports :mod:`timewheel.spark.quota`; it and :mod:`timewheel.spark.http` (for batch
bodies) import :mod:`timewheel.spark.batch`."""
