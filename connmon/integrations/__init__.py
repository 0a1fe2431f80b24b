"""Entry points for trainers other than Lightning, adapters over the engine :class:`connmon.Monitor`.

* :class:`connmon.integrations.transformers.ConnectionMonitorCallback`: the Hugging Face ``Trainer`` (the
  ``transformers`` extra).
* :class:`connmon.integrations.olmo_core.ConnectionMonitorCallback`: OLMo-core's ``Trainer`` (the ``olmo-core``
  extra, in an environment without ``transformers`` >= 5.25).

The engine they adapt is :mod:`connmon.monitor` (``connmon.Monitor``), the curvature sampler
:mod:`connmon.curvature.sampler`.
"""
