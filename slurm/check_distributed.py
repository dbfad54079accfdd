#!/usr/bin/env python3
"""Check a Slurm allocation's distributed wiring with the exact flags slurm/launch_task.sh gives.

    srun -N 2 --ntasks-per-node 8 slurm/launch_task.sh python slurm/check_distributed.py
    srun -n 2 slurm/launch_task.sh --cpu python slurm/check_distributed.py     # CPU, gloo

Every task joins one process group through ``--distributed-init-method`` with its
``--distributed-rank`` and ``--distributed-world-size`` (what fairseq-train does with
``--distributed-no-spawn``), all-reduces its rank + 1 and checks the sum is n(n+1)/2. Prints one
JSON line per task; exits 1 on a wrong sum. Run it before a long multi-node job: a wrong
MASTER_ADDR, a blocked port or a rank mix-up shows up here in seconds instead of as a hang.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from datetime import timedelta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--distributed-world-size", type=int, required=True, help="from launcher")
    parser.add_argument("--distributed-rank", type=int, default=0, help="from launcher")
    parser.add_argument("--device-id", type=int, default=0, help="from launcher (GPU index)")
    parser.add_argument("--distributed-init-method", default=None, help="from launcher")
    parser.add_argument("--distributed-no-spawn", action="store_true", help="from launcher")
    parser.add_argument("--cpu", action="store_true", help="from launcher: use gloo, no GPU")
    parser.add_argument("--distributed-backend", default="nccl", help="from launcher")
    parser.add_argument("--ddp-backend", default=None, help="from launcher (recorded only)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for peers")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    world = args.distributed_world_size
    init_method = args.distributed_init_method
    if world > 1 and init_method is None:
        print("check_distributed: world size > 1 but no --distributed-init-method", file=sys.stderr)
        return 2
    if init_method is None:  # one task: a private store on a free port exercises the same calls
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            init_method = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    device = torch.device("cpu")
    if not args.cpu:
        torch.cuda.set_device(args.device_id)
        device = torch.device("cuda", args.device_id)
    dist.init_process_group(
        args.distributed_backend,
        init_method=init_method,
        rank=args.distributed_rank,
        world_size=world,
        timeout=timedelta(seconds=args.timeout),
    )
    value = torch.tensor([float(dist.get_rank() + 1)], device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    report = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": value.item(),
        "expected": expected,
        "backend": dist.get_backend(),
        "init_method": init_method,
        "device_id": args.device_id,
        "host": socket.gethostname(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
    dist.destroy_process_group()
    print(json.dumps(report), flush=True)
    return 0 if value.item() == expected else 1


if __name__ == "__main__":
    sys.exit(main())
