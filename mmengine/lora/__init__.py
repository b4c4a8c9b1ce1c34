"""LoRA adapters on the language model.

- request.py  LoRARequest: an adapter's name and directory (plain data)
- adapter.py  reading and validating a PEFT adapter into per-layer (A, scaled B) pairs
- manager.py  the books: registered names, host copies (LRU), device slots (LRU, never one a running request needs)
The per-row deltas are layers/lora.py (LoRALinear) and kernels/lora.py (segmented matmul).
"""

from mmengine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
