"""connmon inside OLMo-core's own Trainer: a tiny OLMo-2 model (SDPA, RoPE, QK-norm), generated tokens, on CPU.

OLMo-core 3.0.0 and transformers >= 5.25 need different ``huggingface_hub`` majors, so these tests carry the
``olmo_core`` marker: the default run deselects them and ``.ci/run`` runs them in an environment of their own with
the ``olmo-core`` extra (``python -m pytest -m olmo_core tests/integrations/test_olmo_core.py``).
"""

from __future__ import annotations

import copy
import json
import os
import warnings

import numpy as np
import pytest
import torch

import connmon
from connmon.alerts import AlertRunner, logit_bound_rule

pytestmark = pytest.mark.olmo_core

VOCAB, LENGTH, SEQUENCES = 128, 16, 4  # 4 sequences a step, 2 micro-batches of 2


class Recorder:
    """What OLMo-core hands its loggers (console, W&B, Comet) at each step: the metrics as they would be logged."""

    def __new__(cls):
        from olmo_core.train.callbacks import Callback

        class _Recorder(Callback):
            def __init__(self) -> None:
                self.rows: dict[int, dict[str, float]] = {}

            def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
                self.rows.setdefault(step, {}).update({k: float(v) for k, v in metrics.items()})

        return _Recorder()


def build_trainer(
    tmp_path,
    callbacks: dict,
    steps: int = 5,
    data_parallel: bool = False,
    z_loss: float | None = None,
    load=None,
    qk_norm: bool = True,
    scheduler=None,
    device: str = "cpu",
    backend: str | None = None,
):
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

    tokens = np.random.default_rng(0).integers(1, VOCAB, size=64 * LENGTH * SEQUENCES, dtype=np.uint16)
    tokens.tofile(tmp_path / "tokens.npy")
    tokenizer = TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0)
    dataset = NumpyFSLDatasetConfig(paths=[str(tmp_path / "tokens.npy")], sequence_length=LENGTH,
                                    tokenizer=tokenizer, work_dir=str(tmp_path / "dataset")).build()  # fmt: skip
    loader = NumpyDataLoaderConfig(global_batch_size=SEQUENCES * LENGTH, seed=0, num_workers=0,
                                   work_dir=str(tmp_path / "loader")).build(dataset)  # fmt: skip
    torch.manual_seed(0)
    if qk_norm:  # OLMo-2: QK-norm
        model = TransformerConfig.olmo2_1M(vocab_size=VOCAB, attn_backend=backend).build(init_device=device)
    else:
        model = TransformerConfig.llama_like(d_model=32, vocab_size=VOCAB, n_layers=2, n_heads=4).build(
            init_device="cpu"
        )
    sharded = TransformerDataParallelConfig(name="fsdp") if data_parallel else None  # FSDP2 over the processes
    autocast = torch.bfloat16 if backend == "flash_2" else None  # flash-attn takes bf16 and fp16 only
    config = TransformerTrainModuleConfig(rank_microbatch_size=2 * LENGTH, max_sequence_length=LENGTH,
                                          optim=AdamWConfig(lr=1e-2), dp_config=sharded, z_loss_multiplier=z_loss,
                                          scheduler=scheduler, autocast_precision=autocast)  # fmt: skip
    module = config.build(model, device=torch.device(device))  # initializes the weights
    initial = None if data_parallel else copy.deepcopy(module.model)  # FSDP2 modules do not deepcopy
    trainer = TrainerConfig(save_folder=str(tmp_path / "save"), max_duration=Duration.steps(steps),
                            metrics_collect_interval=1, save_overwrite=True, load_path=load)  # fmt: skip
    trainer = trainer.build(module, loader)
    for name, callback in callbacks.items():
        trainer.add_callback(name, callback)
    return trainer, initial


def first_batch(tmp_path) -> dict:
    """The first batch OLMo-core's loader hands the trainer (a fresh trainer over the same files and seed)."""
    trainer, _ = build_trainer(tmp_path, {})
    trainer.data_loader.reshuffle(1)  # what the trainer does for its first epoch
    return next(iter(trainer.data_loader))


