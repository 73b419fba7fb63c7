"""MinkUNet18 trained with DistributedDataParallel: one process per GPU, each rank its own scene.

    torchrun --standalone --nproc_per_node 2 examples/ddp_train.py            # two GPUs (NCCL)
    torchrun --standalone --nproc_per_node 1 examples/ddp_train.py            # one GPU: the time to compare
    torchrun --standalone --nproc_per_node 2 examples/ddp_train.py --device cpu --num-voxels 2000 --width 0.25

Each rank builds its own indoor room (seed --seed + rank), so the ranks hold different voxels and
different numbers of them, as with a sharded dataset; rank r trains on GPU r of its machine
(LOCAL_RANK). Batch norm uses the statistics of all ranks' voxels (`cst.convert_sync_batchnorm`;
`--batch-norm local` keeps each rank's own), DDP averages the gradients, and on the GPU the
convolutions run in fp16 under autocast.

Tuning across ranks: the tuner runs no collective, so ranks meeting different problems (their sizes
come from their own scenes) can never wait on each other inside it. Step 0 is a warm-up: forward
and backward under `no_sync()` (no gradient exchange running beside the measurements), in which
each rank compiles what its kernel cache lacks and tunes the problems its cache lacks, then the
gradients are dropped. `cst.share_tuning()`, one collective that every rank calls here, then gives
every rank the lowest rank's measurements for every problem any rank met, so all ranks choose the
same algorithms from step 1 on. Call it again after a step that met new problems (a new scene size).

A cold start is slow, not stuck: NVRTC compiles each missing kernel module (up to a few tens of
seconds each) on every rank at once, and the first batch-norm collective waits for the slowest rank
under --timeout-minutes (default 30; NCCL's own default is 10). `python -m cupysparse warmup`,
run once per machine before torchrun, compiles them ahead, and a shipped or populated tuning cache
leaves nothing to measure.

Rank 0 prints each step's loss (the mean over ranks) and wall time; at the end every rank's
parameters and gradients are compared with rank 0's (checksums): the script exits 1 if they differ.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from cupysparse.adapters import torch as cst
from cupysparse.adapters.torch.networks import MinkUNet18
from cupysparse.tuning.cache_file import default_cache
from cupysparse.scripts.demo import scene_tensor

LEARNING_RATE = 1e-2


class Segmentation(nn.Module):
    """Per-voxel logits of a sparse network, as a tensor (what DDP expects a forward to return)."""

    def __init__(self, network: nn.Module):
        super().__init__()
        self.network = network

    def forward(self, input: cst.SparseTensor) -> torch.Tensor:
        return self.network(input).features


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda: NCCL, one GPU per process; cpu: Gloo (auto: cuda when available)")
    parser.add_argument("--num-voxels", type=int, default=None, help="voxels per rank (default 200000, CPU 20000)")
    parser.add_argument("--width", type=float, default=1.0, help="channel width multiplier of MinkUNet18")
    parser.add_argument("--steps", type=int, default=5, help="training steps after the warm-up step")
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16",
                        help="convolution dtype on the GPU (autocast; the CPU computes in float32)")
    parser.add_argument("--batch-norm", choices=("sync", "local"), default="sync",
                        help="statistics over every rank's voxels (SparseSyncBatchNorm) or over each rank's own")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-minutes", type=float, default=30.0,
                        help="how long a collective waits for the other ranks (a cold start compiles kernels)")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this PyTorch sees no CUDA GPU")
    if args.num_voxels is None:
        args.num_voxels = 200_000 if args.device == "cuda" else 20_000
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    return args


def checksum(tensors, device) -> torch.Tensor:
    """Sum, position-weighted sum and largest magnitude of every value, in float64: equal tensors
    give equal checksums on GPUs of one kind, and a difference almost surely changes them."""
    flat = torch.cat([t.detach().double().flatten() for t in tensors])
    position = torch.arange(flat.numel(), dtype=torch.float64, device=device) / flat.numel()
    return torch.stack([flat.sum(), (flat * position).sum(), flat.abs().max()])


def same_on_every_rank(value: torch.Tensor) -> bool:
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value)
    return all(torch.equal(other, gathered[0]) for other in gathered)


def main(argv=None) -> int:
    args = parse_args(argv)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)  # before any collective: NCCL and the kernels follow it
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(minutes=args.timeout_minutes))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)

    scene, voxels, labels = scene_tensor("indoor", args.num_voxels, args.seed + rank, "cpu", "float32")
    coordinates = torch.from_numpy(voxels.coordinates).to(device)
    features = torch.from_numpy(voxels.features).to(device)
    target = torch.from_numpy(labels).to(device)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(counts, torch.tensor([len(voxels)], device=device))
    say(f"{world_size} ranks on {device.type}, voxels per rank {[int(c) for c in counts]}, MinkUNet18 width "
        f"{args.width:g}, {args.batch_norm} batch norm", flush=True)

    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = Segmentation(MinkUNet18(3, len(scene.class_names), args.width))
    if args.batch_norm == "sync":
        model = cst.convert_sync_batchnorm(model)
    model = model.to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    autocast = device.type == "cuda" and args.dtype != "float32"
    scaler = torch.amp.GradScaler("cuda", enabled=autocast and args.dtype == "float16")

    def loss_of_one_pass(validate: bool) -> torch.Tensor:
        # A new tensor each step, as a new batch would be: its kernel maps are built again.
        input = cst.SparseTensor(coordinates, features, validate=validate)
        with torch.autocast("cuda", dtype=getattr(torch, args.dtype), enabled=autocast):
            logits = model(input)
        return nn.functional.cross_entropy(logits.float(), target)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    begin = time.perf_counter()
    with model.no_sync():
        scaler.scale(loss_of_one_pass(validate=True)).backward()
    optimizer.zero_grad(set_to_none=True)
    synchronize()
    warmup_s = time.perf_counter() - begin
    stored = torch.tensor([cst.share_tuning()], device=device)
    dist.all_reduce(stored)
    say(f"warm-up step (compiling and tuning on each rank, no gradient exchange): {warmup_s:.1f} s; "
        f"tuning shared: {int(stored)} cache entries taken from other ranks", flush=True)

    step_seconds = []
    for step in range(args.steps):
        synchronize()
        begin = time.perf_counter()
        loss = loss_of_one_pass(validate=False)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        synchronize()
        step_seconds.append(time.perf_counter() - begin)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        say(f"step {step + 1}/{args.steps}  loss {float(mean_loss) / world_size:.4f}  "
            f"{step_seconds[-1] * 1e3:.1f} ms", flush=True)
    steady = statistics.median(step_seconds[1:] or step_seconds)
    say(f"median step time {steady * 1e3:.1f} ms on {world_size} rank(s) ({args.num_voxels:,} voxels each)")

    parameters = [p for p in model.parameters()]
    gradients_equal = same_on_every_rank(checksum([p.grad for p in parameters], device))
    parameters_equal = same_on_every_rank(checksum(parameters, device))
    say(f"ranks agree: gradients {'yes' if gradients_equal else 'NO'}, parameters "
        f"{'yes' if parameters_equal else 'NO'} ({sum(p.numel() for p in parameters):,} values)", flush=True)
    dist.destroy_process_group()
    return 0 if gradients_equal and parameters_equal else 1


if __name__ == "__main__":
    status = main()
    # Leave without the interpreter's teardown: after the process group is destroyed, the C++ side of
    # torch.distributed (Gloo on the CPU) aborted one rank in about one run of ten while its static
    # objects were destroyed ("terminate called without an active exception"), after every result was
    # printed. What the teardown would have saved is saved first: the tuning results and the output.
    default_cache().flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
