"""Reading a checkpoint's config without transformers' model loading code.

transformers' config classes (Llama's and Gemma 4's among those our families nest) import
`transformers.utils.type_validators`, which imports `transformers.activations` at module level for one name,
ACT2FN, that only the `activation_fn_key` validator reads (no config of ours uses it). `transformers.activations`
imports transformers' model loading (`core_model_loading`: accelerate, sympy, botocore): about 850 modules a
front end never uses. `import_config_code` imports the validators with a stand-in for that name, an ACT2FN
that imports the real mapping when first read, so validation still runs where a config asks for it.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

logger = logging.getLogger(__name__)

_VALIDATORS = "transformers.utils.type_validators"
_ACTIVATIONS = "transformers.activations"


class LazyActivations(Mapping[str, Any]):
    """transformers' ACT2FN, imported from transformers.activations when first read."""

    @staticmethod
    def _real() -> Mapping[str, Any]:
        return importlib.import_module(_ACTIVATIONS).ACT2FN

    def __getitem__(self, name: str) -> Any:
        return self._real()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._real())

    def __len__(self) -> int:
        return len(self._real())


def import_config_code() -> None:
    """Imports transformers' config validators without `transformers.activations`, unless either is imported
    already (a process that imported activations first keeps the validators' ordinary import). A transformers
    whose validators need more of activations than ACT2FN imports both the ordinary way."""
    if _VALIDATORS in sys.modules or _ACTIVATIONS in sys.modules:
        return
    placeholder = types.ModuleType(_ACTIVATIONS)
    placeholder.ACT2FN = LazyActivations()  # type: ignore[attr-defined]
    sys.modules[_ACTIVATIONS] = placeholder
    try:
        importlib.import_module(_VALIDATORS)
    except ImportError as err:
        logger.info("transformers' config validators need its activations (%s): importing both", err)
    finally:
        if sys.modules.get(_ACTIVATIONS) is placeholder:
            del sys.modules[_ACTIVATIONS]  # a later import of transformers.activations loads the real one
    importlib.import_module(_VALIDATORS)