def test_the_callback_logs_what_connmon_reads_of_the_same_forward_and_training_is_bitwise_unchanged(tmp_path):
    from connmon.integrations.olmo_core import ConnectionMonitorCallback

    (tmp_path / "plain").mkdir()
    plain, _ = build_trainer(tmp_path / "plain", {})
    plain.fit()
    (tmp_path / "watched").mkdir()
    recorder = Recorder()
    callback = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk", "transport"), optimizer_every_n_steps=1)
    watched, initial = build_trainer(tmp_path / "watched", {"connmon": callback, "recorder": recorder})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        watched.fit()
    assert [str(w.message) for w in caught if "connmon" in str(w.message)] == []  # no layer skipped, nothing said
    for a, b in zip(plain.train_module.model.parameters(), watched.train_module.model.parameters(), strict=True):
        assert torch.equal(a, b)  # bitwise, with the capture armed on steps 1, 3 and 5
    sampled = sorted(step for step, row in recorder.rows.items() if "connmon/attention_entropy/all" in row)
    assert sampled == [1, 3, 5]  # the states after 0, 2 and 4 optimizer steps, at OLMo-core's step numbers
    assert all(f"connmon/max_logit_bound/L{layer:02d}" in recorder.rows[5] for layer in range(4))
    assert all(key in recorder.rows[3] for key in ("connmon/update_rms", "connmon/stale_second_moment"))  # its AdamW
    # the same forward (the first micro-batch of step 1, the initial weights) read by a plain connmon.Monitor
    (tmp_path / "reference").mkdir()
    batch = first_batch(tmp_path / "reference")
    logged: dict[str, float] = {}
    reference = connmon.Monitor(initial, every_n_steps=2, diagnostics=("walk", "transport"),
                                log=lambda values, step: logged.update(values))  # fmt: skip
    with reference.step(0):
        initial(batch["input_ids"][:2])
    reference.close()
    keys = [key for key in logged if key.startswith(("connmon/attention_entropy", "connmon/head_isometry_gap"))]
    assert len(keys) >= 8
    for key in keys:
        assert recorder.rows[1][key] == pytest.approx(logged[key], rel=1e-5), key


def test_an_alert_at_the_stop_level_cancels_the_run_on_its_step(tmp_path):
    from connmon.integrations.olmo_core import ConnectionMonitorCallback

    alerts = AlertRunner([logit_bound_rule(bound=0.0, level="ERROR")], actions=("log", "stop"))
    callback = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk",), alerts=alerts)
    trainer, _ = build_trainer(tmp_path, {"connmon": callback}, steps=8)
    with pytest.warns(UserWarning, match="logit"):
        trainer.fit()
    assert trainer.is_canceled and trainer.global_step == 1  # the sample of step 0 alerted; no second step ran


def test_the_monitors_state_round_trips_through_the_callback(tmp_path):
    from connmon.integrations.olmo_core import ConnectionMonitorCallback

    callback = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk",))
    trainer, _ = build_trainer(tmp_path, {"connmon": callback}, steps=3)
    trainer.fit()
    fresh = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk",))
    fresh.load_state_dict(callback.state_dict())
    assert repr(fresh.state_dict()) == repr(callback.state_dict()) and callback.monitor.samples == 2


def fsdp_worker(rank: int, port: int, out: str, watched: bool, curvature: bool = False) -> None:
    """One arm on one process (OLMo-core builds its world mesh once per process): its weights and logged rows."""
    from pathlib import Path

    import torch.distributed as dist

    from connmon.curvature.sampler import SharpnessSampler
    from connmon.integrations.olmo_core import ConnectionMonitorCallback
    from tests.gloo import leave

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")  # fmt: skip
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        recorder = Recorder()
        callbacks = {"recorder": recorder}
        if watched:
            sampler = SharpnessSampler(every_n_steps=2, cadence="fixed", budget=None) if curvature else None
            callbacks["connmon"] = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk",), sharpness=sampler)
        folder = Path(out) / f"{watched}"
        folder.mkdir(exist_ok=True)
        trainer, _ = build_trainer(folder, callbacks, steps=3, data_parallel=True, z_loss=1e-3 if curvature else None)
        trainer.fit()
        local = [p.to_local() if hasattr(p, "to_local") else p for p in trainer.train_module.model.parameters()]
        torch.save([w.detach().clone() for w in local], Path(out) / f"weights{rank}-{watched}.pt")
        rows = {step: {k: v for k, v in row.items() if k.startswith("connmon/")} for step, row in recorder.rows.items()}
        (Path(out) / f"rows{rank}-{watched}.json").write_text(json.dumps(rows))
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


