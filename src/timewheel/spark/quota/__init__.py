"""One quota for a whole job: requests, cost, calls in flight and a budget.

:mod:`.spec` (the :class:`~timewheel.spark.quota.spec.Quota` a user makes, the store
protocol), :mod:`.bucket` (the token buckets, kept in the process or failed over),
:mod:`.task` (a task's share), :mod:`.gate` (what a partition asks before each call),
:mod:`.placement` (where a job's quota is kept) and the shared stores, :mod:`.redis_store` and
:mod:`.service_store`. The service's own rate-limit headers are read by
:mod:`timewheel.spark.ratelimit`, on the wing's ground floor (``http/`` reads them too).
Users import :class:`Quota` from :mod:`timewheel.spark`."""
