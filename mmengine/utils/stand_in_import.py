"""Importing one of transformers' modules without a heavy module it imports for a name or two.

transformers' config validators import its activations (and with them its model loading code) for ACT2FN;
its processing code imports its modeling code for one class. A process that only reads configs or
prepares inputs (a front end, a preprocessing worker) never uses those names. `import_with_stand_in`
imports the module with a stand-in for the heavy one that holds only those names; the stand-in leaves
`sys.modules` at once, so a later import of the heavy module (the engine core's) loads the real one.
Checked on transformers 5.23.0 and 5.24.0 (tests/test_startup_imports.py, tests/test_light_processor.py); a
release whose module needs more of the heavy one than the stand-in holds is imported the ordinary way, as logged.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import Any

logger = logging.getLogger(__name__)


def import_with_stand_in(module: str, heavy: str, names: dict[str, Any]) -> None:
    """Imports `module` while `heavy` is a stand-in holding `names`, unless either is imported already. A
    version of `module` that needs more of `heavy` than `names` is imported the ordinary way (logged)."""
    if module in sys.modules or heavy in sys.modules:
        return
    stand_in = types.ModuleType(heavy)
    for name, value in names.items():
        setattr(stand_in, name, value)
    sys.modules[heavy] = stand_in
    try:
        importlib.import_module(module)
    except ImportError as err:
        logger.info("%s needs more of %s than %s (%s): importing both", module, heavy, ", ".join(names), err)
    finally:
        if sys.modules.get(heavy) is stand_in:
            del sys.modules[heavy]
    importlib.import_module(module)
