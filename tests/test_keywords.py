"""Every option set is declared once, and its keyword twin (a TypedDict, what ``Unpack`` types) is held to it here.

PEP 692's ``**kwargs: Unpack[...]`` takes a TypedDict only, and no type checker derives one from a dataclass or a
signature, so each set of typed keywords repeats the names and types of the options it stands for: this one check
holds every pair to the same names and the same types, and the entry points to taking them by ``**keywords`` only.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, get_type_hints

import pytest

import connmon
from connmon.alerts.runner import AlertOptions, AlertRunner
from connmon.callbacks import ConnectionMonitor, DriftAlert, SharpnessMonitor
from connmon.callbacks.sharpness_monitor import SharpnessMonitorKeywords
from connmon.curvature.sampler import SharpnessKeywords, SharpnessSampler
from connmon.integrations.transformers import ConnectionMonitorCallback
from connmon.sampling import SamplingKeywords, SamplingOptions
from connmon.step_options import StepKeywords, StepOptions


def declared(options: Any, besides: tuple[str, ...] = ()) -> dict[str, Any]:
    """The options' names and types as declared: a dataclass's fields, or a constructor's parameters but ``besides``."""
    if dataclasses.is_dataclass(options):
        hints = get_type_hints(options)
        return {field.name: hints[field.name] for field in dataclasses.fields(options)}
    hints = get_type_hints(options.__init__)
    return {name: hints[name] for name in inspect.signature(options).parameters if name not in besides}


PAIRS = [
    (StepOptions, (), StepKeywords),
    (SamplingOptions, (), SamplingKeywords),
    (SharpnessSampler, ("owner",), SharpnessKeywords),  # the entry point names itself
    (AlertRunner, ("rules",), AlertOptions),  # DriftAlert takes the rules first, by position
]


@pytest.mark.parametrize(("options", "besides", "keywords"), PAIRS, ids=[pair[2].__name__ for pair in PAIRS])
def test_each_keyword_twin_has_its_options_names_and_types(options, besides, keywords):
    assert get_type_hints(keywords) == declared(options, besides)


def test_the_sharpness_monitor_takes_the_samplers_and_the_step_options():
    both = {**declared(SharpnessSampler, ("owner",)), **declared(StepOptions)}
    assert get_type_hints(SharpnessMonitorKeywords) == both
    assert declared(StepOptions).items() <= declared(SamplingOptions).items()  # the attention monitors take them too


ENTRY_POINTS = [
    (ConnectionMonitor, SamplingKeywords),
    (ConnectionMonitorCallback, SamplingKeywords),
    (connmon.Monitor, SamplingKeywords),
    (SharpnessMonitor, SharpnessMonitorKeywords),
    (DriftAlert, AlertOptions),
]


@pytest.mark.parametrize(("entry_point", "keywords"), ENTRY_POINTS)
def test_every_entry_point_takes_them_by_keyword_and_redeclares_none(entry_point, keywords):
    parameters = inspect.signature(entry_point).parameters
    assert not set(parameters) & set(get_type_hints(keywords))  # no option with a default of its own
    (rest,) = [p for p in parameters.values() if p.kind is p.VAR_KEYWORD]
    assert rest.annotation == f"Unpack[{keywords.__name__}]"
