"""``python -m tests.support.exiting_worker``: a stand-in worker rank for ``LocalWorkers`` tests
that reads its ``WorkerArgs`` as a real one does and exits with the code its payload names."""

from __future__ import annotations

import os
import pickle
import sys

if __name__ == "__main__":
    args = pickle.load(sys.stdin.buffer)
    os._exit(int(args.payload))
