"""Every collective connmon issues, each named for what it computes (nothing here without ``torch.distributed``).

All of them are collectives: every process of the group must call them at the same point, in the same order. Without
an initialized process group each returns its input as the whole answer (one process is every process).
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether a ``torch.distributed`` process group is initialized here.

    Examples:
        >>> from connmon._collectives import is_distributed
        >>> is_distributed()
        False
    """
    return dist.is_available() and dist.is_initialized()


def process_count() -> int:
    """How many processes the default group has (1 without an initialized ``torch.distributed``).

    Examples:
        >>> from connmon._collectives import process_count
        >>> process_count()
        1
    """
    return dist.get_world_size() if is_distributed() else 1


def process_rank() -> int:
    """This process's global rank (0 without an initialized ``torch.distributed``).

    Examples:
        >>> from connmon._collectives import process_rank
        >>> process_rank()
        0
    """
    return dist.get_rank() if is_distributed() else 0


def local(tensor: Tensor) -> Tensor:
    """A ``DTensor``'s local part (its storage), else the tensor itself (no collective).

    Examples:
        >>> import torch
        >>> from connmon._collectives import local
        >>> local(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None and hasattr(tensor, "device_mesh") else tensor


def sum_over_processes(tensor: Tensor, group: Any = None) -> Tensor:
    """``tensor`` summed over the processes of ``group`` (in place; a SUM all-reduce), and returned.

    Examples:
        >>> import torch
        >>> from connmon._collectives import sum_over_processes
        >>> sum_over_processes(torch.tensor([1.0, 2.0])).tolist()
        [1.0, 2.0]
    """
    if is_distributed():
        dist.all_reduce(tensor, group=group)
    return tensor


def max_over_processes(tensor: Tensor, group: Any = None) -> Tensor:
    """``tensor``'s elementwise largest over the processes of ``group`` (in place; a MAX all-reduce), and returned.

    Examples:
        >>> import torch
        >>> from connmon._collectives import max_over_processes
        >>> max_over_processes(torch.tensor([1.0, 2.0])).tolist()
        [1.0, 2.0]
    """
    if is_distributed():
        dist.all_reduce(tensor, dist.ReduceOp.MAX, group=group)
    return tensor


def largest_over_processes(*values: float, device: torch.device | str = "cpu") -> list[float]:
    """Each of ``values``' largest over all processes (one MAX all-reduce), so every process decides alike.

    Examples:
        >>> from connmon._collectives import largest_over_processes
        >>> largest_over_processes(0.5, 2.0)
        [0.5, 2.0]
    """
    if not is_distributed():
        return list(values)
    return max_over_processes(torch.tensor(values, dtype=torch.float64, device=device)).tolist()


def from_rank_zero(value: T) -> T:
    """Rank zero's ``value`` on every process (a broadcast of a picklable object): one decision for all.

    Examples:
        >>> from connmon._collectives import from_rank_zero
        >>> from_rank_zero("connmon_restore_points/step=8.ckpt")
        'connmon_restore_points/step=8.ckpt'
    """
    if not is_distributed():
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0)
    return shared[0]


def gathered(tensor: Tensor, group: Any = None) -> list[Tensor]:
    """``tensor`` of every process of ``group``, in rank order (each process's the same shape; an all-gather).

    Examples:
        >>> import torch
        >>> from connmon._collectives import gathered
        >>> [t.tolist() for t in gathered(torch.ones(2))]
        [[1.0, 1.0]]
    """
    if not is_distributed():
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def gathered_objects(value: T) -> list[T]:
    """``value`` of every process, in rank order (an all-gather of picklable objects).

    Examples:
        >>> from connmon._collectives import gathered_objects
        >>> gathered_objects("out of memory")
        ['out of memory']
    """
    if not is_distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


# --- uneven inputs under torch's Join ---------------------------------------------------------------------------------
#
# Inside ``Join`` (DDP's ``model.join()``, accelerate's ``join_uneven_inputs``) a process that ran out of data loops in
# ``Join.__exit__``, shadowing the collectives of its joinables (DDP's gradient all-reduces) and nothing else: any other
# collective the other processes issue pairs with one of those shadows and fails. Each forward of the first joinable
# counts the processes still training (its ``notify_join_context`` all-reduce); :func:`watch_joins` keeps that count,
# so connmon issues a collective only on a step every process took.

_joins: dict[str, Any] = {"watched": False, "seen": False, "count": None}


def watch_joins() -> None:
    """Keep the count of processes still training that each ``Join`` iteration takes (once per process; no collective).

    ``torch.distributed.algorithms.join.Join.notify_join_context`` is wrapped: it is called as before and its
    all-reduce's result is kept for :func:`processes_in_step`.

    Examples:
        >>> from connmon._collectives import joins_seen, watch_joins
        >>> watch_joins()
        >>> joins_seen()
        False
    """
    if _joins["watched"] or not dist.is_available():
        return
    from torch.distributed.algorithms.join import Join

    notify = Join.notify_join_context

    def counted(joinable: Any) -> Any:
        work = notify(joinable)
        if work is not None:
            _joins["seen"], _joins["count"] = True, work.get_future()
        return work

    Join.notify_join_context = staticmethod(counted)  # type: ignore[method-assign]
    _joins["watched"] = True


def joins_seen() -> bool:
    """Whether a forward ran inside a ``Join`` with uneven-input detection on, in this process (no collective).

    Examples:
        >>> from connmon._collectives import joins_seen
        >>> joins_seen()
        False
    """
    return bool(_joins["seen"])


def processes_in_step() -> int:
    """How many processes took the latest forward: fewer than :func:`process_count` once one ran out of data.

    Outside a ``Join`` (or before its first forward) every process (no collective: the count is the ``Join``'s own).

    Examples:
        >>> from connmon._collectives import processes_in_step
        >>> processes_in_step()
        1
    """
    count = _joins["count"]
    if count is None:
        return process_count()
    return int(count.wait()[0].item())
