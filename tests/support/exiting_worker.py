"""``python -m tests.support.exiting_worker``: a stand-in worker rank for ``LocalWorkers`` tests
that reads its ``WorkerArgs`` as a real one does and exits with the code its payload names, or,
for ``"ping"``, pings its starter as a real one does until it is stopped or killed."""

from __future__ import annotations

import os
import pickle
import sys
import time

if __name__ == "__main__":
    args = pickle.load(sys.stdin.buffer)
    if args.payload == "ping":
        from services.engine.parallel import worker_main

        worker_main._ping_starter(args)
        time.sleep(120)
    os._exit(int(args.payload))
