"""The curvature of the global batch on sharded models: DDP, FSDP2 and tensor parallelism (2 CPU processes, gloo)
read what one process reads on the whole batch, and training with the sampler is bitwise the same run without it."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import connmon
from connmon.curvature.sampler import SharpnessSampler
from tests.capture.models import TinyGPT
from tests.gloo import free_port, leave

RATIO = "connmon/sharpness_ratio"
STEPS = 6


def loss_fn(model, ids):
    return torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())


def batches(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 50, (4, 10), generator=generator) for _ in range(STEPS)]


def train(
    model, data: list[list[torch.Tensor]], watched: bool, expect_on: bool = True
) -> tuple[list[float], dict[int, float]]:
    """AdamW on ``data[step]`` (the step's micro-batches, each loss its mean over them); the logged ratios."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logged: dict[int, float] = {}
    monitor = None
    if watched:
        monitor = connmon.Monitor(
            model, every_n_steps=10**6, diagnostics=("walk",), optimizer=optimizer, loss_fn=loss_fn,
            sharpness=SharpnessSampler(every_n_steps=2, cadence="fixed", budget=None),
            log=lambda values, step: RATIO in values and logged.update({step: values[RATIO]}),
        )  # fmt: skip
    losses = []
    for step, micro_batches in enumerate(data):
        for ids in micro_batches:
            with monitor.step(step, batch=ids) if monitor is not None else contextlib.nullcontext():
                loss = loss_fn(model, ids) / len(micro_batches)
            loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    if monitor is not None:
        assert (monitor.sharpness.off is None) == expect_on, monitor.sharpness.off
        monitor.close()
    return losses, logged


def worker(rank: int, port: int, out: str, layout: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD[layout])
    try:
        runs = {}
        for watched in (False, True):
            torch.manual_seed(0)
            model = TinyGPT().double()
            if layout in ("fsdp2", "hsdp"):  # hsdp: shards over 2 processes, replicated over the other 2
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard

                mesh = (
                    init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if layout == "hsdp" else None
                )
                for block in model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
            elif layout in ("tp", "2d"):  # each block's MLP column- then row-sharded over "tp"; 2d: FSDP2 over "dp"
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import fully_shard
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                mesh = init_device_mesh("cpu", (WORLD[layout] // 2, 2), mesh_dim_names=("dp", "tp"))
                for block in model.blocks:
                    parallelize_module(block.mlp, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
                if layout == "2d":
                    for block in model.blocks:
                        fully_shard(block, mesh=mesh["dp"])
                    fully_shard(model, mesh=mesh["dp"])
            else:
                model = torch.nn.parallel.DistributedDataParallel(model)
            # tensor parallel: the ranks of one "tp" group read the same batch (rank // 2: its "dp" index)
            data = batches(rank // 2 if layout in ("tp", "2d") else rank)
            runs[watched] = train(model, [[ids] for ids in data], watched)
        with open(os.path.join(out, f"{layout}{rank}.json"), "w") as file:
            json.dump({"plain": runs[False][0], "watched": runs[True][0], "ratios": runs[True][1]}, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


# 2d: FSDP2 over 2 "dp" processes, each MLP over 2 "tp" ones; hsdp: FSDP2 sharding over 2, replicating over 2
WORLD = {"ddp": 2, "fsdp2": 2, "tp": 2, "2d": 4, "hsdp": 4}


@pytest.mark.distributed
@pytest.mark.parametrize("layout", list(WORLD))
def test_sharded_runs_read_the_global_batch_and_train_bitwise_unchanged(tmp_path, layout):
    mp.spawn(worker, args=(free_port(), str(tmp_path), layout), nprocs=WORLD[layout])
    ranks = [json.loads((tmp_path / f"{layout}{r}.json").read_text()) for r in range(WORLD[layout])]
    for rank in ranks:
        assert rank["watched"] == rank["plain"]  # bitwise, on every rank
    assert all(rank["ratios"] == {} for rank in ranks[1:]) and sorted(ranks[0]["ratios"]) == ["2", "4"]  # rank 0
    torch.manual_seed(0)
    data_parallel = 4 if layout == "hsdp" else 2
    whole = [list(step) for step in zip(*map(batches, range(data_parallel)), strict=True)]  # the global batch
    if layout == "tp":  # one "dp" group: the global batch is its one batch
        whole = [[ids] for ids in batches(0)]
    _, expected = train(TinyGPT().double(), whole, watched=True)
    for step, ratio in ranks[0]["ratios"].items():
        assert ratio == pytest.approx(expected[int(step)], rel=1e-4), step


class FailingBackward(torch.autograd.Function):
    """Identity forward; its backward raises (a failure inside a product's backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("injected failure in a backward")


def failing_at(call: int, where: str, model, ids):
    """A loss function that fails on its ``call``-th call, in its forward or its backward; and a call counter."""
    calls = [0]

    def loss():
        calls[0] += 1
        value = loss_fn(model, ids)
        if calls[0] == call:
            if where == "forward":
                raise RuntimeError("injected failure in a forward")
            value = FailingBackward.apply(value)
        return value

    return loss, calls


def state_of(model, optimizer) -> list[torch.Tensor]:
    """Everything a sample must leave bitwise: parameters (local parts), gradients, optimizer state, random stream."""
    from connmon._collectives import local

    tensors = [local(p).detach().clone() for p in model.parameters()]
    tensors += [local(p.grad).clone() for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [local(v).clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return [*tensors, torch.get_rng_state()]


def check_every_failure(model, optimizer, ids) -> int:
    """A sample that fails at each of its loss calls, forward or backward, leaves the state bitwise; the calls."""
    from connmon.curvature import sharpness_ratio

    counting, calls = failing_at(0, "forward", model, ids)
    sharpness_ratio(counting, optimizer, steps=3, model=model, seed=1)  # a ratio >= 0.5: the noise check's solves too
    total = calls[0]
    before = state_of(model, optimizer)
    for call in range(1, total + 1):
        for where in ("forward", "backward"):
            loss, _ = failing_at(call, where, model, ids)
            with pytest.raises(RuntimeError, match="injected failure"):
                sharpness_ratio(loss, optimizer, steps=3, model=model, seed=1)
            after = state_of(model, optimizer)
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), (call, where)
    return total


def prepared(model):
    """AdamW after two steps at a rate past the edge (the noise check runs), ``.grad`` of a third batch in place."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    ids = torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(7))
    for _ in range(3):
        optimizer.zero_grad()
        loss_fn(model, ids).backward()
        if len(optimizer.state) == 0 or _ == 1:
            optimizer.step()
    return optimizer, ids


def test_a_sample_that_fails_at_any_stage_leaves_parameters_gradients_optimizer_and_rng_bitwise():
    torch.manual_seed(0)
    model = TinyGPT().double()
    optimizer, ids = prepared(model)
    assert check_every_failure(model, optimizer, ids) > 4  # the base gradient, every product, the noise check's


def failing_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = TinyGPT().double()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer, ids = prepared(model)
        total = check_every_failure(model, optimizer, ids)  # both ranks fail at the same call (as FSDP2 needs)
        with open(os.path.join(out, f"failures{rank}.json"), "w") as file:
            json.dump(total, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


@pytest.mark.distributed
def test_under_fsdp2_a_sample_that_fails_at_any_stage_leaves_every_shard_and_gradient_bitwise(tmp_path):
    mp.spawn(failing_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    assert [json.loads((tmp_path / f"failures{r}.json").read_text()) > 4 for r in range(2)] == [True, True]


class Gained(torch.nn.Module):
    """The test GPT with a 63-token vocabulary behind a 3-element gain (the optimizer's first parameter)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(3))
        self.gpt = TinyGPT(vocab=63)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx) * self.gain.mean()


def one_rank_worker(rank: int, port: int, out: str, device: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from connmon.curvature import sharpness_ratio

        readings = []
        for sharded in (False, True):
            torch.manual_seed(0)
            model = Gained().double().to(device)  # a 3-element gain, then a 63-element bias: no multiples of 16
            if sharded:
                mesh = init_device_mesh(device, (1,))
                for block in model.gpt.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
            optimizer, ids = prepared(model)
            ids = ids.to(device)
            readings.append(sharpness_ratio(lambda m=model, i=ids: loss_fn(m, i), optimizer, model=model, seed=3).ratio)
        with open(os.path.join(out, "one_rank.json"), "w") as file:
            json.dump(readings, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


@pytest.mark.distributed
@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_a_one_rank_mesh_reads_what_the_unsharded_model_reads(tmp_path, device):
    """FSDP2 on a one-rank device mesh: the sharded path (DTensor shards, the model's own backward) in one process;
    benchmarks/gpu.sh runs it on CUDA, where the collectives are NCCL's. The Lanczos start vector is the same global
    vector whatever the layout (drawn parameter by parameter), also for parameters whose size is no multiple of 16,
    where one draw of the whole vector differs from per-parameter draws."""
    mp.spawn(one_rank_worker, args=(free_port(), str(tmp_path), device), nprocs=1)
    unsharded, sharded = json.loads((tmp_path / "one_rank.json").read_text())
    assert sharded == pytest.approx(unsharded, rel=1e-9)


def mixed_precision_worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        import warnings

        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        runs = {}
        for watched in (False, True):
            torch.manual_seed(0)
            model = TinyGPT()
            for block in model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                runs[watched] = train(model, [[ids] for ids in batches(rank)], watched, expect_on=False)
            runs[watched] += ([str(w.message) for w in seen if "off for the rest" in str(w.message)],)
        with open(os.path.join(out, f"mixed{rank}.json"), "w") as file:
            json.dump({"plain": runs[False][0], "watched": runs[True][0], "ratios": runs[True][1],
                       "warnings": runs[True][2]}, file)  # fmt: skip
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


@pytest.mark.distributed
def test_fsdp2_bf16_mixed_precision_turns_the_curvature_off_with_the_reason_and_trains_bitwise(tmp_path):
    """Under MixedPrecisionPolicy(param_dtype=bf16) every forward computes in bf16, where gradient differences are
    round-off (it read 0.271 for a float32 reading of 0.618): no reading, one warning that says why."""
    mp.spawn(mixed_precision_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"mixed{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["watched"] == rank["plain"] and rank["ratios"] == {}
    assert (
        len(ranks[0]["warnings"]) == 1 and "MixedPrecisionPolicy(param_dtype=torch.bfloat16)" in ranks[0]["warnings"][0]
    )
    assert ranks[1]["warnings"] == []


ALONG_THE_UPDATE = {"critical": "connmon/critical_sharpness_ratio", "difference": "connmon/update_sharpness_ratio"}


def train_critical(
    model, data: list[torch.Tensor], watched: bool, estimator: str = "critical"
) -> tuple[list[float], dict[int, float]]:
    """AdamW on ``data[step]``; with ``watched``, critical sharpness every 2nd step; the losses and the readings."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logged: dict[int, float] = {}
    two_looks = estimator == "two looks"  # critical every 2 steps, Lanczos every 4 and after each first look
    budget = estimator == "budget"  # critical after every step the budget affords
    monitor, key = None, ALONG_THE_UPDATE["critical" if two_looks or budget else estimator]
    if watched:
        if budget:
            sampler = SharpnessSampler(every_n_steps=1, cadence="fixed", estimator="critical", budget=0.9)
        elif two_looks:
            sampler = SharpnessSampler(every_n_steps=4, cadence="fixed", first_look_every_n_steps=2,
                                       first_look_trigger=0.0, budget=None)  # fmt: skip
        else:
            sampler = SharpnessSampler(every_n_steps=2, cadence="fixed", estimator=estimator, budget=None)  # type: ignore[arg-type]

        def log(values: dict, step: int) -> None:
            if key in values:
                logged[step] = values[key]
            if "connmon/sharpness_ratio" in values:  # the second look: its step, as a negative key
                logged[-step] = values["connmon/sharpness_ratio"]

        monitor = connmon.Monitor(model, attention=False, optimizer=optimizer, loss_fn=loss_fn, sharpness=sampler,
                                  log=log)  # fmt: skip
    losses = []
    for step, ids in enumerate(data):
        with monitor.step(step, batch=ids) if monitor is not None else contextlib.nullcontext():
            loss = loss_fn(model, ids)
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    if monitor is not None:
        assert monitor.sharpness.off is None, monitor.sharpness.off
        monitor.close()
    return losses, logged


def critical_worker(rank: int, port: int, out: str, layout: str, estimator: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        runs = {}
        for watched in (False, True):
            torch.manual_seed(0)
            model = TinyGPT().double()
            data = batches(rank)
            if layout == "fsdp2":
                from torch.distributed.fsdp import fully_shard

                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
            elif layout == "tp":  # each block's MLP column- then row-sharded; both processes read one batch
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                mesh = init_device_mesh("cpu", (2,))
                for block in model.blocks:
                    parallelize_module(block.mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
                data = batches(0)
            else:
                model = torch.nn.parallel.DistributedDataParallel(model)
            runs[watched] = train_critical(model, data, watched, estimator)
        with open(os.path.join(out, f"critical{rank}.json"), "w") as file:
            json.dump({"plain": runs[False][0], "watched": runs[True][0], "read": runs[True][1]}, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


@pytest.mark.distributed
@pytest.mark.parametrize("estimator", list(ALONG_THE_UPDATE))
@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "tp"])
def test_readings_along_the_update_of_a_sharded_run_are_the_global_batchs_and_training_is_bitwise_unchanged(
    tmp_path, layout, estimator
):
    """The critical step's line search takes the mean loss over the processes (the global batch's), the second
    difference is averaged across them: what one process reads on the whole batch (logged on rank zero). Under FSDP2
    every point's forward gathers the shards written for it, and training's next forward the restored ones."""
    mp.spawn(critical_worker, args=(free_port(), str(tmp_path), layout, estimator), nprocs=2)
    ranks = [json.loads((tmp_path / f"critical{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["watched"] == rank["plain"]  # bitwise, on every rank
    assert ranks[1]["read"] == {} and sorted(ranks[0]["read"]) == ["2", "4", "6"][: len(ranks[0]["read"])]
    assert len(ranks[0]["read"]) >= 2
    torch.manual_seed(0)
    whole = [torch.cat(pair) for pair in zip(batches(0), batches(1), strict=True)]  # the global batch
    if layout == "tp":  # one data-parallel group: its one batch
        whole = batches(0)
    _, expected = train_critical(TinyGPT().double(), whole, watched=True, estimator=estimator)
    for step, ratio in ranks[0]["read"].items():
        assert ratio == pytest.approx(expected[int(step)], rel=1e-6), step


def sharded_and_whole(tmp_path, layout: str, estimator: str) -> tuple[dict[int, float], dict[int, float]]:
    """Rank zero's readings of a 2-process run (training held bitwise on each rank) and one process's on the whole
    batch (TP: the one batch both processes read)."""
    mp.spawn(critical_worker, args=(free_port(), str(tmp_path), layout, estimator), nprocs=2)
    ranks = [json.loads((tmp_path / f"critical{r}.json").read_text()) for r in range(2)]
    for rank in ranks:
        assert rank["watched"] == rank["plain"]
    whole = batches(0) if layout == "tp" else [torch.cat(pair) for pair in zip(batches(0), batches(1), strict=True)]
    torch.manual_seed(0)
    _, expected = train_critical(TinyGPT().double(), whole, watched=True, estimator=estimator)
    return {int(step): ratio for step, ratio in ranks[0]["read"].items()}, expected


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "tp"])
def test_a_budget_affords_a_sharded_run_the_steps_it_affords_one_process_on_the_global_batch(tmp_path, layout):
    """Each reading's passes are their mean over the processes, so every process affords the same steps: those one
    process affords on the whole batch, the first reading priced before it is taken; training bitwise unchanged."""
    read, expected = sharded_and_whole(tmp_path, layout, "budget")
    assert sorted(read) == sorted(expected) and min(read) == 3  # 7 forwards (7/3 passes) priced at 90%: step 3
    for step, ratio in read.items():
        assert ratio == pytest.approx(expected[step], rel=1e-6), step


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "tp"])
def test_two_looks_of_a_sharded_run_read_the_first_look_of_the_global_batch_and_train_bitwise(tmp_path, layout):
    """Critical sharpness (the first look) as one process reads the whole batch; the Lanczos second look at the
    same steps as one process's (the step after each first look, once per 4 steps); training bitwise unchanged."""
    read, expected = sharded_and_whole(tmp_path, layout, "two looks")
    assert sorted(read) == sorted(expected) == [-3, 2, 4]  # STEPS = 6: first looks at 2 and 4, a second at 3
    for step in (s for s in read if s > 0):
        assert read[step] == pytest.approx(expected[step], rel=1e-6), step
