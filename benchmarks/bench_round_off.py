"""Gradient differences against exact Lanczos where the gradient nears its own float32 round-off.

The curvature's default estimator takes each Hessian product as ``(g(theta + h w) - g(theta)) / h``, with ``h`` set so
that the gradient changes by 1e-3 of its norm. That holds while the gradient stands far above its float32 round-off.
On a batch the model has nearly memorized the cross-entropy's gradient ``p - y`` is the difference of nearly equal
numbers: its round-off stays where the per-token terms put it while its norm falls, and the differences read high.

The model (issue 64, item 7): a GPT with vocabulary 50, width 32, 4 heads, 2 blocks of hand-written causal attention
(the query and key rows of each ``qkv`` weight times 3 after init), the input embedding tied to the output head,
AdamW at 1e-2, batches of 4 x 16 uniform random tokens (generator seed 1), a plain loop with
``SharpnessSampler(every_n_steps=2, cadence="fixed")``; each configuration is read with gradient differences and with
exact Lanczos (double backward) from the same start, and the table gives their quotient at steps 2, 4 and 6.
Configurations: the same batch every step or a fresh one; next-token targets or the tokens themselves (a copy task,
memorized within a few steps). Then, on the memorized batch after 4 steps, the float32 gradient against float64:
each parameter's round-off over its gradient's norm.

Usage:
    python benchmarks/bench_round_off.py        # about a minute on 2 cores
"""

from __future__ import annotations

import itertools
import math
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import connmon
from connmon.curvature.sampler import SharpnessSampler
from tests.callbacks.test_sharpness_monitor import HandWrittenAttention
from tests.capture.models import TinyGPT


def build() -> nn.Module:
    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        block.attn = HandWrittenAttention()
        with torch.no_grad():
            block.attn.c_attn.weight[:64] *= 3
    model.head = nn.Linear(32, 50, bias=False)
    model.head.weight = model.wte.weight
    return model


def loss_of(shift: bool):
    def loss_fn(model, ids):
        targets = ids.roll(-1, 1) if shift else ids
        logits = model(ids)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least, float64 kept
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return loss_fn


def batches(fixed: bool, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(0, 50, (4, 16), generator=gen)
    return [first if fixed or step == 0 else torch.randint(0, 50, (4, 16), generator=gen) for step in range(steps)]


def ratios(estimator: str, fixed: bool, shift: bool, steps: int = 7) -> dict[int, float]:
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_fn, read = loss_of(shift), {}
    key = "connmon/sharpness_ratio"
    monitor = connmon.Monitor(
        model, attention=False, optimizer=optimizer, loss_fn=loss_fn,
        sharpness=SharpnessSampler(every_n_steps=2, cadence="fixed", estimator=estimator),
        log=lambda values, step: key in values and read.update({step: values[key]}),
    )  # fmt: skip
    for step, ids in enumerate(batches(fixed, steps)):
        with monitor.step(step, batch=ids):
            loss = loss_fn(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    monitor.close()
    return read


def round_off() -> list[tuple[str, float, float]]:
    """Each parameter's ``||g32 - g64|| / ||g64||`` and ``||g64||`` on the memorized batch after 4 steps."""
    model, loss_fn = build(), loss_of(shift=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    (ids,) = batches(fixed=True, steps=1)
    for _ in range(4):
        loss_fn(model, ids).backward()
        optimizer.step()
        optimizer.zero_grad()
    wide = build().double()
    wide.load_state_dict({name: value.double() for name, value in model.state_dict().items()})
    narrow = torch.autograd.grad(loss_fn(model, ids), list(model.parameters()))
    exact = torch.autograd.grad(loss_fn(wide, ids), list(wide.parameters()))
    return [(name, float((a.double() - b).norm() / b.norm()), float(b.norm()))
            for (name, _), a, b in zip(model.named_parameters(), narrow, exact, strict=True)]  # fmt: skip


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| batch | targets | gradient differences / exact: step 2 | step 4 | step 6 | exact ratio at 2, 4, 6 |")
    print("|---|---|---|---|---|---|")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for fixed, shift in itertools.product([True, False], [True, False]):
            differences = ratios("finite_difference_lanczos", fixed, shift)
            exact = ratios("exact_lanczos", fixed, shift)
            quotients = " | ".join(f"{differences[s] / exact[s]:.4f}" for s in (2, 4, 6))
            values = ", ".join(f"{exact[s]:.3g}" for s in (2, 4, 6))
            print(f"| {'the same' if fixed else 'fresh'} | {'next token' if shift else 'the tokens'} | {quotients} | "
                  f"{values} |")  # fmt: skip
    rows = round_off()
    relative = sorted(r for _, r, _ in rows)
    total = math.sqrt(sum(norm**2 for _, _, norm in rows))
    tied = {name: r for name, r, _ in rows}["wte.weight"]
    print(f"\nthe memorized batch after 4 steps: gradient norm {total:.3g}; each parameter's float32 round-off over "
          f"its gradient's norm: {relative[0]:.2g} to {relative[-1]:.2g} (median {relative[len(relative) // 2]:.2g}); "
          f"tied wte.weight {tied:.2g}")  # fmt: skip


if __name__ == "__main__":
    main()
