"""A job's quota, from the driver to its tasks: where it lives and how a task reaches it.

:func:`place_quota` runs in the driver when ``dispatch`` is given a quota. It returns a
:class:`QuotaRef`, which travels in the job's plan and holds no secret:

* **the driver's service** (the default): a
  :class:`~timewheel.spark.quota.service_store.QuotaService` in this process, one per
  :class:`~timewheel.spark.quota.spec.Quota` object (so a quota given to several jobs, or to
  a streaming query, is one quota for all of them). It serves until :func:`close_quota`
  or the driver's exit: a ``dispatch`` result is lazy, and its tasks may run long after
  the caller let go of the Quota object (one idle thread each meanwhile). Its address
  is the driver's (``spark.driver.host``; loopback on ``local[...]``).
  Its secret goes to the executors the way Spark hands a job's own settings to its
  tasks: a local property of the thread that runs the job (``sc.setLocalProperty``), which
  Spark sends with each task and leaves out of the plan; its key holds ``secret``, so
  Spark's ``spark.redaction.regex`` hides its value in the event log and the UI.
* **Redis** (``Quota(store="redis://...", name=...)``): the URL (never with a password),
  the name, and the job its budget and request cap are counted for (:func:`job_of`: one
  per Quota object in this driver, as the driver's service); the password, if any, is a
  secret reference read where it is used.
* **the static split**, where neither can serve (Spark Connect without a ``store``: its
  client is not the driver and sets no local property), or when asked
  (``store="static"``). Each task then holds its
  ``fraction`` of the quota, as ``rate`` did before quotas; one log line says so.

On the executor, :meth:`QuotaRef.open` gives the store a task draws on: one per Python
worker and quota, wrapped in a :class:`~timewheel.spark.quota.failover.Failover`: if the store
cannot be reached, it says so once and falls back to the rates it was granted while the
store was up (see :class:`~timewheel.spark.quota.failover.Failover`), so the workers of every
job sharing the quota together stay within it, and to ``fraction`` of the budget and
requests the store had left (they are the job's own). A worker granted nothing before
the store failed waits for Redis (every job naming the quota may be sending); for the
driver's service, which only this job draws on, it takes ``fraction`` of the quota.
"""

from __future__ import annotations

import logging
import secrets
import threading
from dataclasses import dataclass
from typing import Any

from ..runtime import worker_runtime
from ..service import driver_host
from .bucket import LocalStore
from .failover import Failover
from .spec import Quota, QuotaStore

__all__ = [
    "QuotaRef",
    "close_quota",
    "driver_store",
    "job_of",
    "place_quota",
    "redis_store_of",
]

logger = logging.getLogger(__name__)

#: The local property that carries a service's secret to its tasks (``secret`` in its
#: name: Spark's default redaction pattern hides it).
SECRET_PROPERTY = "timewheel.quota.secret."

# id(Quota) -> the Quota (kept, so its id stays its own), its service in this driver, the
# key its secret's property is named by, and the address the executors reach it at.
_SERVICES: dict[int, tuple[Quota, Any, str, tuple[str, int]]] = {}
# id(Quota) -> the Quota (kept, so its id stays its own) and its job in a Redis store.
_JOBS: dict[int, tuple[Quota, str]] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class QuotaRef:
    """What a task needs to draw on its job's quota: picklable, without its secret."""

    quota: Quota
    #: ``"service"``, ``"redis"`` or ``"static"``.
    kind: str
    #: This process's share (1 / task slots) of the budget and requests left if the
    #: store cannot be reached (for the driver's service, of the whole quota too).
    fraction: float
    #: The driver's service: its address and the id its secret's property is named by.
    address: tuple[str, int] | None = None
    key: str = ""
    #: Redis: the job the budget and request cap are counted for.
    job: str = ""

    def open(self) -> QuotaStore:
        """The store a task of this worker draws on (one per worker and quota)."""
        return worker_runtime().shared(f"timewheel-quota:{self.key}", self, self._make)

    def _make(self) -> QuotaStore:
        if self.kind == "static":
            share = self.quota.share(self.fraction)
            return LocalStore(share if share is not None else self.quota, exhausted=share is None)
        if self.kind == "redis":
            try:
                primary: QuotaStore = redis_store_of(self.quota, self.job or None)
            except Exception as exc:  # no redis client: say so, then the fallback
                primary = _Unreachable(self.quota, f"{type(exc).__name__}: {exc}")
            return Failover(primary, self.fraction)
        from pyspark import TaskContext

        from .service_store import ServiceStore

        context = TaskContext.get()
        secret = None if context is None else context.getLocalProperty(SECRET_PROPERTY + self.key)
        if secret is None or self.address is None:
            primary = _Unreachable(
                self.quota,
                "the job's quota secret did not reach this task (run the job's "
                "action on the thread that called dispatch)",
            )
        else:
            primary = ServiceStore(self.address, bytes.fromhex(secret), self.quota)
        # Only this driver's tasks draw on its service: the static split is safe.
        return Failover(primary, self.fraction, alone=True)


