"""The thread pool that runs :class:`~ferrymq.client.push.PushConsumer` handlers.

A :class:`concurrent.futures.ThreadPoolExecutor` does not fit a consumer's handlers: the
interpreter joins its threads at exit, so one hung handler keeps a process that was told to stop
(Ctrl-C) alive, and its exit hook shuts every such pool down before ``atexit`` code runs, so a
consumer closing at exit finds its pool refusing work under it. :class:`HandlerThreads` is a
fixed pool of *daemon* threads that only its owner shuts down: a handler still running when
``close(timeout)`` gives up on it is abandoned (its message goes back to the group when the
member leaves) and never holds up the exit.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_Work = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class PoolClosedError(RuntimeError):
    """Work was submitted to a :class:`HandlerThreads` pool after its shutdown."""


class HandlerThreads(concurrent.futures.Executor):
    """``threads`` daemon threads (started on first use) running submitted calls in order.

    Args:
        threads: how many calls run at once.
        name: thread name prefix (``<name>-<i>``).
    """

    def __init__(self, threads: int, name: str) -> None:
        self._size = threads
        self._name = name
        self._queue: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._shutdown = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
               ) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args, **kwargs)``; its future gets the result.

        Raises:
            PoolClosedError: the pool was shut down.
        """
        with self._lock:
            if self._shutdown:
                raise PoolClosedError("cannot run handlers: the consumer's threads were shut down")
            fut: concurrent.futures.Future[T] = concurrent.futures.Future()
            self._queue.put((fut, fn, args, kwargs))
            if len(self._threads) < self._size:
                t = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}",
                                     daemon=True)
                t.start()
                self._threads.append(t)
            return fut

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            fut, fn, args, kwargs = work
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                res = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
                fut.set_exception(exc)
            else:
                fut.set_result(res)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new work; with ``cancel_futures`` drop queued calls that have not started;
        threads end after their current call (``wait``: wait for that)."""
        with self._lock:
            self._shutdown = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    work = self._queue.get_nowait()
                except queue.Empty:
                    break
                if work is not None:
                    work[0].cancel()
        for _ in threads:
            self._queue.put(None)
        if wait:
            for t in threads:
                t.join()
