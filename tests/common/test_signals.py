"""``TerminationSignals``: the main thread's wait sees a signal whichever thread took it, in the
order signals and wakes came, and leaves the process's handlers as they were."""

from __future__ import annotations

import signal
import threading

from common.signals import TerminationSignals


def _from_another_thread(action) -> None:
    thread = threading.Thread(target=action)
    thread.start()
    thread.join(5)


def test_a_signal_taken_by_another_thread_ends_the_wait() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with TerminationSignals() as signals:
        # delivered to the helper thread itself: its C handler runs there, not in this one
        _from_another_thread(lambda: signal.pthread_kill(threading.get_ident(), signal.SIGTERM))
        assert signals.next() == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


def test_signals_and_wakes_are_returned_in_order() -> None:
    with TerminationSignals() as signals:
        _from_another_thread(signals.wake)
        signal.raise_signal(signal.SIGINT)  # main thread: no KeyboardInterrupt while entered
        _from_another_thread(lambda: signal.pthread_kill(threading.get_ident(), signal.SIGTERM))
        assert [signals.next(), signals.next(), signals.next()] == [
            None,
            signal.SIGINT,
            signal.SIGTERM,
        ]
