"""connmon.Monitor in a plain DDP loop (2 CPU processes, gloo): the logged values equal one process over the
same sequences, and only rank zero logs."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import connmon
from connmon.metrics import DriftMetrics, TransportMetrics, WalkMetrics
from tests.capture.models import TinyGPT
from tests.gloo import free_port, leave, spawn

pytestmark = pytest.mark.distributed


def inputs(rank: int) -> torch.Tensor:
    return torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(100 + rank))


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(TinyGPT())
        logged = []
        monitor = connmon.Monitor(
            model, every_n_steps=1, diagnostics=("walk", "transport", "drift"), log=lambda v, step: logged.append(v)
        )
        with monitor.step(0):
            loss = model(inputs(rank)).pow(2).mean()
        loss.backward()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
            json.dump(logged, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def test_plain_ddp_loop_logs_synced_values_on_rank_zero_only(tmp_path):
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2)
    on_zero = json.loads((tmp_path / "rank0.json").read_text())
    assert json.loads((tmp_path / "rank1.json").read_text()) == []  # only rank zero logs
    (logged,) = on_zero
    torch.manual_seed(0)
    model = TinyGPT()
    groups = []
    for rank in range(2):
        metrics = [WalkMetrics(2), TransportMetrics(2, edge_samples=1, edge_queries=16), DriftMetrics(2)]
        for record in connmon.capture(model, inputs(rank)):
            for metric in metrics:
                metric.update(record)
        groups.append(metrics)
    checked = 0
    for mine, theirs in zip(*groups, strict=True):
        mine.merge_state(theirs)  # what the sum-reduction across ranks does
        for name, value in mine.compute().items():
            random_edges = name.startswith("edge_isometry_gap")  # samples edges and a probe at random
            if name.endswith("/all") and torch.isfinite(value) and not random_edges:
                assert logged[f"connmon/{name}"] == pytest.approx(value.item(), rel=1e-5, abs=1e-7), name
                checked += 1
    assert checked >= 10
    assert "connmon/edge_isometry_gap/all" in logged


def clip_worker(rank: int, port: int, out: str) -> None:
    """DDP with QK-clip: each process its own batch; the max logit read and the clip are the same everywhere."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from connmon.alerts import AlertRunner, QKClip
        from connmon.capture.max_logit import HeadMaxLogits

        alone = [dist.new_group([0]), dist.new_group([1])][rank]  # every process creates every group
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(TinyGPT())
        local = HeadMaxLogits([block.attn for block in model.module.blocks], ["L0", "L1"])  # this process's batch
        clip = QKClip(threshold=3.0)
        monitor = connmon.Monitor(model, every_n_steps=2, diagnostics=("walk",), log=lambda v, step: None,
                                  alerts=AlertRunner([], actions=("qk_clip",), qk_clip=clip))  # fmt: skip
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tables, clips = [], []
        for step in range(3):
            ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(10 * step + rank))
            with local.watching(), monitor.step(step):
                loss = model(ids).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            tables.append(local.read(group=alone).tolist())
            monitor.begin_step(step + 1)  # reads the step's max over both processes, and clips
            clips.append([list(c) for c in clip.last])
        weights = [p.detach().tolist() for p in model.parameters()]
        with open(os.path.join(out, f"clip{rank}.json"), "w") as file:
            json.dump({"tables": tables, "clips": clips, "weights": weights}, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def test_ddp_max_logit_is_the_max_over_processes_and_qk_clip_keeps_the_replicas_equal(tmp_path):
    mp.spawn(clip_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"clip{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the same clip on both replicas
    assert ranks[0]["clips"] == ranks[1]["clips"] and all(ranks[0]["clips"])
    for step in range(3):  # what was clipped is the max over both processes' batches
        both = torch.maximum(torch.tensor(ranks[0]["tables"][step]), torch.tensor(ranks[1]["tables"][step]))
        clipped = {(layer, head): logit for layer, head, logit in ranks[0]["clips"][step]}
        assert set(clipped) == {(i, h) for i in range(2) for h in range(4) if both[i, h] > 3.0}
        for (layer, head), logit in clipped.items():
            assert logit == pytest.approx(float(both[layer, head]), rel=1e-6)
        assert torch.equal(torch.tensor(ranks[0]["tables"][step]), torch.tensor(ranks[1]["tables"][step])) is False


def fsdp_clip_worker(rank: int, port: int, out: str) -> None:
    """FSDP2 with QK-clip: every process scales the rows its shard holds."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        model = TinyGPT()
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        monitor, clip = _clipping_monitor(model, threshold=3.0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        clips = _train_clipped(model, monitor, optimizer, clip, rank)
        weights = [p.full_tensor().detach().tolist() for p in model.parameters()]
        if rank == 0:
            with open(os.path.join(out, "fsdp.json"), "w") as file:
                json.dump({"clips": clips, "weights": weights}, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def _batches(step: int) -> list[torch.Tensor]:
    return [torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(10 * step + rank)) for rank in (0, 1)]


def _clipping_monitor(model, threshold: float) -> tuple:
    """A monitor with both clips: QK-clip at ``threshold`` and the transport clip at factor 1.5."""
    from connmon.alerts import AlertRunner, QKClip, TransportClip

    clips = QKClip(threshold=threshold), TransportClip(factor=1.5)
    runner = AlertRunner([], actions=("qk_clip", "transport_clip"), qk_clip=clips[0], transport_clip=clips[1])
    return connmon.Monitor(
        model, every_n_steps=2, diagnostics=("walk",), log=lambda v, step: None, alerts=runner
    ), clips


def _train_clipped(model, monitor, optimizer, clip, rank: int | None) -> list:
    """Three steps; per step, each clip's ``[layer, head]`` pairs."""
    clips = []
    for step in range(3):
        batches = _batches(step)
        ids = torch.cat(batches) if rank is None else batches[rank]
        with monitor.step(step):
            loss = model(ids).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.begin_step(step + 1)
        clips.append([[[c[0], c[1]] for c in action.last] for action in clip])
    return clips


def test_fsdp2_qk_and_transport_clips_change_each_shard_as_one_process_changes_the_whole_model(tmp_path):
    mp.spawn(fsdp_clip_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    sharded = json.loads((tmp_path / "fsdp.json").read_text())
    torch.manual_seed(0)
    model = TinyGPT()  # one process, the two processes' batches together
    monitor, clip = _clipping_monitor(model, threshold=3.0)
    clips = _train_clipped(model, monitor, torch.optim.AdamW(model.parameters(), lr=1e-2), clip, None)
    assert sharded["clips"] == clips and all(qk and transport for qk, transport in clips)
    for (name, whole), parts in zip(model.named_parameters(), sharded["weights"], strict=True):
        parts, whole = torch.tensor(parts), whole.detach()
        if name.endswith("c_attn.bias"):  # the key bias has no gradient (a constant per query): Adam steps on noise
            parts, whole = torch.cat([parts[:32], parts[64:]]), torch.cat([whole[:32], whole[64:]])
        # AdamW after a reduction in another order; a clip missing on one shard would leave its rows 10-40% off
        torch.testing.assert_close(parts, whole, rtol=1e-3, atol=1e-4)


def one_sided(model):
    """Heads 0 and 1 of every layer (process 0's under tensor parallelism) sharpened far past the others."""
    with torch.no_grad():
        for block in model.blocks:
            block.attn.wq.weight[:16] *= 3
            block.attn.wk.weight[:16] *= 3
    return model


def tp_clip_worker(rank: int, port: int, out: str, threshold: float, sided: bool) -> None:
    """Tensor parallelism: each process reads its own heads (the same batch) and scales its own rows."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from tests.capture.models import SplitGPT, tensor_parallel

        torch.manual_seed(0)
        model = SplitGPT()
        model = tensor_parallel(one_sided(model) if sided else model, init_device_mesh("cpu", (2,)))
        monitor, clip = _clipping_monitor(model, threshold=threshold)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        clips = _train_clipped(model, monitor, optimizer, clip, None)  # the same batch on both processes
        weights = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist() for p in model.parameters()]
        counts = [action.clipped for action in clip]
        with open(os.path.join(out, f"tp{rank}.json"), "w") as file:
            json.dump({"clips": clips, "weights": weights, "counts": counts}, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


# one-sided: only process 0's heads pass tau, and off the exact-read steps only its bound crosses it, so only it
# reads a step's table exactly; both processes must still decide together that the step was read
@pytest.mark.parametrize(("threshold", "sided"), [(6.0, False), (40.0, True)], ids=["both", "one-sided"])
def test_tensor_parallel_qk_and_transport_clips_change_each_processs_heads_as_one_process_changes_them_all(
    tmp_path, threshold, sided
):
    from tests.capture.models import SplitGPT

    spawn(tp_clip_worker, args=(free_port(), str(tmp_path), threshold, sided), nprocs=2, timeout=300)
    ranks = [json.loads((tmp_path / f"tp{rank}.json").read_text()) for rank in range(2)]
    torch.manual_seed(0)
    model = SplitGPT()
    monitor, clip = _clipping_monitor(one_sided(model) if sided else model, threshold=threshold)
    clips = _train_clipped(model, monitor, torch.optim.AdamW(model.parameters(), lr=1e-2), clip, None)
    assert all(qk and transport for qk, transport in clips)
    if sided:
        assert all(head < 2 for step in clips for layer, head in step[0])  # process 0's heads alone are clipped
    for action in range(2):  # every process names the model's clips: its heads 0, 1 are the model's 2 r, 2 r + 1
        whole = [sorted(map(list, step[action])) for step in clips]
        assert all([sorted(step[action]) for step in r["clips"]] == whole for r in ranks)
    assert all(r["counts"] == [action.clipped for action in clip] for r in ranks)  # the model's count
    for whole, parts in zip(model.parameters(), ranks[0]["weights"], strict=True):
        torch.testing.assert_close(torch.tensor(parts), whole.detach(), rtol=1e-3, atol=1e-4)


def trainer_values_worker(rank: int, port: int, out: str) -> None:
    """Each process's own loss (of its own batch): the rules of every process see their mean, and decide alike."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from connmon.alerts import AlertRunner, Rule, Threshold

        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(TinyGPT())
        seen = []
        rules = [Rule("loss", "loss", Threshold(1.2), cooldown=1), Rule("own", "rank_zero_only", Threshold(0.0))]
        alerts = AlertRunner(rules, actions=(), on_alert=lambda alert: seen.append((alert.key, alert.value)))
        monitor = connmon.Monitor(model, every_n_steps=1, diagnostics=("walk",), alerts=alerts)
        mine = {"loss": 1.0 + rank, **({"rank_zero_only": 3.0} if rank == 0 else {}), "note": "not a number"}
        with monitor.step(0, rule_values=mine):
            model(inputs(rank)).pow(2).mean().backward()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
            json.dump(seen, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def test_the_rules_of_every_process_see_the_trainers_values_as_their_mean_over_processes(tmp_path):
    spawn(trainer_values_worker, args=(free_port(), str(tmp_path)), nprocs=2, timeout=120)
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert seen[0] == seen[1] == [["loss", 1.5], ["rank_zero_only", 3.0]]
