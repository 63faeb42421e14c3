"""A job's quota served from the driver: a :class:`~timewheel.spark.service.DriverService`
and the executors' client.

:class:`QuotaService` keeps a :class:`~timewheel.spark.quota.bucket.LocalStore` in the driver
process and serves it (the transport, its authentication and its retries are
:mod:`timewheel.spark.service`'s). :class:`ServiceStore` is the client a task uses: a
:class:`~timewheel.spark.quota.spec.QuotaStore` whose every call is one request and one
answer. A request whose answer was lost is sent again only if applying it twice cannot
send above the quota (a take, a pause, a state, a settle that takes). Otherwise, and
when the service cannot be reached at all, the call raises
:class:`~timewheel.spark.quota.spec.QuotaStoreError` (a
:class:`~timewheel.spark.quota.failover.Failover` then falls back to the share it had).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..service import DriverService, ServiceClient
from .bucket import LocalStore
from .spec import Ask, Grant, Quota, QuotaState, QuotaStoreError

__all__ = ["QuotaService", "ServiceStore"]

#: The operations a client may ask for; answered in order, one at a time.
_OPS = frozenset({"take", "give_back", "leave", "settle", "pause", "state"})


class _Store:
    """The quota's operations, as the service answers them."""

    def __init__(self, store: LocalStore) -> None:
        self.store = store

    def answer(self, client: int, op: Any, args: Any) -> Any:
        if op not in _OPS:
            raise ValueError(f"no such operation {op!r}")
        if op == "take":  # [holder, [the Ask's fields, in order]]
            holder, ask = args
            args = [holder, Ask(*ask)]
        result = getattr(self.store, op)(*args)
        # A grant or a state as its fields' values, in order (the client's own classes
        # name them): dataclasses.asdict's deep copy took a tenth of the service's time a
        # take, and a JSON object's keys a twentieth.
        return list(vars(result).values()) if isinstance(result, (Grant, QuotaState)) else result

    def dropped(self, client: int) -> None:
        pass  # a holder not heard from is dropped after the quota's ttl_s


class QuotaService(DriverService):
    """A job's quota, served from this process on ``host`` (port 0: any free one).

    ``address`` is where the executors connect, ``secret`` what they sign with: hand
    them to the executors apart from the plan (``repr`` shows neither the secret nor
    its length). ``store`` is the quota's state in this process.
    """

    def __init__(
        self,
        quota: Quota,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        clock: Callable[[], float] = time.monotonic,
        tasks: int = 0,
    ) -> None:
        self.store = LocalStore(quota, clock)
        self.quota = quota
        super().__init__(_Store(self.store), "quota service", host, port, tasks)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "serving"
        return f"QuotaService({self.quota!r}, {self.address[0]}:{self.address[1]}, {state})"

    def client(self, timeout_s: float = 5.0) -> ServiceStore:
        """A client of this service (what an executor makes from the address and secret)."""
        return ServiceStore(self.address, self.secret, self.quota, timeout_s=timeout_s)

    def __enter__(self) -> QuotaService:
        return self


class ServiceStore(ServiceClient):
    """The client of a :class:`QuotaService`: a :class:`~timewheel.spark.quota.spec.QuotaStore`.

    Thread-safe (one request at a time on one connection); no thread of its own.
    """

    error = QuotaStoreError
    name = "the quota service"

    def __init__(
        self, address: tuple[str, int], secret: bytes, quota: Quota, *, timeout_s: float = 5.0
    ) -> None:
        if not isinstance(quota, Quota):
            raise TypeError(f"quota must be a Quota, got {quota!r}")
        super().__init__(address, secret, timeout_s=timeout_s)
        self.quota = quota

    def __repr__(self) -> str:
        return f"ServiceStore({self.address[0]}:{self.address[1]})"

    def safe_twice(self, op: str, args: list[Any]) -> bool:
        """Requests that may be applied twice without sending above the quota."""
        if op == "settle":
            return bool(args[1] >= 0)
        return op in ("take", "pause", "state")

    def _call(self, op: str, *args: Any) -> Any:
        return self.call(op, *args)

    # -- the store -----------------------------------------------------------------------
    def take(self, holder: str, ask: Ask) -> Grant:
        return Grant(*self._call("take", holder, ask))

    def give_back(
        self, holder: str, requests: int = 0, cost: float = 0.0, slots: int = 0, owed: float = 0.0
    ) -> None:
        self._call("give_back", holder, requests, cost, slots, owed)

    def leave(self, holder: str, owed: float = 0.0, requests: int = 0, cost: float = 0.0) -> None:
        self._call("leave", holder, owed, requests, cost)

    def settle(self, holder: str, owed: float, ratio: float = 0.0) -> None:
        self._call("settle", holder, owed, ratio)

    def pause(self, seconds: float, asked: float = 0.0, header: str = "") -> None:
        self._call("pause", seconds, asked, header)

    def state(self) -> QuotaState:
        return QuotaState(*self._call("state"))
