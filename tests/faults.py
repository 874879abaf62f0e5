"""Fault injection into a worker's NIXL agent. For tests only.

:class:`FaultyNixlAgent` stands in for the ``nixl._api.nixl_agent`` object
inside a :class:`p2pkv.dataplane.agent.NixlTransferAgent` (its ``_agent``
attribute): every attribute is the real agent's, except that the named
method fails on its ``fail_on_call``-th call (1-based), either by raising
or, for ``transfer`` and ``check_xfer_state``, by returning ``"ERR"`` the
way NIXL reports a failed transfer; ``check_xfer_state`` can also answer
``"PROC"`` (a READ or WRITE that seems stuck in flight), and so can
``transfer`` (a post NIXL never got: nothing moves, no notification). A
faulted call does not reach NIXL. Wrappers nest: the outer one counts every call, the inner one
only the calls the outer one let through.

It counts calls per method (faulted ones included) and holds no reference
to anything NIXL returns, so handles are garbage-collected as without it.

Never use this in production code: it exists to test the failure paths of
:mod:`p2pkv.worker` and :mod:`p2pkv.dataplane.agent`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from p2pkv.worker import WorkerSide

__all__ = ["ERR_METHODS", "NIXL_METHODS", "FaultyNixlAgent", "InjectedFault", "inject", "restore"]

NIXL_METHODS = (
    "register_memory",
    "get_agent_metadata",
    "add_remote_agent",
    "remove_remote_agent",
    "get_xfer_descs",
    "initialize_xfer",
    "transfer",
    "check_xfer_state",
    "release_xfer_handle",
    "send_notif",
    "get_new_notifs",
    "deregister_memory",
)
"""Every ``nixl_agent`` method :mod:`p2pkv.dataplane.agent` calls."""

ERR_METHODS = ("transfer", "check_xfer_state")
"""Methods that report failure by returning ``"ERR"`` (mode ``"err"``), and progress by ``"PROC"`` (mode ``"proc"``)."""

Mode = Literal["raise", "err", "proc"]
_RETURNS = {"err": "ERR", "proc": "PROC"}


class InjectedFault(RuntimeError):
    """The default exception a :class:`FaultyNixlAgent` raises."""


def _default_exc(method: str, call: int) -> BaseException:
    return InjectedFault(f"injected fault: {method} call {call}")


class FaultyNixlAgent:
    """A proxy for a real ``nixl_agent`` that fails one method on chosen calls.

    Args:
        real_agent: the ``nixl_agent`` to wrap.
        fail_method: the method to fail (one of :data:`NIXL_METHODS`).
        fail_on_call: 1-based number of the first call that fails.
        exc_factory: ``(method, call_number) -> exception`` raised in mode
            ``"raise"``; default :class:`InjectedFault`.
        mode: ``"raise"``; ``"err"`` (return ``"ERR"``; only for
            :data:`ERR_METHODS`); ``"proc"`` (return ``"PROC"``; only for
            :data:`ERR_METHODS`).
        times: how many consecutive calls fail from ``fail_on_call`` on;
            ``None``: every call from then on.

    Attributes:
        real: the wrapped agent.
        calls: calls so far per wrapped method (faulted ones included).
        faults: how many calls were faulted.
    """

    def __init__(self, real_agent: Any, fail_method: str, fail_on_call: int = 1,
                 exc_factory: Callable[[str, int], BaseException] | None = None,
                 mode: Mode = "raise", times: int | None = 1) -> None:
        if fail_method not in NIXL_METHODS:
            raise ValueError(f"unknown NIXL method {fail_method!r}; one of {', '.join(NIXL_METHODS)}")
        if mode not in ("raise", "err", "proc"):
            raise ValueError(f"mode must be 'raise', 'err' or 'proc', got {mode!r}")
        if mode == "err" and fail_method not in ERR_METHODS:
            raise ValueError(f"mode 'err' needs one of {ERR_METHODS}, got {fail_method!r}")
        if mode == "proc" and fail_method not in ERR_METHODS:
            raise ValueError(f"mode 'proc' needs one of {ERR_METHODS}, got {fail_method!r}")
        if fail_on_call < 1:
            raise ValueError(f"fail_on_call is 1-based, got {fail_on_call}")
        if times is not None and times < 1:
            raise ValueError(f"times must be >= 1 or None, got {times}")
        # Set through __dict__ so __getattr__ never sees these names missing.
        self.__dict__.update(
            real=real_agent, fail_method=fail_method, fail_on_call=fail_on_call,
            exc_factory=exc_factory or _default_exc, mode=mode, times=times,
            calls=Counter(), faults=0,
        )

    def _should_fail(self, call: int) -> bool:
        if call < self.fail_on_call:
            return False
        return self.times is None or call < self.fail_on_call + self.times

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.real, name)
        if name not in NIXL_METHODS:
            return attr

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            call = self.calls[name]
            if name == self.fail_method and self._should_fail(call):
                self.__dict__["faults"] += 1
                if self.mode in _RETURNS:
                    return _RETURNS[self.mode]
                raise self.exc_factory(name, call)
            return attr(*args, **kwargs)

        return wrapped

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            setattr(self.real, name, value)

    def __repr__(self) -> str:
        return (f"FaultyNixlAgent({self.fail_method} call {self.fail_on_call}"
                f"{'+' if self.times is None else f' x{self.times}'}, mode={self.mode}, faults={self.faults})")


def inject(worker: WorkerSide, method: str, n: int = 1, mode: Mode = "raise", *,
           times: int | None = 1,
           exc_factory: Callable[[str, int], BaseException] | None = None) -> FaultyNixlAgent:
    """Make ``worker``'s NIXL agent fail ``method`` from its ``n``-th call on. For tests only.

    Call after :meth:`WorkerSide.register_kv_caches`. Calls are counted from
    the injection. A fault already injected is replaced (the real agent is
    wrapped, never a wrapper).

    Args:
        worker: a worker whose ``agent`` exists.
        method: the ``nixl_agent`` method to fail (:data:`NIXL_METHODS`).
        n: 1-based number of the first failing call.
        mode: ``"raise"``, ``"err"`` or ``"proc"`` (see :class:`FaultyNixlAgent`).
        times: consecutive failing calls; ``None``: all from the ``n``-th on.
        exc_factory: exception to raise (mode ``"raise"``).

    Returns:
        The installed wrapper (its counters show what happened).
    """
    if worker.agent is None:
        raise RuntimeError("inject() needs a registered worker: call register_kv_caches first")
    real = worker.agent._agent
    if isinstance(real, FaultyNixlAgent):
        real = real.real
    faulty = FaultyNixlAgent(real, method, n, exc_factory, mode, times)
    worker.agent._agent = faulty
    return faulty


def restore(worker: WorkerSide) -> None:
    """Put the real NIXL agent back after :func:`inject`. For tests only."""
    if worker.agent is not None and isinstance(worker.agent._agent, FaultyNixlAgent):
        worker.agent._agent = worker.agent._agent.real
