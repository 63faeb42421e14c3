"""The "provider batch" group of ``timewheel pipeline``'s flags (see :mod:`.pbatch`, which
checks them, and docs/spark/provider-batches.md)."""

from __future__ import annotations

import argparse

from ..argtypes import option_group, positive

__all__ = ["add_provider_batch_options"]


def add_provider_batch_options(parser: argparse.ArgumentParser) -> None:
    """The "provider batch" group of flags."""
    group = option_group(parser, "provider batch")
    group.add_argument(
        "--provider-batch",
        metavar="{openai,anthropic}",
        help="send the rows through this provider's batch API, at its batch price, and wait "
        "for the results (an OpenAI-compatible server: openai with --batch-base-url); each "
        "row's line is its body as the request-shape flags make it, its custom_id the key "
        "of its --id-col; --target is the provider's URL of the endpoint "
        "(.../v1/chat/completions, .../v1/embeddings, .../v1/messages)",
    )
    group.add_argument(
        "--batch-window",
        default="24h",
        metavar="WINDOW",
        help="the window the provider has to answer a batch (default: %(default)s, the only "
        "one either offers)",
    )
    group.add_argument(
        "--batch-base-url",
        metavar="URL",
        help="the provider API's base (OpenAI's ends in /v1: http://127.0.0.1:8090/v1; "
        "Anthropic's does not) (default: the provider's own)",
    )
    group.add_argument(
        "--batch-key",
        metavar="SECRET_REF",
        help="where the provider's API key is read (on the driver, which sends the batches, "
        "and on the executors, which download their results): env:NAME or file:PATH, "
        "never the key itself (default: env:OPENAI_API_KEY or env:ANTHROPIC_API_KEY)",
    )
    group.add_argument(
        "--batch-prices",
        action="append",
        default=[],
        metavar="FILE.json|MODEL=IN,OUT",
        help="online prices per million tokens, input and output, of each model the rows "
        "name (a batch pays half): MODEL=IN,OUT (repeatable), or a JSON file of "
        '{"MODEL": [IN, OUT]}; each row then gets its cost, the summary the total',
    )
    group.add_argument(
        "--batch-resend",
        default="batch",
        metavar="{batch,online,leave}",
        help="rows that ended failed (retryable) or expired: batch sends them once more in "
        "a new batch; online sends them once more through the online engine, at the full "
        "price, with the online flags (the quota, --max-in-flight, --timeout-ms, headers; "
        "the key from --batch-key unless a --http-header-secret gives it; --budget is then "
        "refused); leave returns them as they ended (default: %(default)s)",
    )
    group.add_argument(
        "--batch-poll-s",
        metavar="MIN[,MAX]",
        help="poll the batches every MIN seconds, up to 1.5 times longer each poll that "
        "sees none end, at most MAX (default: 5,300)",
    )
    group.add_argument(
        "--batch-max-requests",
        type=positive(int),
        metavar="N",
        help="the most rows per batch (default: the provider's most, 50,000 or 100,000)",
    )
    group.add_argument(
        "--batch-max-bytes",
        type=positive(int),
        metavar="N",
        help="the most bytes per batch file or request (default: the provider's most)",
    )
    group.add_argument(
        "--batch-queue-tokens",
        type=positive(int),
        metavar="N",
        help="OpenAI's batch queue limit of the rows' model, in tokens: batches are cut "
        "within it and made as the queue has room (default: none known; a batch the "
        "provider refuses for its queue is made again once there is room)",
    )
    group.add_argument(
        "--detach",
        action="store_true",
        help="make and submit the batches, print their ids and exit 0, --output left "
        "unfinished; the same command with --resume (without --detach) waits for them, "
        "collects and writes --output",
    )
