"""Where a curvature solve's vectors live across processes: each parameter's local part, and sums over all of them.

A solve holds parameter-sized vectors (the Lanczos vectors, the gradient at ``theta``, the step sizes) as the
concatenation of each parameter's *local* part: a sharded parameter's shard (a ``DTensor``, as FSDP2's
``fully_shard`` and tensor parallelism's ``parallelize_module`` make, on a device mesh or a sub-mesh of one that
spans every process, as FSDP2 + TP's 2-D layouts use), a plain parameter whole. So a sample's extra memory per
process is that of its shards, about ``1/N`` of the unsharded sample's. An element held by several processes (a
plain parameter under DDP, a ``Replicate`` placement such as a norm's weight under tensor parallelism, HSDP's
replicate dimension) is counted once in every inner product: each process weighs its part by ``1 / copies`` and the
partial sums are added across processes (one all-reduce of a few numbers).

The gradient a product reads is of the global batch the step trains on: a sharded model's backward reduces its
gradients itself (FSDP2 averages over its data-parallel processes); the plain parameters' parts are averaged across
processes here, as DDP's all-reduce does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from connmon._collectives import local, process_count, sum_over_processes
from connmon.curvature.lockstep import Lockstep


class Shards:
    """The layout of ``params`` across processes (one process: everything local, nothing to add).

    Args:
        params: the parameters a solve reads, in a fixed order (the optimizer's), the same on every process.

    Raises:
        ValueError: for a ``DTensor`` on a device mesh whose size does not divide the number of processes, or with a
            ``Partial`` placement (a parameter is never a pending sum).

    Examples:
        >>> import torch
        >>> from connmon.curvature.shards import Shards
        >>> params = [torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))]
        >>> shards = Shards(params)
        >>> shards.sizes, shards.dot(torch.ones(10), torch.full((10,), 2.0))
        ([6, 4], 20.0)
    """

    def __init__(self, params: Sequence[Tensor]) -> None:
        self.params = list(params)
        self.world = process_count()
        self.sharded = any(isinstance(p, DTensor) for p in self.params)
        self.copies: list[int] = []  # how many processes hold each local element of parameter i
        for p in self.params:
            if not isinstance(p, DTensor):
                self.copies.append(self.world)
                continue
            mesh = p.device_mesh
            if self.world % mesh.size():
                raise ValueError(
                    f"a parameter is sharded over a device mesh of {mesh.size()} of the {self.world} processes; "
                    "connmon reads meshes whose size divides the number of processes (sub-meshes of one mesh)"
                )
            copies = self.world // mesh.size()  # a sub-mesh's parameter is held alike along the other dimensions
            for dim, placement in enumerate(p.placements):
                if placement.is_partial():
                    raise ValueError(f"a parameter has a Partial placement ({p.placements}): not a parameter's layout")
                if placement.is_replicate():
                    copies *= mesh.size(dim)
            self.copies.append(copies)
        self.sizes = [local(p).numel() for p in self.params]
        self.plain = [i for i, p in enumerate(self.params) if not isinstance(p, DTensor)]
        device = local(self.params[0]).device if self.params else torch.device("cpu")
        self.lockstep = Lockstep(self.world, device)  # checked before each of the collectives below

    def dot(self, x: Tensor, y: Tensor) -> float:
        """``<x, y>`` of two flat vectors of local parts, each global element counted once (float64)."""
        return float(self.dots(x.unsqueeze(0), y.unsqueeze(0))[0])

    def dots(self, x: Tensor, y: Tensor) -> Tensor:
        """``(R,)`` inner products of the rows of two ``(R, N)`` flat vectors of local parts, added across processes."""
        if len(set(self.copies)) <= 1:
            total = (x * y).sum(dim=-1, dtype=torch.float64) / (self.copies[0] if self.copies else 1)
        else:
            total = sum(
                (a * b).sum(dim=-1, dtype=torch.float64) / copies
                for a, b, copies in zip(x.split(self.sizes, -1), y.split(self.sizes, -1), self.copies, strict=True)
            )
        if self.world > 1:
            self.lockstep.check()
            sum_over_processes(total)
        return total

    def start(self, seed: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """``(1, N)``: the local parts of one global random vector, the same whatever the layout (``seed``'s).

        Each parameter's part is drawn whole, in order, from one generator (one parameter at a time in host memory)
        and its local part kept, so every process, sharded or not, starts Lanczos from the same global vector.
        """
        generator = torch.Generator().manual_seed(seed)
        parts = []
        for p in self.params:
            whole = torch.randn(tuple(p.shape), generator=generator, dtype=dtype)
            if isinstance(p, DTensor):
                from torch.distributed.tensor import distribute_tensor

                on_mesh = whole.to(p.device_mesh.device_type)
                whole = distribute_tensor(on_mesh, p.device_mesh, p.placements, src_data_rank=None).to_local()
            parts.append(whole.reshape(-1).to(device))
        return torch.cat(parts).unsqueeze(0)

    def squares(self, parts: Sequence[Tensor]) -> float:
        """``sum_i ||parts[i]||^2`` over every global element once, ``parts[i]`` the local part of parameter ``i``."""
        total = torch.zeros((), dtype=torch.float64, device=parts[0].device if parts else None)
        for part, copies in zip(parts, self.copies, strict=True):
            total = total + part.double().square().sum() / copies
        if self.world > 1:
            self.lockstep.check()
            sum_over_processes(total)
        return float(total)

    def average_plain(self, flat: Tensor) -> None:
        """Average the plain parameters' parts of a flat gradient across processes, in place (as DDP does)."""
        if self.world == 1 or not self.plain:
            return
        pieces = flat.split(self.sizes)
        plain = [pieces[i] for i in self.plain]
        buffer = torch.cat(plain)
        self.lockstep.check()
        sum_over_processes(buffer)
        offset = 0
        for piece in plain:
            piece.copy_(buffer[offset : offset + piece.numel()]).div_(self.world)
            offset += piece.numel()
