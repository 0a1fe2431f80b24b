"""What a monitor's checkpoint holds, checked before it is restored: a malformed part starts afresh, said once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from connmon._ranks import warn_rank_zero


def checked_state(state_dict: object, config: Mapping[str, Any], owner: str) -> dict[str, Any] | None:
    """``state_dict`` (a :meth:`connmon.Monitor.state_dict`) with each part that cannot be restored set to its default.

    A cadence count that is not an integer, time-drift references that are malformed or were saved under another
    ``config`` (walks of another shape) are dropped, and one warning names each and why; a state that is not a
    mapping is not restored at all (None).

    Examples:
        >>> import warnings
        >>> from connmon._saved_state import checked_state
        >>> saved = {"samples": 3, "drift": {"walks": {}, "transports": {}}, "config": {"max_tokens": 128}}
        >>> checked_state(saved, {"max_tokens": 128}, "doc")["samples"]
        3
        >>> with warnings.catch_warnings(record=True) as said:
        ...     checked = checked_state(saved, {"max_tokens": 256}, "doc")
        >>> checked["drift"], "max_tokens 128 -> 256" in str(said[0].message)
        (None, True)
    """
    if not isinstance(state_dict, Mapping):
        warn_rank_zero(f"{owner}: the saved state is a {type(state_dict).__name__}, not a dict: not restored")
        return None
    state, dropped = dict(state_dict), []
    for key, default in (("samples", 0), ("last_sampled_step", -1), ("full_every_n_samples", None)):
        value = state.get(key, default)
        if (value is not None or default is not None) and (isinstance(value, bool) or not isinstance(value, int)):
            dropped.append(f"{key}={value!r} (not an integer)")
            state[key] = default
    if state.get("drift") is not None and not is_drift_state(state["drift"]):
        dropped.append("the time-drift references (malformed)")
        state["drift"] = None
    saved = state.get("config")
    if state.get("drift") is not None and saved is not None and saved != dict(config):
        changed = ", ".join(f"{k} {saved.get(k)!r} -> {v!r}" for k, v in config.items() if saved.get(k) != v)
        dropped.append(f"the time-drift references (saved with another configuration: {changed})")
        state["drift"] = None
    if dropped:
        warn_rank_zero(f"{owner}: not restored from the checkpoint: {'; '.join(dropped)}; they start afresh")
    return state


def is_drift_state(state: object) -> bool:
    """Whether ``state`` is what :meth:`DriftMetrics.get_extra_state` returns: layer index -> tensor, twice."""
    if not isinstance(state, Mapping):
        return False
    parts = [state.get("walks", {}), state.get("transports", {})]
    return all(
        isinstance(part, Mapping) and all(isinstance(k, int) and isinstance(v, Tensor) for k, v in part.items())
        for part in parts
    )
