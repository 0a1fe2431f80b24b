"""Attention whose heads are split across processes by tensor parallelism (2 CPU processes, gloo): not read yet, so
each such layer is skipped with one warning that says why, and the model computes exactly what it computes unarmed."""

from __future__ import annotations

import json
import os
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import connmon
from tests.gloo import free_port, leave


class SplitAttention(nn.Module):
    """torchtitan's layout: separate q, k, v and output projections, heads inferred from the (local) width."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.head_dim = d // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (w(x).view(b, n, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H / tp, n, head_dim)
        return self.wo(y.transpose(1, 2).reshape(b, n, -1))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SplitAttention() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        torch.manual_seed(0)
        net = Net()
        x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
        whole = {record.name for record in connmon.capture(net, x)}  # unsharded: every layer read
        plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()}
        mesh = init_device_mesh("cpu", (2,))
        for layer in net.layers:
            parallelize_module(layer, mesh, plan)
        with torch.no_grad():
            unarmed = net(x)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with connmon.capture.armed(net) as session:
                    armed = net(x)
        said = [str(w.message) for w in caught]
        result = {"whole": sorted(whole), "records": len(session.records), "said": said,
                  "equal": bool(torch.equal(armed, unarmed))}  # fmt: skip
        with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
            json.dump(result, file)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def test_tensor_parallel_attention_is_skipped_with_one_warning_per_layer_and_computes_as_unarmed(tmp_path):
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2)
    zero = json.loads((tmp_path / "rank0.json").read_text())
    assert zero["whole"] == ["layers.0", "layers.1"] and zero["records"] == 0 and zero["equal"]
    assert len(zero["said"]) == 2  # one warning per layer, each naming it and the reason
    for index, line in enumerate(zero["said"]):
        assert line.startswith(f"connmon: layers.{index} is not recorded: ") and "tensor parallelism" in line
