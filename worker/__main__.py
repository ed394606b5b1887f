"""``python -m kvtier.worker [flags]``: one worker in this process, without Ray.

Runs the same phases as the Ray actor, then serves until SIGINT or SIGTERM.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

from kvtier.domain.errors import KvtierError
from kvtier.worker.actor import WorkerActor, worker_args

EXIT_BAD_INPUT = 2


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = worker_args(argv)
        worker = WorkerActor(
            args.config, worker_id=args.worker_id, heartbeat_interval_s=args.heartbeat_interval_s
        )
        worker.init_device()
        worker.load_model()
        worker.allocate_pools()
        address = worker.serve()
    except KvtierError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"kvtier worker {worker.worker_id} serving on {address}", file=sys.stderr, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    worker.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
