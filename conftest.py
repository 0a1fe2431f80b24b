"""Collection for the whole repository: a module whose optional dependency is not installed is not imported."""

import importlib.util

# connmon[olmo-core] lives in an environment of its own (.ci/run): elsewhere its adapter's doctest is not collected
collect_ignore = [] if importlib.util.find_spec("olmo_core") else ["connmon/integrations/olmo_core.py"]
