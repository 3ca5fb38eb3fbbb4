"""``lightning-hybrid preflight``: the command line around :func:`~lightning_hybrid.preflight.links.run_preflight`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

import torch

from lightning_hybrid.distributed.mesh import MESH_DIMS, build_mesh
from lightning_hybrid.distributed.parallel_dims import ParallelDims
from lightning_hybrid.hardware import SYSTEM_GPUS
from lightning_hybrid.launch.torchrun import free_port
from lightning_hybrid.preflight.links import (
    DEFAULT_ITERS,
    DEFAULT_MATMUL_SIZE,
    DEFAULT_MAX_BYTES,
    DEFAULT_MIN_BYTES,
    DEFAULT_THRESHOLD,
    MiB,
    run_preflight,
)

__all__ = ["build_parser", "preflight_main"]

LOCALHOST = "127.0.0.1"


def _key_values(items: list[str], flag: str) -> dict[str, float]:
    out = {}
    for item in items:
        for part in item.split(","):
            key, sep, value = part.partition("=")
            try:
                out[key.strip()] = float(value)
            except ValueError:
                raise ValueError(f"{flag} {part!r} must look like DIM=GBPS, e.g. tp=360") from None
            if not sep or key.strip().split(".")[0] not in MESH_DIMS:
                raise ValueError(f"{flag} {part!r}: the key must be one of {', '.join(MESH_DIMS)} "
                                 f"(optionally DIM.TEST, e.g. dp.all_gather)")
    return out


def _default_to_one_process() -> None:
    """Without torchrun, run as the only rank: fill in the rendezvous variables torchrun would set.

    The port is a free one the OS picks now (:func:`~lightning_hybrid.launch.torchrun.free_port` binds port 0 on
    127.0.0.1), so that two preflights, or a preflight and a training job, on one host do not collide on a fixed
    port; torchrun always sets ``MASTER_PORT``, so under torchrun nothing is picked.
    """
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    for key, default in (("MASTER_ADDR", LOCALHOST), ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, default)


def build_parser() -> argparse.ArgumentParser:
    """The ``preflight`` flags."""
    p = argparse.ArgumentParser(prog="lightning-hybrid preflight",
                                description="Measure collective bandwidth per mesh dimension, matmul speed and "
                                            "GPU health; exit 1 when anything is below threshold.")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline parallel size (1)")
    p.add_argument("--dp", type=int, default=None, help="data parallel size (inferred)")
    p.add_argument("--gpu", choices=sorted(SYSTEM_GPUS),
                   help="GPU type for the expected values (default: from the device)")
    p.add_argument("--expected-busbw", "--expected-busbw-gbps", dest="expected_busbw", action="append", default=[],
                   metavar="DIM=GBPS", help="expected bus bandwidth in GB/s (bytes), e.g. tp=360,dp=40 (repeatable)")
    p.add_argument("--expected-p2p", type=float, help="expected pipeline point-to-point bandwidth, GB/s")
    p.add_argument("--expected-tflops", type=float, help="expected matmul TFLOP/s per device")
    p.add_argument("--expected-nvlinks", type=int, help="NVLink links per GPU that must be up")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"fail below threshold x expected ({DEFAULT_THRESHOLD:g})")
    p.add_argument("--min-bytes", type=int, default=DEFAULT_MIN_BYTES,
                   help=f"smallest message, bytes ({DEFAULT_MIN_BYTES // MiB} MiB)")
    p.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help=f"largest message, bytes ({DEFAULT_MAX_BYTES // MiB} MiB)")
    p.add_argument("--iters", type=int, help=f"timed repetitions per size ({DEFAULT_ITERS['cuda']} on GPU, "
                                              f"{DEFAULT_ITERS['cpu']} on CPU)")
    p.add_argument("--matmul-size", type=int, help=f"square matmul side ({DEFAULT_MATMUL_SIZE['cuda']} on GPU, "
                                                    f"{DEFAULT_MATMUL_SIZE['cpu']} on CPU)")
    p.add_argument("--no-health", action="store_true", help="skip the NVML hardware health check")
    p.add_argument("--cpu", action="store_true", help="use gloo on CPU even where GPUs exist")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def preflight_main(argv: Optional[list[str]] = None) -> int:
    """``lightning-hybrid preflight`` under torchrun (or alone as one process); 0 when everything passes."""
    import torch.distributed as dist

    args = build_parser().parse_args(argv)
    try:
        expected = _key_values(args.expected_busbw, "--expected-busbw")
    except ValueError as err:
        print(f"lightning-hybrid preflight: error: {err}", file=sys.stderr)
        return 2
    _default_to_one_process()
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world = int(os.environ["WORLD_SIZE"])
    try:
        dims = ParallelDims.resolve(args.tp, args.pp, args.dp, world,
                                    devices_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except ValueError as err:
        print(f"lightning-hybrid preflight: error: {err}", file=sys.stderr)
        return 2
    dist.init_process_group("nccl" if use_cuda else "gloo")
    try:
        mesh = build_mesh(dims, "cuda" if use_cuda else "cpu")
        report = run_preflight(mesh, args.gpu, expected, args.expected_p2p, args.expected_tflops,
                               args.expected_nvlinks, args.threshold, args.min_bytes, args.max_bytes, args.iters,
                               matmul_size=args.matmul_size, check_health=not args.no_health)
        if dist.get_rank() == 0:
            print(json.dumps(report.to_dict(), indent=1) if args.json else report.format_table(), flush=True)
            if not report.ok:
                print("preflight FAILED:\n" + "\n".join(f"  {f}" for f in report.failures), file=sys.stderr,
                      flush=True)
        dist.barrier()  # rank 0 has printed before any rank exits (torchrun stops the others on a failure)
        return 0 if report.ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(preflight_main())