@pytest.mark.distributed
def test_two_processes_with_olmo_cores_fsdp_train_bitwise_and_log_the_same_synced_sample(tmp_path):
    """OLMo-core's FSDP over 2 gloo processes (its data loader splits the global batch): training bitwise as without
    connmon on every process (each its own shards), the samples of steps 0 and 2 synced across them (each process
    records its own first micro-batch), every layer read."""
    from tests.gloo import free_port, spawn

    for watched in (False, True):
        spawn(fsdp_worker, args=(free_port(), str(tmp_path), watched), nprocs=2, timeout=300)
    for rank in range(2):
        plain, monitored = (torch.load(tmp_path / f"weights{rank}-{w}.pt") for w in (False, True))
        assert all(torch.equal(a, b) for a, b in zip(plain, monitored, strict=True))
    rows = [json.loads((tmp_path / f"rows{rank}-True.json").read_text()) for rank in range(2)]
    sampled = {step: row for step, row in rows[0].items() if "connmon/attention_entropy/all" in row}
    assert sorted(sampled) == ["1", "3"]
    assert all(f"connmon/attention_entropy/L{layer:02d}" in sampled["1"] for layer in range(4))
    for step, row in sampled.items():
        for key, value in row.items():
            if key.startswith("connmon/attention_entropy"):
                assert rows[1][step][key] == pytest.approx(value, rel=1e-6), (step, key)


