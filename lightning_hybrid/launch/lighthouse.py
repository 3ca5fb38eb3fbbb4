"""``lightning-hybrid lighthouse``: torchft's lighthouse server, which forms each step's quorum of replica groups.

It is torchft's own server (``torchft._torchft.LighthouseServer``), started in this process and kept until SIGINT or
SIGTERM; each replica group finds it through ``TORCHFT_LIGHTHOUSE=http://HOST:PORT``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Optional

__all__ = ["lighthouse_main", "start_lighthouse"]


def start_lighthouse(min_replicas: int, port: int = 29510, join_timeout_ms: int = 60_000,
                     quorum_tick_ms: int = 100, heartbeat_timeout_ms: int = 5_000) -> object:
    """Start torchft's lighthouse on ``[::]:port`` (0: any free port); its ``address()`` is what groups connect to.

    Raises:
        ImportError: torchft is not installed (one line naming the extra).
        ValueError: ``min_replicas`` is not a positive integer.
    """
    from lightning_hybrid.distributed.fault_tolerance import require_torchft

    require_torchft()
    if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
        raise ValueError(f"--min-replicas {min_replicas!r} must be a positive integer (replica groups a quorum needs)")
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind=f"[::]:{port}", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)


def lighthouse_main(argv: Optional[list[str]] = None) -> int:
    """Run the lighthouse until interrupted; prints its address (the ``TORCHFT_LIGHTHOUSE`` value) first."""
    parser = argparse.ArgumentParser(prog="lightning-hybrid lighthouse", description=__doc__.splitlines()[0])
    parser.add_argument("--min-replicas", type=int, required=True,
                        help="replica groups a quorum needs (a step with fewer waits for the join timeout)")
    parser.add_argument("--port", type=int, default=29510, help="port to bind on every interface (default 29510)")
    parser.add_argument("--join-timeout-ms", type=int, default=60_000,
                        help="how long a quorum waits for groups that are not yet there (default 60000)")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5_000,
                        help="silence after which a group is dropped from the next quorum (default 5000)")
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="how often quorums are computed")
    args = parser.parse_args(argv)
    server = start_lighthouse(args.min_replicas, args.port, args.join_timeout_ms, args.quorum_tick_ms,
                              args.heartbeat_timeout_ms)
    print(f"lighthouse at {server.address()} (min replicas {args.min_replicas}); set TORCHFT_LIGHTHOUSE to it",
          flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(lighthouse_main())
