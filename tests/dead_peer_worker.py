"""Rank 1 of a 2-process gloo group exits; rank 0 prints what :func:`peer_failure` makes of the error torch raises.

Launched twice by tests/test_elastic_recovery.py (plain processes, no torchrun agent, which would end rank 0 first).
"""

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_hybrid.distributed.elastic import peer_failure

dist.init_process_group("gloo", timeout=timedelta(seconds=60))
tensor = torch.ones(4)
dist.all_reduce(tensor)
if dist.get_rank() == 1:
    os._exit(0)  # the peer is gone: its sockets close under rank 0's next collective
result = {}
try:
    dist.all_reduce(tensor)
except Exception as err:  # noqa: BLE001 - whatever torch raises is the subject of the test
    try:
        raise RuntimeError("pipeline step failed") from err  # a library may wrap it, as a schedule does
    except RuntimeError as wrapped:
        result = {"type": type(err).__name__, "direct": peer_failure(err), "wrapped": peer_failure(wrapped)}
print(json.dumps(result), flush=True)
os._exit(0)