def job_of(quota: Quota) -> str:
    """The job ``quota``'s budget and request cap are counted for in Redis: one random
    id per Quota object in this driver, kept for as long as the driver (or until
    :func:`close_quota`), so every job given the object counts against one budget."""
    with _LOCK:
        held = _JOBS.get(id(quota))
        if held is None:
            held = _JOBS[id(quota)] = (quota, secrets.token_hex(8))
    return held[1]


def redis_store_of(quota: Quota, job: str | None = None) -> QuotaStore:
    """The :class:`~timewheel.spark.quota.redis_store.RedisStore` that ``quota`` names,
    counting for ``job`` (default: :func:`job_of` ``quota``), its password (if any) read
    here, where it is used."""
    from .redis_store import RedisStore

    assert quota.store is not None and quota.name is not None
    job = job_of(quota) if job is None else job
    return RedisStore(quota.store, quota.name, quota, password=_password(quota), job=job)


def _password(quota: Quota) -> str | None:
    """Redis's password for ``quota``, read here, where it is used (None: none)."""
    if quota.store_password is None:
        return None
    from ..secrets import Secret

    return Secret(quota.store_password).resolve()[0]


def check_store(quota: Quota) -> None:
    """QuotaStoreError unless the Redis ``quota`` names (if any) answers: asked from the
    driver before a job, since its tasks would otherwise wait for a store that is not
    there (a mistyped URL)."""
    if quota.store in (None, "static"):
        return
    from .redis_store import check_reachable

    check_reachable(quota.store, password=_password(quota))


class _Unreachable:
    """A store that cannot be reached: every call raises, so a Failover falls back."""

    def __init__(self, quota: Quota, why: str) -> None:
        self.quota = quota
        self.why = why

    def __repr__(self) -> str:
        return "the job's quota store"

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        from .spec import QuotaStoreError

        raise QuotaStoreError(self.why)

    take = give_back = leave = settle = pause = state = _fail

    def close(self) -> None:
        pass


def place_quota(quota: Quota, spark: Any, slots: int, connect: bool) -> QuotaRef:
    """Where ``quota`` lives for a job of ``slots`` concurrent tasks on ``spark``."""
    if not isinstance(quota, Quota):
        raise TypeError(f"quota must be a timewheel.spark.Quota, got {quota!r}")
    fraction = 1.0 / max(1, slots)
    if quota.store == "static":
        return QuotaRef(quota, "static", fraction, key=f"static:{id(quota)}")
    if quota.store is not None:
        job = job_of(quota)
        return QuotaRef(quota, "redis", fraction, key=f"redis:{quota.name}:{job}", job=job)
    if connect:
        logger.warning(
            "Spark Connect: the quota has no store its executors can reach "
            "(Quota(store='redis://...', name=...)); each of the %d tasks keeps a static "
            "share of it",
            slots,
        )
        return QuotaRef(quota, "static", fraction, key=f"static:{id(quota)}")
    from .service_store import QuotaService

    sc = spark.sparkContext
    with _LOCK:
        _, service, key, address = _SERVICES.get(id(quota), (quota, None, "", ("", 0)))
        if service is None or service.closed:
            bind, host = driver_host(spark)
            service, key = QuotaService(quota, bind, tasks=slots), secrets.token_hex(8)
            address = (host, service.address[1])
            _SERVICES[id(quota)] = (quota, service, key, address)
    sc.setLocalProperty(SECRET_PROPERTY + key, service.secret.hex())
    return QuotaRef(quota, "service", fraction, address, key)


def driver_store(quota: Quota) -> QuotaStore | None:
    """The store of ``quota``'s service in this driver (None if it has none): what the
    pipeline reads the job's use from."""
    held = _SERVICES.get(id(quota))
    return None if held is None else held[1].store


def close_quota(quota: Quota) -> None:
    """Stop ``quota``'s service in this driver, if it has one (its jobs must be over:
    a task that asks it later falls back), and forget its job in Redis (a later job
    given the object counts its budget from zero)."""
    with _LOCK:
        held = _SERVICES.pop(id(quota), None)
        _JOBS.pop(id(quota), None)
    if held is not None:
        held[1].close()
