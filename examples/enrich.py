"""Enrich a DataFrame of orders from a customer service, under a rate limit.

Runs as it stands (``python examples/enrich.py``, with what
``pip install 'timewheel-purgatory[spark]'`` installs): it starts a small customer service
(the standard library's ``http.server``, on 127.0.0.1, answering per customer id) and a
local Spark, then sends each order's customer to the service with
:func:`timewheel.spark.dispatch`:

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

import bisect
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from pyspark.sql import functions as F

from timewheel.spark import Calls, Dedupe, Quota, dispatch
from timewheel.spark.session import spark_session
from timewheel.spark.targets import HttpDownstream

ORDERS = 3000
CUSTOMERS = 150  # ids 0..149; the service knows 0..139
KNOWN = 140
RATE = 100.0  # requests per second for the whole job


class CustomerService(ThreadingHTTPServer):
    """``GET /customers/{id}``: the customer as JSON, or 404; notes when each request came."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Customers)
        self.arrivals: list[float] = []
        self.url = f"http://127.0.0.1:{self.server_address[1]}/customers/{{customer_id}}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def most_in_one_second(self) -> int:
        stamps = sorted(self.arrivals)
        return max(
            (bisect.bisect_left(stamps, t + 1.0, lo=i) - i for i, t in enumerate(stamps)),
            default=0,
        )


class _Customers(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the job's connections are reused
    server: CustomerService

    def do_GET(self) -> None:
        self.server.arrivals.append(time.monotonic())
        prefix, _, tail = self.path.rpartition("/")
        if prefix != "/customers" or not tail.isdigit():
            return self._answer(404, b"no such path", "text/plain")
        customer_id = int(tail)
        if not customer_id < KNOWN:
            return self._answer(404, f"no customer {customer_id}".encode(), "text/plain")
        tier = ("gold", "silver", "bronze")[customer_id % 3]
        customer = {"id": customer_id, "name": f"customer {customer_id}", "tier": tier}
        self._answer(200, json.dumps(customer).encode(), "application/json")

    def _answer(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # no line per request
        pass


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
        service.shutdown()
        service.server_close()


if __name__ == "__main__":
    sys.exit(main())
