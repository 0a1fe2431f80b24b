"""Reading and writing a layer's head slices of a parameter, on this process's part of a sharded one.

A head's slice is its ``rows`` along one dimension of a weight (:class:`connmon.capture.max_logit.Projection`). Under
tensor parallelism ``rows`` count in this process's part (its own heads, whole); under FSDP2 they count in the whole
parameter, of which a process holds a range along the shard dimension.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from connmon._collectives import local as local_tensor


@dataclass
class HeadClipCount:
    """A step action (a clip): it acts after every optimizer step, not in answer to an alert.

    :class:`connmon.alerts.step_clips.StepClips` drives it; it keeps how many head clips so far and the latest step's,
    and the count in a checkpoint (under ``state_key`` in :meth:`connmon.alerts.AlertRunner.state_dict`).
    """

    name: ClassVar[str]  # as in AlertRunner's actions
    state_key: ClassVar[str]

    clipped: int = field(default=0, kw_only=True)
    last: list[tuple] = field(default_factory=list, kw_only=True)

    def counted(self, clips: list[tuple]) -> list[tuple]:
        """Add one step's clips to the count; return them."""
        self.clipped += len(clips)
        self.last = clips
        return clips

    def state_dict(self) -> dict[str, Any]:
        """The clip count."""
        return {"clipped": self.clipped}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved."""
        self.clipped = state_dict.get("clipped", 0)


def local_part(parameter: Tensor, local: bool) -> tuple[Tensor, list[int]]:
    """This process's part of ``parameter`` and where it starts in the whole (per dimension; zeros when whole)."""
    mesh = getattr(parameter, "device_mesh", None)  # a DTensor: this process's part
    data = local_tensor(parameter)
    if local or mesh is None or data.shape == parameter.shape:
        return data, [0] * data.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = getattr(parameter, "placements")  # noqa: B009
    _, offsets = compute_local_shape_and_global_offset(parameter.shape, mesh, placements)
    return data, list(offsets)


def _held(parameter: Tensor, rows: Tensor, dim: int, local: bool) -> tuple[Tensor, list[int], Tensor] | None:
    """This process's part, where it starts, and which of ``rows`` it holds (a mask); None if it holds none."""
    data, offsets = local_part(parameter, local)
    at = rows.to(data.device) - offsets[dim]
    keep = (at >= 0) & (at < data.shape[dim])
    return (data, offsets, keep) if bool(keep.any()) else None


def scale_rows(parameter: Tensor, rows: Tensor, factors: Tensor, dim: int, local: bool) -> None:
    """``parameter[rows] *= factors`` along ``dim``, in place, on this process's part (no collective)."""
    held = _held(parameter, rows, dim, local)
    if held is None:
        return
    data, offsets, keep = held
    index, factor = rows.to(data.device)[keep] - offsets[dim], factors.to(data.device)[keep].to(data.dtype)
    shape = [1] * data.dim()
    shape[dim] = -1
    data.index_copy_(dim, index, data.index_select(dim, index) * factor.view(shape))


def read_rows(parameter: Tensor, rows: Tensor, dim: int, local: bool) -> Tensor:
    """``parameter``'s ``rows`` along ``dim`` (whole along the other dimensions), a copy.

    A parameter sharded over the processes (FSDP2) is gathered whole first: a collective, every process calls it.
    """
    mesh = getattr(parameter, "device_mesh", None)
    if mesh is None:
        data = parameter.detach()
    elif local:
        data = local_tensor(parameter)
    else:
        data = getattr(parameter, "full_tensor")()  # noqa: B009
    return data.index_select(dim, rows.to(data.device)).clone()


def write_rows(parameter: Tensor, rows: Tensor, values: Tensor, dim: int, local: bool) -> None:
    """``parameter[rows] = values`` along ``dim`` (``values`` shaped as :func:`read_rows` returns), on this part."""
    held = _held(parameter, rows, dim, local)
    if held is None:
        return
    data, offsets, keep = held
    values = values.to(data.device, data.dtype)[(slice(None),) * dim + (keep,)]
    for other in range(data.dim()):
        if other != dim:
            values = values.narrow(other, offsets[other], data.shape[other])
    data.index_copy_(dim, rows.to(data.device)[keep] - offsets[dim], values)
