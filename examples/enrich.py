"""Enrich a DataFrame of orders from a customer service, under a rate limit.

Runs as it stands (``python examples/enrich.py``): it starts a small customer service
(aiohttp, on 127.0.0.1, answering per customer id) and a local Spark, then sends each
order's customer to the service with :func:`timewheel.spark.dispatch`:

* ``GET /customers/{customer_id}``: a URL template filled from each row;
* ``reply_schema=``: the service's JSON answer parsed into a struct column ``reply``, so
  the customer's name and tier become columns of the order;
* ``quota=Quota(rate=RATE)``: the whole job stays under RATE requests a second, however
  many tasks;
* ``dedupe=Dedupe("customer_id")``: orders of the same customer share one request;
* every order comes back once with how its lookup ended (``status``, ``http_status``,
  ``attempts``, ``latency_ms``, ``error``); unknown customers are ``failed`` with the
  service's 404.
"""

from __future__ import annotations

import asyncio
import bisect
import sys
import threading
import time
from typing import Any

from aiohttp import web
from pyspark.sql import functions as F

from timewheel.spark import Calls, Dedupe, Quota, dispatch
from timewheel.spark.session import spark_session
from timewheel.spark.targets import HttpDownstream

ORDERS = 3000
CUSTOMERS = 150  # ids 0..149; the service knows 0..139
KNOWN = 140
RATE = 100.0  # requests per second for the whole job


class CustomerService:
    """``GET /customers/{id}``: the customer as JSON, or 404; notes when each request came."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, daemon=True).start()
        if not self.ready.wait(10):
            raise RuntimeError("the customer service did not start")

    async def customer(self, request: web.Request) -> web.Response:
        self.arrivals.append(time.monotonic())
        customer_id = int(request.match_info["customer_id"])
        if not 0 <= customer_id < KNOWN:
            return web.Response(status=404, text=f"no customer {customer_id}")
        tier = ("gold", "silver", "bronze")[customer_id % 3]
        return web.json_response(
            {"id": customer_id, "name": f"customer {customer_id}", "tier": tier}
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/customers/{customer_id}", self.customer)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}/customers/{{customer_id}}"
        self.ready.set()
        self.loop.run_forever()

    def most_in_one_second(self) -> int:
        stamps = sorted(self.arrivals)
        return max(
            (bisect.bisect_left(stamps, t + 1.0, lo=i) - i for i, t in enumerate(stamps)),
            default=0,
        )


def main() -> int:
    service = CustomerService()
    spark, _ = spark_session("local[2]", "timewheel enrich example")
    try:
        orders = spark.range(ORDERS).select(
            F.col("id").alias("order_id"),
            (F.col("id") * 7 % CUSTOMERS).alias("customer_id"),
            F.round(F.rand(seed=1) * 100, 2).alias("amount"),
        )
        target = HttpDownstream(service.url, method="GET")
        start = time.monotonic()
        enriched: Any = dispatch(
            orders,
            target,
            id_col="order_id",
            dedupe=Dedupe("customer_id"),
            quota=Quota(rate=RATE),
            reply_schema="id long, name string, tier string",
            timeout_ms=5000,
            calls=Calls(retries=2),
        ).cache()
        counts = {r["status"]: r["count"] for r in enriched.groupBy("status").count().collect()}
        elapsed = time.monotonic() - start
        enriched.select(
            "order_id", "customer_id", "amount", "reply.name", "reply.tier", "status"
        ).show(3, truncate=False)
        enriched.filter("status = 'failed'").select(
            "order_id", "customer_id", "http_status", "error"
        ).show(3, truncate=False)
        rows = sum(counts.values())
        print(
            f"{rows} orders back ({counts.get('ok', 0)} ok, {counts.get('failed', 0)} failed) "
            f"from {len(service.arrivals)} requests in {elapsed:.1f} s; at most "
            f"{service.most_in_one_second()} in any second (rate {RATE:g})"
        )
        unique_orders = enriched.select("order_id").distinct().count()
        # Every known customer's order carries its name; an unknown one's the 404.
        wrong = enriched.filter(
            "(status = 'ok' AND reply.name != concat('customer ', customer_id))"
            " OR (status = 'failed' AND http_status != 404)"
        ).count()
        return 0 if rows == ORDERS == unique_orders and wrong == 0 else 1
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
