"""Either implementation whole, for the tests and benchmarks that compare them.

:func:`implementation` hands out an :class:`Implementation`: a core of
:mod:`timewheel._impl` (the wheel, tasks and loop-driven timer modules, all extensions or
all twins) with the public classes on it (``Timer``, ``Purgatory``,
``AioDelayedOperation``, ``AioPurgatory``). On the core in use those are the public
modules' own classes; on the twin while the extensions are in use, the same layers on the
twin's core (:mod:`timewheel._twin`, imported only then, so ``import timewheel`` loads no
twin). This module sits above every public layer, whose classes it hands out, and imports
them only when asked; the core below knows nothing of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _impl

if TYPE_CHECKING:
    from . import aio, purgatory, timer

__all__ = ["Implementation", "implementation"]


class Implementation(_impl.Core):
    """One whole implementation: a core (``name``, ``wheel``, ``tasks``, ``aio``,
    ``TimingWheel`` and the tasks module's names) and the public classes on it."""

    @property
    def Timer(self) -> type[timer.Timer]:
        """:class:`timewheel.Timer` on this core."""
        if self.name == _impl.IMPLEMENTATION:
            from .timer import Timer

            return Timer
        from ._twin import Timer as TwinTimer

        return TwinTimer  # type: ignore[return-value]

    @property
    def Purgatory(self) -> type[purgatory.Purgatory]:
        """:class:`timewheel.Purgatory` on this core."""
        if self.name == _impl.IMPLEMENTATION:
            from .purgatory import Purgatory

            return Purgatory
        from ._twin import Purgatory as TwinPurgatory

        return TwinPurgatory  # type: ignore[return-value]

    @property
    def AioDelayedOperation(self) -> type[aio.DelayedOperation]:
        """:class:`timewheel.aio.DelayedOperation` on this core."""
        if self.name == _impl.IMPLEMENTATION:
            from .aio import DelayedOperation

            return DelayedOperation
        from ._twin import AioDelayedOperation

        return AioDelayedOperation  # type: ignore[return-value]

    @property
    def AioPurgatory(self) -> type[aio.Purgatory]:
        """:class:`timewheel.aio.Purgatory` on this core."""
        if self.name == _impl.IMPLEMENTATION:
            from .aio import Purgatory

            return Purgatory
        from ._twin import AioPurgatory

        return AioPurgatory  # type: ignore[return-value]


_WHOLE: dict[str, Implementation] = {}


def implementation(name: str | None = None) -> Implementation:
    """The implementation called ``name`` ("cython" or "python"), or the one in use.

    Raises LookupError for "cython" when the extensions are not in use.
    """
    core = _impl.core(name)
    whole = _WHOLE.get(core.name)
    if whole is None:
        whole = _WHOLE[core.name] = Implementation(core.name, core.wheel, core.tasks, core.aio)
    return whole
