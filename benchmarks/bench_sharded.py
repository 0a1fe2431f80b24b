"""What a curvature sample costs per process on a sharded model: FSDP2 and tensor parallelism against one process.

The test model (``tests/capture/models.py``'s TinyGPT at width ``--width``, 4 blocks, float32, AdamW) trains for
``--steps`` steps with ``connmon.Monitor`` and ``SharpnessSampler(every_n_steps=4, cadence="fixed")`` (gradient
differences, the defaults otherwise) in a plain loop, three ways: one process on the whole batch; FSDP2
(``fully_shard`` per block and on the root) on 2 gloo processes, each on half the batch; tensor parallelism (each
block's MLP column- then row-sharded) on 2 processes, each on the whole batch. Per process it prints:

* a sample's time in training steps of the same run (the mean step without a sample);
* the gradients a sample took (each one forward and backward of the step's batch);
* the solve's parameter-sized buffers (six: the parameter copy, the gradient at ``theta``, the step-size root and
  Lanczos's three vectors) in bytes on this process: its shards' elements times 6 times 4;
* what a sample moves beyond a training step's own collectives: per gradient, one all-reduce of the plain
  (unsharded) parameters' gradient parts (none when every parameter is sharded) and, per inner product, one
  all-reduce of a float64 (FSDP2's own gathers and reduce-scatters run in each gradient as in a training step);
  the checkpoints that keep a failure on one process from leaving another waiting (one-number all-reduces,
  ``connmon/curvature/lockstep.py``) are in the sample's time;
* the default restore point at the end of the run (``write_restore_point``: ``torch.save`` on rank zero for one
  process, ``torch.distributed.checkpoint`` sharded): the bytes this process wrote and the time to write it.

Usage:
    python benchmarks/bench_sharded.py            # about a minute on 2 cores
    python benchmarks/bench_sharded.py --width 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import connmon
from connmon.alerts.restore import write_restore_point
from connmon.curvature import step_geometry
from connmon.curvature.sampler import SharpnessSampler
from connmon.curvature.shards import Shards

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.capture.models import TinyGPT
from tests.gloo import free_port, leave

BATCH, TOKENS = 16, 64


def loss_fn(model, ids):
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def run(layout: str, rank: int, world: int, width: int, steps: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(vocab=256, n_embd=width, n_head=4, n_layer=4)
    if layout == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    elif layout == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = SharpnessSampler(every_n_steps=4, cadence="fixed")
    monitor = connmon.Monitor(
        model, every_n_steps=10**9, diagnostics=("walk",), optimizer=optimizer, sharpness=sampler, loss_fn=loss_fn,
        log=lambda values, step: None,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    share = BATCH // world if layout == "fsdp2" else BATCH  # tensor parallel: every process reads the whole batch
    seconds = []
    for step in range(steps):
        whole = torch.randint(0, 256, (BATCH, TOKENS), generator=generator)
        ids = whole[rank * share : (rank + 1) * share] if layout == "fsdp2" else whole
        spent = sampler.clock.spent
        begin = time.perf_counter()
        with monitor.step(step, batch=ids):
            loss = loss_fn(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append((time.perf_counter() - begin, sampler.clock.spent - spent))
    monitor.close()
    folder = tempfile.mkdtemp() if rank == 0 else None
    if world > 1:
        shared = [folder]
        dist.broadcast_object_list(shared)
        folder = shared[0]
    path = os.path.join(folder, "step=0.ckpt")
    begin = time.perf_counter()
    write_restore_point(path, steps, model, optimizer, monitor.state_dict())
    if world > 1:
        dist.barrier()
    restore_seconds = time.perf_counter() - begin
    if os.path.isdir(path):  # torch.distributed.checkpoint: each process's shards in its own files
        mine = [f for f in os.listdir(path) if f.startswith(f"__{rank}_")]
        restore_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in mine)
    else:
        restore_bytes = os.path.getsize(path) if rank == 0 else 0
    quiet = [total for total, sampled in seconds[1:] if sampled == 0]
    shards = Shards(step_geometry(optimizer).params)
    plain = sum(shards.sizes[i] for i in shards.plain) if world > 1 else 0
    return {
        "layout": layout,
        "rank": rank,
        "sample_steps": sampler.clock.spent / max(sampler.samples, 1) / (sum(quiet) / len(quiet)),
        "gradients": sampler.gradients / max(sampler.samples, 1),
        "buffer_bytes": 6 * 4 * sum(shards.sizes),
        "plain_bytes_per_gradient": 4 * plain,
        "off": sampler.off,
        "restore_bytes": restore_bytes,
        "restore_seconds": restore_seconds,
    }


def worker(rank: int, port: int, out: str, layout: str, world: int, width: int, steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = run(layout, rank, world, width, steps)
    Path(out, f"{layout}{rank}.json").write_text(json.dumps(result))
    leave()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--steps", type=int, default=13)
    args = parser.parse_args()
    rows = [run("one process", 0, 1, args.width, args.steps)]
    with tempfile.TemporaryDirectory() as out:
        for layout in ("fsdp2", "tp"):
            mp.spawn(worker, args=(free_port(), out, layout, 2, args.width, args.steps), nprocs=2)
            rows += [json.loads(Path(out, f"{layout}{rank}.json").read_text()) for rank in range(2)]
    print(f"\nwidth {args.width}, 4 blocks, batch {BATCH} x {TOKENS}, float32, a sample every 4 steps\n")
    print(
        "| layout | process | sample (training steps) | gradients a sample | solve buffers | plain all-reduce "
        "| restore point written | its time |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['layout']} | {row['rank']} | {row['sample_steps']:.1f} | {row['gradients']:.1f} | "
            f"{row['buffer_bytes'] / 2**20:.2f} MiB | {row['plain_bytes_per_gradient'] / 2**10:.0f} KiB | "
            f"{row['restore_bytes'] / 2**20:.2f} MiB | {row['restore_seconds']:.3f} s |"
            + (f" off: {row['off']}" if row["off"] else "")
        )


if __name__ == "__main__":
    main()
