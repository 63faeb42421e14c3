"""How the HTTP target's requests leave this process: its libcurl loop thread
(:class:`~._curl.CurlLoop`, made on first use and again in a forked child), and a request
whose headers hold secrets (:class:`WithSecrets`: their values read where it is sent, and
read again once after a 401), with the thread that reads them again."""

from __future__ import annotations

from typing import Any

from ..contract import Failure, OnDone
from ..runtime import PerProcess
from ..secrets import SecretError

__all__ = ["LOOP", "RENEWER", "WithSecrets", "new_loop", "renewer"]


def new_loop() -> Any:
    from ._curl import CurlLoop

    return CurlLoop()


# This process's libcurl loop thread (made on first use, again in a forked child).
LOOP: PerProcess[Any] = PerProcess(new_loop)


def renewer() -> Any:
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(1, thread_name_prefix="timewheel-secret")


# The thread that reads secrets again after a 401 (their function may take a while: not
# on the loop thread), one per process.
RENEWER: PerProcess[Any] = PerProcess(renewer)


class WithSecrets:
    """A request whose headers hold secrets: read them (this process's values), send it,
    and on a 401 read the renewable ones again and send it once more."""

    __slots__ = (
        "body",
        "cancelled",
        "lines",
        "numbers",
        "on_done",
        "renewed",
        "request",
        "rows",
        "settings",
        "target",
        "url",
    )

    def __init__(
        self,
        target: Any,
        settings: Any,
        url: str,
        lines: list[str],
        body: bytes | None,
        on_done: OnDone,
        rows: int = 0,
    ) -> None:
        self.target = target
        self.rows = rows
        self.settings = settings
        self.url = url
        self.lines = lines
        self.body = body
        self.on_done = on_done
        self.numbers: list[int] = []
        self.request: Any = None
        self.cancelled = self.renewed = False

    def _send(self, renew: bool) -> bool:
        """Send with the secrets' values (read again if ``renew``); False: failed the row."""
        lines = list(self.lines)
        numbers = []
        try:
            for i, (name, secret) in enumerate(self.target.header_secrets):
                value, number = secret.renew(self.numbers[i]) if renew else secret.resolve()
                lines.append(f"{name}: {value}")
                numbers.append(number)
        except SecretError as exc:
            self.on_done(False, Failure(str(exc), exc.retry_after_s))
            return False
        self.numbers = numbers
        t = self.target
        limit = t.limits.reply_limit(self.rows) if self.rows else None
        self.request = LOOP.get().request(
            self.settings, t.method, self.url, lines, self.body, WithSecrets._ended, self, limit
        )
        return True

    def start(self) -> WithSecrets | None:
        return self if self._send(renew=False) else None

    def _ended(
        self, status: int, text: bytes, headers: dict[str, str], errno: int, msg: str
    ) -> None:
        if status == 401 and errno == 0 and self.target._renews and not self.renewed:
            self.renewed = True
            RENEWER.get().submit(self._renew)
            return
        self.target._ended(self.on_done, status, text, headers, errno, msg, self.rows)

    def _renew(self) -> None:
        if self.cancelled:
            return
        try:
            sent = self._send(renew=True)
        except Exception as exc:  # the loop closed: the row fails, worth a retry
            self.on_done(False, Failure(f"request not made: {exc}", 0.0))
            return
        if sent and self.cancelled:
            self.request.cancel()

    def cancel(self) -> None:
        """Drop the request, and the second one a 401 would make."""
        self.cancelled = True
        request = self.request
        if request is not None:
            request.cancel()
