"""A scoring worker process (pool.py starts it):
`python -m megarl.rewards.worker IN_FD OUT_FD [FUNCTION ...]`.

Loads the named functions (their modules' imports, e.g. torch, can take seconds) and says it is
ready on OUT_FD (so a job's timeout never counts the start), then receives
(index, function name, Request) jobs on IN_FD and sends (index, Outcome or None, error or None)
back; loads each function once. Imports no torch: it starts in a moment. Ends when its parent
closes IN_FD (or dies).
"""

import sys
from multiprocessing.connection import Connection
from typing import List

from megarl.rewards.functions import LoadedFunctions

READY = "ready"


def main(in_fd: int, out_fd: int, preload: List[str]) -> None:
    inbox, outbox = Connection(in_fd, writable=False), Connection(out_fd, readable=False)
    functions = LoadedFunctions(preload)
    outbox.send(READY)
    while True:
        try:
            index, name, request = inbox.recv()
        except EOFError:
            return
        outbox.send((index, *functions.call(name, request)))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])
