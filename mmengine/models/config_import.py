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
from collections.abc import Iterator, Mapping
from typing import Any

from mmengine.utils.stand_in_import import import_with_stand_in

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
    already (a process that imported activations first keeps the validators' ordinary import)."""
    import_with_stand_in(_VALIDATORS, _ACTIVATIONS, {"ACT2FN": LazyActivations()})
