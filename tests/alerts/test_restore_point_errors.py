"""A restore point that cannot be loaded raises one documented Exception naming the path and what is wrong."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from connmon.alerts import RestorePointError, load_restore_point, write_restore_point


def model_and_optimizer():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_a_truncated_one_file_restore_point_names_the_file_and_the_damage(tmp_path):
    model, optimizer = model_and_optimizer()
    path = str(tmp_path / "step=4.ckpt")
    write_restore_point(path, 4, model, optimizer, None)
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 2)
    with pytest.raises(RestorePointError, match=rf"{path}: not readable as a restore point .*truncated or damaged"):
        load_restore_point(path, *model_and_optimizer())
    try:  # what a resume script writes
        load_restore_point(path, *model_and_optimizer())
    except Exception as error:
        assert isinstance(error, ValueError)


def test_a_missing_or_foreign_file_or_another_model_is_named(tmp_path):
    with pytest.raises(RestorePointError, match="no such restore point"):
        load_restore_point(tmp_path / "step=1.ckpt", torch.nn.Linear(2, 2))
    torch.save([1, 2], tmp_path / "list.ckpt")
    with pytest.raises(RestorePointError, match=r"list\.ckpt: not a restore point \(it holds list"):
        load_restore_point(tmp_path / "list.ckpt", torch.nn.Linear(2, 2))
    model, optimizer = model_and_optimizer()
    write_restore_point(str(tmp_path / "step=2.ckpt"), 2, model, optimizer, None)
    with pytest.raises(RestorePointError, match="does not fit this model or optimizer"):
        load_restore_point(tmp_path / "step=2.ckpt", torch.nn.Linear(3, 3))


def test_a_torn_distributed_checkpoint_folder_is_an_exception_that_except_exception_catches(tmp_path):
    """torch.distributed.checkpoint's own failure is a BaseException (CheckpointException)."""
    model = model_and_optimizer()[0]
    folder = tmp_path / "step=6.ckpt"
    extra = io.BytesIO(pickle.dumps({"step": 6, "connmon": None}))
    dcp.save({"model": model.state_dict(), "extra": extra}, checkpoint_id=str(folder))  # one process, as a sharded
    assert load_restore_point(folder, model_and_optimizer()[0]) == 6
    shard = next(folder.glob("*.distcp"))
    with open(shard, "r+b") as file:
        file.truncate(os.path.getsize(shard) // 3)
    caught = None
    try:
        load_restore_point(folder, model_and_optimizer()[0])
    except Exception as error:  # a resume script's handler
        caught = error
    assert isinstance(caught, RestorePointError)
    assert str(folder) in str(caught) and "cannot be loaded" in str(caught) and "rank 0" in str(caught)
