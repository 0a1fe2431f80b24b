"""SamplingOptions: what an attention monitor records and how often, declared, checked and documented once.

:class:`connmon.Monitor`, Lightning's :class:`connmon.callbacks.ConnectionMonitor` and the Hugging Face
:class:`connmon.integrations.transformers.ConnectionMonitorCallback` take these options as keywords
(``**sampling``) or as one ``options=SamplingOptions(...)``, and build one ``SamplingOptions`` which the engine
reads: the defaults and checks live only here. The keywords are typed by :class:`SamplingKeywords` (PEP 692's
``Unpack``), so editors (Pylance, PyCharm) and type checkers (mypy) complete and check each of them by name.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

from typing_extensions import Unpack

from connmon._cost import check_budget
from connmon._options import check_int
from connmon.step_options import StepKeywords, StepOptions

Diagnostic = Literal["walk", "transport", "spectrum", "drift"]
DIAGNOSTICS: tuple[Diagnostic, ...] = get_args(Diagnostic)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class SamplingOptions(StepOptions):
    """The sampling options of every attention monitor, checked when built.

    Attributes:
        every_n_steps: sample every this many optimizer steps (with gradient accumulation, once per optimizer step).
        num_sequences: sequences recorded per sampled step (per process).
        max_tokens: tokens recorded per sequence (see :func:`connmon.capture`); None for all.
        layers: which attention layers: None for all, a regex on module names, or a list of names or indices.
        diagnostics: groups to compute: ``"walk"``, ``"transport"``, ``"spectrum"``, ``"drift"``.
        spectrum_k: eigenvalues of ``M / s`` per layer (histograms, figures, spectral radius).
        probe: None to record the training forward of sampled steps; or a fixed batch, recorded instead on sampled
            steps (on the model after that many optimizer steps) under ``no_grad`` in eval mode, every module's own
            mode restored afterwards, so that time drift compares like with like and dropout does not make the records
            inexact.
        probe_fn: how to run the probe, ``probe_fn(model, probe)``; default ``model(probe)`` (``model(*probe)`` for a
            tuple, ``model(**probe)`` for a dict).
        log_histograms: write W&B histograms (where a W&B run is found).
        figures_every_n_samples: write W&B figures every this many samples; None for never.
        edge_samples: keys per query for ``edge_isometry_gap`` (None: every key).
        edge_queries: query rows for ``edge_isometry_gap`` (None: every row).
        full_every_n_samples: compute the spectrum group and ``edge_isometry_gap`` on every this-many-th sample (the
            first included).
        edge_lanczos_steps: Lanczos steps per sampled edge (None: one ``d x d`` decomposition per edge).
        budget: None, or the fraction of training time the samples may take (e.g. 0.01): after each sample the
            monitor sets ``full_every_n_samples`` from the measured costs of its light and full samples and the
            training step's time (the largest figures across processes, so the same everywhere; saved in its
            ``state_dict``; said once per change).
        logit_every_n_steps, optimizer_every_n_steps: how often the per-step signals are read (the max logits, the
            optimizer's state): :class:`connmon.step_options.StepOptions`.

    Raises:
        ValueError: for an invalid option (the message names it and the valid values).

    Examples:
        >>> from connmon.sampling import SamplingOptions
        >>> SamplingOptions(every_n_steps=50, layers=[0, 2]).layers
        (0, 2)
        >>> SamplingOptions(diagnostics=("walk", "curvature"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: diagnostics must be a non-empty subset of ('walk', 'transport', 'spectrum', 'drift'), got ...
    """

    every_n_steps: int = 100
    num_sequences: int = 2
    max_tokens: int | None = 256
    layers: str | Sequence[str | int] | None = None
    diagnostics: Sequence[Diagnostic] = DIAGNOSTICS
    spectrum_k: int = 8
    probe: Any = None
    probe_fn: Callable[[Any, Any], Any] | None = None
    log_histograms: bool = True
    figures_every_n_samples: int | None = 10
    edge_samples: int | None = 1
    edge_queries: int | None = 16
    full_every_n_samples: int = 25
    edge_lanczos_steps: int | None = 32
    budget: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("every_n_steps", "num_sequences", "spectrum_k", "full_every_n_samples"):
            check_int(name, getattr(self, name))
        optional = ("max_tokens", "figures_every_n_samples", "edge_samples", "edge_queries", "edge_lanczos_steps")
        for name in optional:
            check_int(name, getattr(self, name), optional=True)
        check_budget(self.budget)
        if self.probe_fn is not None and not callable(self.probe_fn):
            raise ValueError(f"probe_fn must be callable as probe_fn(model, probe), got probe_fn={self.probe_fn!r}")
        if self.probe_fn is not None and self.probe is None:
            raise ValueError("probe_fn needs a probe batch: pass probe=... too")
        diagnostics = (self.diagnostics,) if isinstance(self.diagnostics, str) else self.diagnostics
        if not isinstance(diagnostics, Sequence) or not diagnostics or any(d not in DIAGNOSTICS for d in diagnostics):
            raise ValueError(
                f"diagnostics must be a non-empty subset of {DIAGNOSTICS}, got diagnostics={self.diagnostics!r}"
            )
        object.__setattr__(self, "diagnostics", tuple(diagnostics))
        layers = self.layers
        if isinstance(layers, str):
            try:
                re.compile(layers)
            except re.error as error:
                raise ValueError(f"layers={layers!r} is not a valid regular expression: {error}") from None
        elif layers is not None:
            if not isinstance(layers, Sequence) or not all(
                isinstance(x, (str, int)) and not isinstance(x, bool) for x in layers
            ):
                raise ValueError(
                    "layers must be None (all), a regular expression on module names, or a list of names and "
                    f"indices, got layers={layers!r}"
                )
            object.__setattr__(self, "layers", tuple(layers))
        if not isinstance(self.log_histograms, bool):
            raise ValueError(f"log_histograms must be True or False, got log_histograms={self.log_histograms!r}")


OPTION_NAMES: tuple[str, ...] = tuple(field.name for field in dataclasses.fields(SamplingOptions))


class SamplingKeywords(StepKeywords, total=False):
    """The sampling options as keywords, for an entry point's ``**sampling: Unpack[SamplingKeywords]``.

    Names and types only: each is documented, defaulted and checked in :class:`SamplingOptions` (a test holds the
    two to the same names and types).
    """

    every_n_steps: int
    num_sequences: int
    max_tokens: int | None
    layers: str | Sequence[str | int] | None
    diagnostics: Sequence[Diagnostic]
    spectrum_k: int
    probe: Any
    probe_fn: Callable[[Any, Any], Any] | None
    log_histograms: bool
    figures_every_n_samples: int | None
    edge_samples: int | None
    edge_queries: int | None
    full_every_n_samples: int
    edge_lanczos_steps: int | None
    budget: float | None


def sampling_options(
    options: SamplingOptions | None = None, owner: str = "connmon", **sampling: Unpack[SamplingKeywords]
) -> SamplingOptions:
    """``options`` (None: the defaults) with the ``sampling`` keywords in place of its values, checked.

    How every entry point builds its options from ``options=`` and ``**sampling``; ``owner`` names it in errors.

    Raises:
        TypeError: for a keyword that is not a sampling option (the message names them).
        ValueError: for an invalid value, or ``options`` that is not a :class:`SamplingOptions`.

    Examples:
        >>> from connmon.sampling import SamplingOptions, sampling_options
        >>> sampling_options(every_n_steps=50).every_n_steps
        50
        >>> sampling_options(SamplingOptions(every_n_steps=50), spectrum_k=4).every_n_steps
        50
        >>> sampling_options(every_n_step=50)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        TypeError: connmon got an unexpected keyword argument 'every_n_step'; the sampling options are ...
    """
    unknown = [name for name in sampling if name not in OPTION_NAMES]
    if unknown:
        raise TypeError(
            f"{owner} got an unexpected keyword argument {unknown[0]!r}; the sampling options are "
            f"{', '.join(OPTION_NAMES)}"
        )
    if options is None:
        return SamplingOptions(**sampling)
    if not isinstance(options, SamplingOptions):
        raise ValueError(f"options must be a connmon.sampling.SamplingOptions, got {type(options).__name__}")
    return dataclasses.replace(options, **sampling) if sampling else options