def test_the_docs_page_runs_as_pasted(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "olmo_core.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(code, "docs/olmo_core.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert trainer.global_step == 6 and trainer.callbacks["connmon"].monitor.samples == 3


def test_the_curvature_reads_the_loss_the_step_trains_on_z_loss_and_every_micro_batch_included(tmp_path):
    """The Lanczos ratio logged at a sampled step is :func:`connmon.curvature.sharpness_ratio` of the step's loss
    written here from OLMo-core's definition (cross-entropy and z-loss summed over tokens, over the step's token
    count, both micro-batches), read at the same point (after the backward); that loss is what OLMo-core logs."""
    from olmo_core.train.callbacks import Callback

    from connmon.curvature import sharpness_ratio
    from connmon.curvature.sampler import SharpnessSampler
    from connmon.integrations.olmo_core import ConnectionMonitorCallback

    class Direct(Callback):
        priority = 1  # before connmon's at pre_optim_step: both read the gradients the step left

        def __init__(self) -> None:
            self.losses: list = []
            self.reading = None

        def pre_step(self, batch):
            if self.trainer.global_step == 3:  # the step after 2 optimizer steps
                ids = batch["input_ids"].clone()
                labels = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
                tokens = (labels != -100).sum()
                model = self.trainer.train_module.model

                def loss(rows: slice):
                    logits = model(ids[rows]).float()
                    ce = torch.nn.functional.cross_entropy(
                        logits.flatten(0, 1), labels[rows].flatten(), reduction="sum"
                    )
                    z = 1e-3 * logits.logsumexp(-1).pow(2)[labels[rows] != -100].sum()
                    return (ce + z) / tokens

                self.losses = [lambda: loss(slice(0, 2)), lambda: loss(slice(2, 4))]

        def pre_optim_step(self):
            if self.losses:
                optimizer = self.trainer.train_module.optim
                self.reading = sharpness_ratio(self.losses, optimizer, steps=8, model=self.trainer.train_module.model,
                                               seed=2, weights=[1.0, 1.0])  # fmt: skip
                self.at_start = float(sum(loss() for loss in self.losses))
                self.losses = []

    recorder, direct = Recorder(), Direct()
    sampler = SharpnessSampler(every_n_steps=2, cadence="fixed", budget=None)
    callback = ConnectionMonitorCallback(every_n_steps=1000, diagnostics=("walk",), sharpness=sampler)
    trainer, _ = build_trainer(tmp_path, {"connmon": callback, "direct": direct, "recorder": recorder}, steps=4,
                               z_loss=1e-3)  # fmt: skip
    trainer.fit()
    ratios = {
        step: row["connmon/sharpness_ratio"] for step, row in recorder.rows.items() if "connmon/sharpness_ratio" in row
    }
    assert sorted(ratios) == [3] and direct.reading is not None
    assert ratios[3] == pytest.approx(direct.reading.ratio, rel=1e-4)
    logged = recorder.rows[3]["train/CE loss"] + recorder.rows[3]["train/Z loss"]
    assert direct.at_start == pytest.approx(logged, rel=1e-4)  # the loss written here is the one OLMo-core trained on


def test_a_restore_point_is_olmo_cores_own_checkpoint_and_resumes_as_the_uninterrupted_run(tmp_path):
    """An alert with the "checkpoint" action at the sample of step 0 saves OLMo-core's checkpoint after step 1 (the
    model, the optimizer, the data loader, connmon's state); a run loaded from it trains and logs bitwise as the
    uninterrupted one."""
    from pathlib import Path

    from connmon.alerts import RestorePoints
    from connmon.integrations.olmo_core import ConnectionMonitorCallback

    def monitored(folder: Path, load=None):
        folder.mkdir()
        alerts = AlertRunner([logit_bound_rule(bound=0.0, level="WARN", cooldown=1000)], actions=("log", "checkpoint"),
                             restore_points=RestorePoints(level="WARN"))  # fmt: skip
        recorder = Recorder()
        callback = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk",), alerts=alerts)
        trainer, _ = build_trainer(folder, {"connmon": callback, "recorder": recorder}, steps=5, load=load)
        with pytest.warns(UserWarning):
            trainer.fit()
        return trainer, recorder, callback

    whole, whole_rows, whole_callback = monitored(tmp_path / "whole")
    point = tmp_path / "whole" / "save" / "step1"
    assert whole_callback.monitor.alerts.restore_points.paths == [str(point)] and point.is_dir()
    resumed, resumed_rows, _ = monitored(tmp_path / "resumed", load=str(point))
    for a, b in zip(whole.train_module.model.parameters(), resumed.train_module.model.parameters(), strict=True):
        assert torch.equal(a, b)
    for step in (3, 5):  # the samples after the restore point, as the uninterrupted run logged them
        keys = [k for k in whole_rows.rows[step] if k.startswith("connmon/attention_entropy")]
        assert keys and all(resumed_rows.rows[step][k] == whole_rows.rows[step][k] for k in keys)


def test_qk_clip_scales_the_heads_above_its_threshold_after_each_optim_step(tmp_path):
    """A model without QK-norm (OLMo-core's llama-like, RoPE): heads past tau are clipped in the optimizer's post-hook
    (the training then differs from a run without the clip) and the clips are logged."""
    from connmon.alerts import QKClip
    from connmon.integrations.olmo_core import ConnectionMonitorCallback

    clip, recorder = QKClip(threshold=1e-3), Recorder()  # OLMo-core initializes small: logits of about 1e-2
    alerts = AlertRunner([], actions=("qk_clip",), qk_clip=clip)
    callback = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk",), alerts=alerts)
    trainer, _ = build_trainer(tmp_path, {"connmon": callback, "recorder": recorder}, steps=3, qk_norm=False)
    with pytest.warns(UserWarning, match="QK-clip at step"):
        trainer.fit()
    assert clip.clipped > 0 and "connmon/qk_clips/L00" in recorder.rows[3]
    (tmp_path / "plain").mkdir()
    plain, _ = build_trainer(tmp_path / "plain", {}, steps=3, qk_norm=False)
    plain.fit()
    clipped = dict(trainer.train_module.model.named_parameters())
    unclipped = dict(plain.train_module.model.named_parameters())
    assert any(not torch.equal(clipped[n], unclipped[n]) for n in clipped if ".w_q." in n)  # the clip acted


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_forward_that_raises_on_a_sampled_step_leaves_no_hook_on_the_model(tmp_path, error):
    """OLMo-core calls ``on_error`` and ``close`` on the way out: the partial sample is dropped, every hook removed."""
    from connmon.integrations.olmo_core import ConnectionMonitorCallback

    callback = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk",))
    trainer, _ = build_trainer(tmp_path, {"connmon": callback}, steps=5)
    model = trainer.train_module.model
    head, forwards = model.lm_head, []

    def broken(module, args, output):
        forwards.append(1)
        if len(forwards) == 5:  # the first micro-batch of the third step (the sample of the state after 2 steps)
            raise error("out of memory, say")

    handle = head.register_forward_hook(broken)  # after the attention layers ran, inside the armed forward
    with pytest.raises(error):
        trainer.fit()
    handle.remove()
    assert callback.monitor.samples == 1 and not callback.monitor.is_armed  # step 0's; the failed one dropped
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_the_backoff_scales_each_step_under_olmo_cores_scheduler_and_leaves_its_rates_alone(tmp_path):
    """The rate OLMo-core's scheduler sets for each step, times the back-off's scale inside ``optim_step`` only."""
    from olmo_core.optim import CosWithWarmup
    from olmo_core.train.callbacks import Callback

    from connmon.alerts import LearningRateBackoff
    from connmon.integrations.olmo_core import ConnectionMonitorCallback

    seen: dict[int, list[float]] = {}

    class Rates(Callback):  # hooks registered after connmon's: the rate inside the step, and the group's after it
        def post_train_batch(self) -> None:
            optimizer = self.trainer.train_module.optim
            if self.trainer.global_step == 1:
                optimizer.register_step_pre_hook(
                    lambda o, *_: seen.setdefault(self.step(), []).append(o.param_groups[0]["lr"])
                )
                optimizer.register_step_post_hook(lambda o, *_: seen[self.step()].append(o.param_groups[0]["lr"]))

        def step(self) -> int:
            return self.trainer.global_step

    rule = logit_bound_rule(bound=0.0, level="WARN", cooldown=100)
    alerts = AlertRunner([rule], actions=("backoff",), backoff=LearningRateBackoff(cooldown=100, rules=(rule.name,)))
    callback = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk",), alerts=alerts)
    scheduler = CosWithWarmup(warmup_steps=2)
    (tmp_path / "backed").mkdir()
    trainer, _ = build_trainer(tmp_path / "backed", {"connmon": callback, "rates": Rates()}, steps=5,
                               scheduler=scheduler)  # fmt: skip
    with pytest.warns(UserWarning, match="learning rate is scaled by 0.5"):
        trainer.fit()
    assert alerts.backoff.scale == 0.5 and alerts.backoff.last_step == 0  # the first sample's alert, before step 1
    backed, seen = dict(seen), {}
    (tmp_path / "plain").mkdir()
    plain, _ = build_trainer(tmp_path / "plain", {"rates": Rates()}, steps=5, scheduler=CosWithWarmup(warmup_steps=2))
    plain.fit()
    assert sorted(backed) == sorted(seen) == [2, 3, 4, 5] and len({after for _, after in seen.values()}) == 4
    for step, (inside, after) in backed.items():
        assert after == seen[step][1] == seen[step][0] > 0, step  # the scheduler's own rate, untouched
        assert inside == pytest.approx(0.5 * after), step  # scaled inside the step only


@pytest.mark.distributed
def test_the_curvature_under_olmo_cores_fsdp_reads_the_global_batch_as_one_process_does(tmp_path):
    """2 gloo processes with OLMo-core's FSDP (each process half the batch, its own shards): the Lanczos ratio of the
    step after 2 optimizer steps is the same on both, and that of one process training on the whole batch."""
    from connmon.curvature.sampler import SharpnessSampler
    from connmon.integrations.olmo_core import ConnectionMonitorCallback
    from tests.gloo import free_port, spawn

    spawn(fsdp_worker, args=(free_port(), str(tmp_path), True, True), nprocs=2, timeout=300)
    rows = [json.loads((tmp_path / f"rows{rank}-True.json").read_text()) for rank in range(2)]
    ratios = [{step: row["connmon/sharpness_ratio"] for step, row in r.items() if "connmon/sharpness_ratio" in row}
              for r in rows]  # fmt: skip
    recorder = Recorder()
    sampler = SharpnessSampler(every_n_steps=2, cadence="fixed", budget=None)
    callback = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk",), sharpness=sampler)
    (tmp_path / "one").mkdir()
    one, _ = build_trainer(tmp_path / "one", {"connmon": callback, "recorder": recorder}, steps=3, z_loss=1e-3)
    one.fit()
    alone = {str(step): row["connmon/sharpness_ratio"] for step, row in recorder.rows.items()
             if "connmon/sharpness_ratio" in row}  # fmt: skip
    assert list(ratios[0]) == list(alone) == ["3"] and ratios[0] == ratios[1]
    assert ratios[0]["3"] == pytest.approx(alone["3"], rel=1e-3)


def test_the_rules_see_olmo_cores_own_logged_metrics(tmp_path):
    """A sample's rules see the metrics OLMo-core logged last (the step before), beside connmon's keys."""
    from connmon.alerts import Rule, Threshold
    from connmon.integrations.olmo_core import ConnectionMonitorCallback

    seen: list = []
    rules = [Rule("loss seen", "train/CE loss", Threshold(-1.0), cooldown=1),
             Rule("perplexity seen", "train/PPL", Threshold(-1.0), cooldown=1)]  # fmt: skip
    callback = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk",),
                                         alerts=AlertRunner(rules, on_alert=seen.append, actions=("log",)))  # fmt: skip
    recorder = Recorder()
    trainer, _ = build_trainer(tmp_path, {"connmon": callback, "recorder": recorder}, steps=5)
    with pytest.warns(UserWarning, match="loss seen"):
        trainer.fit()
    losses = [(a.step, a.value) for a in seen if a.rule == "loss seen"]
    # the samples of the states after 2 and 4 steps (OLMo-core's steps 3 and 5) see its steps 2 and 4's rows
    assert losses == [(2, pytest.approx(recorder.rows[2]["train/CE loss"])),
                      (4, pytest.approx(recorder.rows[4]["train/CE loss"]))]  # fmt: skip
    assert [a.step for a in seen if a.rule == "perplexity seen"] == [2, 4]


