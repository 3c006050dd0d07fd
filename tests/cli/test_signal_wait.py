"""The serve loop's wait wakes for a signal that the kernel delivered to another thread (the CI failure
of `test_ctrl_c_while_streaming_drains_then_stops`: Ctrl-C ignored while a stream ran)."""

from __future__ import annotations

import signal
import threading
import time

from draftmesh.cli.main import wait_polling

GUARD_S = 10.0


def test_a_signal_caught_on_another_thread_wakes_the_main_threads_wait():
    assert threading.current_thread() is threading.main_thread()  # Python runs handlers on the main thread only
    stop = threading.Event()
    handled: list[str] = []

    def on_signal(_signum, _frame) -> None:
        handled.append(threading.current_thread().name)
        stop.set()

    def deliver_on_this_thread() -> None:
        time.sleep(0.2)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # as the kernel may pick any thread
        time.sleep(0.5)

    guard = threading.Timer(GUARD_S, stop.set)  # an untimed Event.wait() would only wake here
    previous = signal.signal(signal.SIGUSR1, on_signal)
    try:
        threading.Thread(target=deliver_on_this_thread, daemon=True).start()
        guard.start()
        t0 = time.monotonic()
        wait_polling(stop, poll_s=0.1)
        took = time.monotonic() - t0
    finally:
        guard.cancel()
        signal.signal(signal.SIGUSR1, previous)
    assert handled == [threading.main_thread().name]
    assert took < GUARD_S / 2, f"the wait woke after {took:.1f}s, by the guard"
