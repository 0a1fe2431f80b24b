"""Which of connmon's files one sample runs code in: how far a reader follows one attention and one curvature sample.

A plain loop with ``connmon.Monitor`` (every diagnostic group, alerts with every action, the curvature sampler) takes
one sampled step; a tracer records every connmon file whose code runs from the start of ``monitor.step`` to the end of
``optimizer.step()``, split into the attention sample (the ``with monitor.step(...)`` block and its finish) and the
curvature sample (inside ``optimizer.step()``); and how often the attention sample crosses between the coordinator
(``monitor.py``) and the attention part (``attention_sampler.py``): the calls from one into the other. Run it on two
commits to compare the layouts.

    python benchmarks/files_a_sample_visits.py
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch import nn

import connmon
from connmon.alerts import AlertRunner

ROOT = Path(connmon.__file__).parent


def sampler() -> object:
    try:
        from connmon.curvature.sampler import SharpnessSampler
    except ImportError:  # before the curvature package
        from connmon.integrations.sharpness import SharpnessSampler
    return SharpnessSampler(every_n_steps=1, cadence="fixed", budget=None)


class Files:
    """A profile hook that collects the connmon files whose functions are called while it is on."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.crossings: dict[str, int] = {}  # "monitor.py -> attention_sampler.py.<function>": calls

    def __enter__(self) -> Files:
        sys.setprofile(self._call)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)

    def _call(self, frame: object, event: str, arg: object) -> None:
        if event == "call":
            path = Path(frame.f_code.co_filename)  # type: ignore[attr-defined]
            if path.is_relative_to(ROOT):
                self.seen.add(str(path.relative_to(ROOT.parent)))
                caller = frame.f_back  # type: ignore[attr-defined]
                pair = {Path(caller.f_code.co_filename).name if caller is not None else "", path.name}
                if path.parent == ROOT and pair == {"monitor.py", "attention_sampler.py"}:
                    callee = f"{path.name}.{frame.f_code.co_name}"  # type: ignore[attr-defined]
                    self.crossings[callee] = self.crossings.get(callee, 0) + 1


def main() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = [torch.randn(4, 8, 16) for _ in range(3)]
    runner = AlertRunner(actions=("log", "stop", "backoff", "checkpoint"))
    monitor = connmon.Monitor(
        model, every_n_steps=2, alerts=runner, optimizer=optimizer, sharpness=sampler(),
        loss_fn=lambda m, batch: m(batch).pow(2).mean(), full_every_n_samples=1,
    )  # fmt: skip
    attention, curvature = Files(), Files()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step, batch in enumerate(batches):
            traced = step == 2
            with attention if traced else Files():
                with monitor.step(step, batch=batch):
                    loss = model(batch).pow(2).mean()
                loss.backward()
            with curvature if traced else Files():
                optimizer.step()
            optimizer.zero_grad()
    monitor.close()
    print(f"connmon at {ROOT}")
    for name, files in (("an attention sample", attention.seen), ("a curvature sample", curvature.seen)):
        print(f"{name}: {len(files)} files")
        for path in sorted(files):
            print(f"    {path}")
    crossings = attention.crossings
    print(f"an attention sample crosses monitor.py <-> attention_sampler.py {sum(crossings.values())} times:")
    for callee, calls in sorted(crossings.items()):
        print(f"    {calls} x {callee}")


if __name__ == "__main__":
    main()
