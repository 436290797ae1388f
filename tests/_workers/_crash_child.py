"""Saver processes for tests/io/test_crash.py, forked from a zygote so that each costs milliseconds.

Run as a program, this is the zygote: it imports torch and fastpersist once,
prints ``ready`` and then reads commands from stdin, one JSON object a line:

``{"path": ..., "fifo": ..., "scratch": ..., "elements": N, "settings": {...}, "use_async": bool}``
    forks a saver and answers with its pid. The saver builds states A and B
    (see :func:`make_state`), opens ``fifo`` for writing, saves once into the
    ``scratch`` directory (a warm-up), writes ``S``, then saves B, A, B, A... to ``path`` forever, writing ``+`` and the
    save's duration (a little-endian double) after each completed save. It never exits by itself: the test kills it
    with SIGKILL (on an error it writes ``E`` and the message and waits to
    be killed, so that its pid cannot be reused before the kill).

The zygote ignores SIGCHLD, so killed savers are reaped at once. It does no
work of its own, so no lock is held when it forks (torch starts its intra-op
thread pools lazily, in the savers), as with multiprocessing's fork method.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import time
import traceback


def make_state(which: str, elements: int) -> dict:
    """State A or B: different sizes, tensors and values, so a mix of the two cannot pass for either."""
    import torch

    generator = torch.Generator().manual_seed(1 if which == "A" else 2)
    if which == "A":
        return {"w": torch.randn(elements, generator=generator), "step": 1}
    return {
        "w": torch.randn(elements + 12_345, generator=generator),
        "extra": torch.randn(1000, generator=generator),
        "small": [torch.arange(n) for n in (1, 7, 300)],
        "step": 2,
    }


def _saver(command: dict) -> None:
    import fastpersist

    fifo = os.open(command["fifo"], os.O_WRONLY)
    try:
        states = [make_state("A", command["elements"]), make_state("B", command["elements"])]
        # A first save pays for starting the engine and faulting in the ring: do it
        # elsewhere, so that the test's random delays fall on warm saves like the one it timed.
        warmup = os.path.join(command["scratch"], f"warmup-{os.getpid()}.pt")
        fastpersist.save(states[1], warmup, **command["settings"])
        os.unlink(warmup)
        os.write(fifo, b"S")
        index = 1
        while True:
            start = time.perf_counter()
            if command.get("use_async") and index % 2:
                fastpersist.async_save(states[index % 2], command["path"], **command["settings"]).result()
            else:
                fastpersist.save(states[index % 2], command["path"], **command["settings"])
            os.write(fifo, b"+" + struct.pack("<d", time.perf_counter() - start))
            index += 1
    except BaseException:  # noqa: BLE001 - report, then wait to be killed
        os.write(fifo, b"E" + traceback.format_exc().encode()[-2000:])
        while True:
            time.sleep(60)


def main() -> None:
    import torch  # noqa: F401

    import fastpersist  # noqa: F401 - imported once here, shared by every fork

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                os.close(0)
                _saver(command)
            finally:
                os._exit(3)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
