"""Entry points for trainers other than Lightning, adapters over the engine :class:`connmon.Monitor`.

* :class:`connmon.integrations.transformers.ConnectionMonitorCallback`: the Hugging Face ``Trainer`` (the
  ``transformers`` extra).

The engine they adapt is :mod:`connmon.monitor` (``connmon.Monitor``), the curvature sampler
:mod:`connmon.curvature.sampler`.
"""
