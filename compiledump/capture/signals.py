"""SIGTERM/SIGINT: flush what was captured, then do what the process would have done anyway.

Installed (main thread only: Python allows nothing else) when capture becomes active, i.e. at
import with `COMPILEDUMP_DIR` set or at `configure(dir=...)`. The handler flushes, then chains to
the handler that was installed before it:

- a Python handler (the host application's, or SIGINT's default `KeyboardInterrupt`) is called;
- `SIG_IGN` stays ignored: the process goes on;
- the default action (`SIG_DFL`, or a handler installed from C) is restored and the signal is
  raised again, so the process dies of it with the usual exit status (-15 for SIGTERM).

A signal that arrives while the main thread is inside a capture kernel (the CPU kernel counts a
capture before it writes it; ops/register.py `inside_kernel()` says so) is handled a moment
later, once the kernel has returned: the handler re-sends the signal to the process and returns,
so the dump never holds a capture that was counted but not written.

`COMPILEDUMP_SIGNALS=0` turns this off (the dump is then written at normal interpreter exit,
or by an explicit `flush()`). A handler the application installs later replaces this one;
chaining is its business then.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from .. import config
from ..ops.register import inside_kernel

SIGNALS = (signal.SIGTERM, signal.SIGINT)

# signum -> the handler that was in place before ours.
_previous: dict[int, object] = {}
_flush = None  # the signal-safe flush, set by install()
_before_death = None  # called when the signal's default action is about to end the process
_MAX_DEFERRALS = 1000  # then flush anyway (about a second of retries)
_deferrals = 0


def install(flush, before_death=None) -> bool:
    """Install the handlers once per process; returns whether they are installed now.

    `flush(dying_of)` is called from the handler on the main thread, possibly while that thread
    was in the middle of a capture or of another flush: it must not wait for a lock the
    interrupted frame holds. `dying_of` is the signal's name when its default action ends the
    process next, else None. `before_death()`, after a flush that completed, when the signal will
    end the process (no atexit hook runs then).
    """
    global _flush, _before_death
    _flush, _before_death = flush, before_death
    if config.env("COMPILEDUMP_SIGNALS") == "0":
        return False
    if threading.current_thread() is not threading.main_thread():
        return all(signum in _previous for signum in SIGNALS)
    for signum in SIGNALS:
        if signum in _previous:
            continue
        try:
            previous = signal.getsignal(signum)
            signal.signal(signum, _handler)
        except (ValueError, OSError):  # e.g. an embedded interpreter without signal support
            continue
        _previous[signum] = previous
    return all(signum in _previous for signum in SIGNALS)


def installed() -> bool:
    """True when this module's handler is the one in place for SIGTERM and SIGINT."""
    return all(signal.getsignal(signum) is _handler for signum in SIGNALS)


def _handler(signum, frame):
    global _deferrals
    if inside_kernel() and _deferrals < _MAX_DEFERRALS:
        # Let the interrupted capture finish, then take the signal again.
        _deferrals += 1
        timer = threading.Timer(0.001, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        return None
    _deferrals = 0
    flushed = False
    previous = _previous.get(signum, signal.SIG_DFL)
    # SIG_DFL, or None (a handler installed from C that Python cannot call): the signal ends the process
    dying = not callable(previous) and previous != signal.SIG_IGN
    try:
        if _flush is not None:
            _flush(signal.Signals(signum).name if dying else None)
            flushed = True
    except BaseException as error:  # noqa: BLE001 - the signal's own action must still happen
        print(f"[compiledump] flush on {signal.Signals(signum).name} failed: {error!r}", file=sys.stderr, flush=True)
    if callable(previous):
        return previous(signum, frame)
    if previous == signal.SIG_IGN:
        return None
    # SIG_DFL, or None (a handler installed from C that Python cannot call): die of the signal.
    if flushed and _before_death is not None:
        try:
            _before_death()
        except BaseException as error:  # noqa: BLE001 - dying of the signal comes first
            print(f"[compiledump] cleanup on {signal.Signals(signum).name} failed: {error!r}", file=sys.stderr,
                  flush=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    # Not reached unless the signal is blocked in this thread: exit with the shell's status.
    sys.exit(128 + signum)
