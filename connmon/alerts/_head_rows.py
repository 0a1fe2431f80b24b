"""Reading and writing a layer's head slices of a parameter, on this process's part of a sharded one.

A head's slice is its ``rows`` along one dimension of a weight (:class:`connmon.capture.max_logit.Projection`). Under
tensor parallelism ``rows`` count in this process's part (its own heads, whole); under FSDP2 they count in the whole
parameter, of which a process holds a range along the shard dimension.
"""

from __future__ import annotations

from torch import Tensor


def local_part(parameter: Tensor, local: bool) -> tuple[Tensor, list[int]]:
    """This process's part of ``parameter`` and where it starts in the whole (per dimension; zeros when whole)."""
    mesh = getattr(parameter, "device_mesh", None)  # a DTensor: this process's part
    data: Tensor = getattr(parameter, "to_local")() if mesh is not None else parameter  # noqa: B009
    if local or mesh is None or data.shape == parameter.shape:
        return data, [0] * data.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    placements = getattr(parameter, "placements")  # noqa: B009
    _, offsets = compute_local_shape_and_global_offset(parameter.shape, mesh, placements)
    return data, list(offsets)


def scale_rows(parameter: Tensor, rows: Tensor, factors: Tensor, dim: int, local: bool) -> None:
    """``parameter[rows] *= factors`` along ``dim``, in place, on this process's part (no collective)."""
    data, offsets = local_part(parameter, local)
    rows = rows.to(data.device) - offsets[dim]
    keep = (rows >= 0) & (rows < data.shape[dim])
    if not bool(keep.any()):
        return
    index, factor = rows[keep], factors.to(data.device)[keep].to(data.dtype)
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
        data = getattr(parameter, "to_local")()  # noqa: B009
    else:
        data = getattr(parameter, "full_tensor")()  # noqa: B009
    return data.index_select(dim, rows.to(data.device)).clone()


def write_rows(parameter: Tensor, rows: Tensor, values: Tensor, dim: int, local: bool) -> None:
    """``parameter[rows] = values`` along ``dim`` (``values`` shaped as :func:`read_rows` returns), on this part."""
    data, offsets = local_part(parameter, local)
    rows = rows.to(data.device) - offsets[dim]
    keep = (rows >= 0) & (rows < data.shape[dim])
    if not bool(keep.any()):
        return
    values = values.to(data.device, data.dtype)[(slice(None),) * dim + (keep,)]
    for other in range(data.dim()):
        if other != dim:
            values = values.narrow(other, offsets[other], data.shape[other])
    data.index_copy_(dim, rows[keep], values)
