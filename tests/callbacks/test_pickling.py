"""Every callback, connmon.Monitor and SharpnessSampler pickle and deepcopy, before and after a fit.

``strategy="ddp_spawn"`` pickles the callbacks into its processes (tests/callbacks/test_ddp.py runs one), and
Lightning deep-copies callbacks in places; neither may fail on connmon's state.
"""

from __future__ import annotations

import copy
import pickle

import lightning as L
import torch

import connmon
from connmon.alerts import AlertRunner, RestorePoints
from connmon.callbacks import ConnectionMonitor, DriftAlert, SharpnessMonitor
from connmon.curvature.sampler import SharpnessSampler
from tests.callbacks.ddp_run import next_token_loss
from tests.callbacks.lightning_models import LitGPT, loader
from tests.capture.models import TinyGPT


def round_trips(objects: list) -> None:
    for thing in objects:
        for copied in (pickle.loads(pickle.dumps(thing)), copy.deepcopy(thing)):
            assert type(copied) is type(thing)
            assert copied.state_dict().keys() == thing.state_dict().keys()


def test_the_lightning_callbacks_pickle_and_deepcopy_before_and_after_a_fit(tmp_path):
    callbacks = [
        ConnectionMonitor(every_n_steps=2, diagnostics=("walk",)),
        SharpnessMonitor(next_token_loss, every_n_steps=2, cadence="fixed", budget=None),
        DriftAlert(actions=("log", "backoff", "checkpoint"), restore_points=RestorePoints(dirpath=tmp_path)),
    ]
    round_trips(callbacks)
    trainer = L.Trainer(
        max_steps=4, callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, accelerator="cpu",
    )  # fmt: skip
    trainer.fit(LitGPT(), loader())
    assert callbacks[0].samples == 2 and callbacks[1].sampler.samples == 1
    round_trips(callbacks)


def test_monitor_and_sampler_pickle_and_deepcopy_before_and_after_training():
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = SharpnessSampler(every_n_steps=2, cadence="fixed", budget=None)
    monitor = connmon.Monitor(
        model, every_n_steps=2, diagnostics=("walk",), optimizer=optimizer, sharpness=sampler, log=None,
        loss_fn=next_token_loss, alerts=AlertRunner(actions=("log", "backoff")),
    )  # fmt: skip
    round_trips([monitor, sampler])
    ids = torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(0))
    for step in range(4):
        with monitor.step(step, batch=(ids, ids)):
            loss = next_token_loss(model, (ids, ids))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert monitor.samples == 2 and sampler.samples == 1
    round_trips([monitor, sampler])
    monitor.close()
    round_trips([monitor, sampler])
