"""Waiting for a server started by a test: poll until a condition holds, with a generous bound for slow machines.

The bound only stops a test that would otherwise hang; no test asserts how long anything took.
"""

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(fetch: Callable[[], T], done: Callable[[T], bool], what: str, timeout_s: float = 180.0,
         interval_s: float = 0.5) -> T:
    """Calls `fetch` until `done(value)` holds and returns that value; raises TimeoutError naming `what` and the
    last value after `timeout_s` seconds. An OSError from `fetch` (a server not listening yet) counts as not done."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            last = fetch()
            if done(last):
                return last
        except OSError as e:
            last = e
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: still not there after {timeout_s:.0f} s; last seen: {str(last)[-2000:]}")
        time.sleep(interval_s)
