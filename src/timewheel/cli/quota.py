"""``timewheel quota reset NAME --store redis://HOST:PORT/DB``: forget a quota kept in Redis.

Deletes every key Redis keeps for the quota ``NAME`` (the state the jobs naming it share
and every job's count of what it took and spent), through
:func:`timewheel.spark.quota.redis_store.reset_quota`, and prints how many.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``quota`` subcommand (one action: ``reset``)."""
    parser = subparsers.add_parser("quota", help="manage a quota kept in Redis")
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    reset = actions.add_parser("reset", help="forget what Redis keeps for a quota's name")
    reset.add_argument("name", help="the quota's name (Quota(name=...), --quota-name)")
    reset.add_argument("--store", required=True, help="redis://HOST:PORT/DB (no password)")
    reset.add_argument(
        "--store-password", help="where Redis's password is read: env:VAR or file:PATH"
    )
    reset.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Reset the quota; 0 when done, 2 on bad input or a Redis that cannot be reached."""
    from ..spark.quota.redis_store import reset_quota
    from ..spark.quota.spec import QuotaStoreError
    from ..spark.secrets import Secret, SecretError

    try:
        password = None
        if args.store_password is not None:
            password = Secret(args.store_password).resolve()[0]
        deleted = reset_quota(args.store, args.name, password=password)
    except (ValueError, TypeError, QuotaStoreError, SecretError) as exc:
        print(f"timewheel quota reset: {exc}", file=sys.stderr)
        return 2
    print(f"quota {args.name!r}: {deleted} key(s) deleted")
    return 0
