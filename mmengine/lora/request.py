"""LoRARequest: which adapter a request runs (plain data)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory under a name. Passing one to generate() or add_request() registers it on
    first use (like engine.add_lora); afterwards the name alone selects it."""

    name: str
    path: str