def _has_flash_attn_2() -> bool:
    from olmo_core.nn.attention import FlashAttention2Backend

    try:
        FlashAttention2Backend.assert_supported()
    except RuntimeError:
        return False
    return True


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: benchmarks/gpu.sh runs it")


@pytest.mark.parametrize(
    ("device", "backend"),
    [("cpu", "torch"), pytest.param("cuda", "torch", marks=CUDA), pytest.param("cuda", "flash_2", marks=CUDA)],
)
def test_each_attention_backend_is_read_exactly_or_skipped_with_one_line_and_training_is_unchanged(
    tmp_path, device, backend
):
    """SDPA (its ``torch`` backend) is read exactly on every device; flash-attn's kernels (bf16 autocast, which they
    need) are skipped, said once."""
    from connmon.integrations.olmo_core import ConnectionMonitorCallback

    if backend == "flash_2" and not _has_flash_attn_2():
        pytest.skip("flash-attn is not installed on this machine")
    runs = {}
    for name in ("plain", "again", "watched"):
        (tmp_path / name).mkdir()
        recorder = Recorder()
        callbacks = {"recorder": recorder}
        if name == "watched":
            callbacks["connmon"] = ConnectionMonitorCallback(every_n_steps=2, diagnostics=("walk",))
        trainer, _ = build_trainer(tmp_path / name, callbacks, device=device, backend=backend)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit()
        said = [str(w.message) for w in caught if "connmon" in str(w.message) or "skip" in str(w.message)]
        weights = [p.detach().float().cpu() for p in trainer.train_module.model.parameters()]
        runs[name] = (weights, recorder.rows, said)
    plain, again, (watched, rows, said) = runs["plain"][0], runs["again"][0], runs["watched"]
    spread = max((a - b).abs().max().item() for a, b in zip(plain, again, strict=True))  # 0 where deterministic
    assert max((a - b).abs().max().item() for a, b in zip(plain, watched, strict=True)) <= spread
    sampled = {step: row for step, row in rows.items() if "connmon/attention_entropy/all" in row}
    if backend == "torch":
        assert said == [] and sorted(sampled) == [1, 3, 5]
        assert all(row["connmon/reconstruction_error/all"] < 1e-4 for row in sampled.values())
    else:  # not SDPA calls: nothing is read, and why is said once per layer
        assert sampled == {} and said and all("flash" in line.lower() or "skip" in line for line in said)
