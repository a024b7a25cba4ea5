"""Tools for the tests: well-behaved ones, and ones that raise, hang, crash or use too much CPU or memory."""

from __future__ import annotations

import os
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


def echo(text: str) -> dict:
    """Echo the text back, in a JSON object.

    Args:
        text: anything.
    """
    return {"echo": text}


def boom(text: str) -> str:
    """Always raise.

    Args:
        text: ignored.
    """
    raise RuntimeError(f"boom on {text}")


def hang(text: str) -> str:
    """Sleep far longer than any timeout.

    Args:
        text: ignored.
    """
    time.sleep(3600)
    return text


def crash(text: str) -> str:
    """Kill the worker process.

    Args:
        text: ignored.
    """
    os._exit(3)


def spin(text: str) -> str:
    """Burn CPU until stopped.

    Args:
        text: ignored.
    """
    x = 0
    while True:
        x += 1


def hog(megabytes: int) -> int:
    """Allocate this many MiB.

    Args:
        megabytes: how much.
    """
    return len(bytearray(megabytes * 2**20))


def untyped(x):
    """No type hint.

    Args:
        x: anything.
    """
    return x


def undocumented(x: int) -> int:
    return x


async def wait_and_stamp(seconds: float) -> dict:
    """An `async def` tool that waits on a timer (I/O-like) and says when it ran.

    Args:
        seconds: how long to wait.
    """
    import asyncio
    import time

    start = time.time()
    await asyncio.sleep(seconds)
    return {"start": start, "end": time.time()}


async def async_boom(x: int) -> int:
    """An `async def` tool that raises after an await.

    Args:
        x: anything.
    """
    import asyncio

    await asyncio.sleep(0)
    raise ValueError(f"async tool failed on {x}")


NOT_A_FUNCTION = 3
