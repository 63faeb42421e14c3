"""Enrich a DataFrame of orders from a customer service, under a rate limit.

Runs as it stands (``python examples/enrich.py``): it starts a small customer service
(aiohttp, on 127.0.0.1, answering per customer id) and a local Spark, then sends each
order's customer to the service with :func:`timewheel.spark.dispatch`:

* ``rate=RATE``: the whole job stays under RATE requests a second, however many tasks;
* ``dedupe_col="customer_id"``: orders of the same customer share one request;
* every order comes back once with how its lookup ended (``status``, ``attempts``,
  ``latency_ms``, ``error``); unknown customers are ``failed`` with the service's 404.

The reply itself (the customer's name and tier as columns) needs the reply columns of
issue 21 (``method="GET"``, a ``{customer_id}`` URL template, ``reply_schema=``); until
then this example shows the quota, the de-duplication and the accounting.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import sys
import threading
import time
from typing import Any

from aiohttp import web
from pyspark.sql import functions as F

from timewheel.spark import dispatch
from timewheel.spark.pipeline import spark_session
from timewheel.spark.targets import HttpDownstream

ORDERS = 3000
CUSTOMERS = 150  # ids 0..149; the service knows 0..139
KNOWN = 140
RATE = 100.0  # requests per second for the whole job


class CustomerService:
    """``POST /customers`` with ``{"customer_id": N}``: the customer, or 404; notes when."""

    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.ready = threading.Event()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, daemon=True).start()
        if not self.ready.wait(10):
            raise RuntimeError("the customer service did not start")

    async def customer(self, request: web.Request) -> web.Response:
        self.arrivals.append(time.monotonic())
        customer_id = json.loads(await request.read())["customer_id"]
        if not 0 <= customer_id < KNOWN:
            return web.Response(status=404, text=f"no customer {customer_id}")
        tier = ("gold", "silver", "bronze")[customer_id % 3]
        return web.json_response(
            {"id": customer_id, "name": f"customer {customer_id}", "tier": tier}
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/customers", self.customer)
        runner = web.AppRunner(app, access_log=None)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/customers"  # type: ignore[union-attr]
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
        target = HttpDownstream(service.url, body=["customer_id"])
        start = time.monotonic()
        enriched: Any = dispatch(
            orders,
            target,
            id_col="order_id",
            dedupe_col="customer_id",
            rate=RATE,
            timeout_ms=5000,
            retries=2,
        ).cache()
        counts = {r["status"]: r["count"] for r in enriched.groupBy("status").count().collect()}
        elapsed = time.monotonic() - start
        enriched.filter("status = 'failed'").select("order_id", "customer_id", "error").show(
            3, truncate=False
        )
        rows = sum(counts.values())
        print(
            f"{rows} orders back ({counts.get('ok', 0)} ok, {counts.get('failed', 0)} failed) "
            f"from {len(service.arrivals)} requests in {elapsed:.1f} s; at most "
            f"{service.most_in_one_second()} in any second (rate {RATE:g})"
        )
        unique_orders = enriched.select("order_id").distinct().count()
        return 0 if rows == ORDERS == unique_orders else 1
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
