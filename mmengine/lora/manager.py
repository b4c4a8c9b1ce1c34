"""LoRAManager: the engine's books on adapters. No tensors are computed here; the runner fills slots.

- Registered adapters by name, each with a key (name + digest of its files) that requests carry
  and the KV block hashes include, so two adapters, or new weights under an old name, never share a block.
- Host copies of adapters' weights, LRU-bounded by max_cpu_loras; an evicted one is read from disk
  again when a step needs it.
- Device slots (max_loras): a step's adapters are made resident before it runs. A slot is reused
  least recently used first, never one this step needs and, while another is free of running
  requests, never one a running request uses. The scheduler admits at most max_loras distinct
  adapters among running requests, so a step's adapters always fit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from mmengine.errors import AdapterError, AdapterInUseError, UnknownAdapterError
from mmengine.lora.adapter import DecoderShape, LoRAAdapter, VisionTargets, load_adapter
from mmengine.lora.request import LoRARequest


class LoRAManager:
    def __init__(
        self, shape: DecoderShape, max_loras: int, max_rank: int, max_cpu_loras: int | None = None,
        vision: VisionTargets | None = None,
    ) -> None:
        self.shape = shape
        self.vision = vision
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.registered: dict[str, LoRARequest] = {}
        self._keys: dict[str, str] = {}  # name -> key
        self._on_vision: set[str] = set()  # keys of adapters that change the vision side
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # key -> weights, least recently used first
        self.slots: list[str | None] = [None] * max_loras  # key held by each device slot
        self._slot_order: OrderedDict[int, None] = OrderedDict((i, None) for i in range(max_loras))  # LRU first
        self.num_slot_loads = 0
        self.num_slot_evictions = 0
        self.num_disk_reads = 0

    # -- registration ---------------------------------------------------------

    def add(self, request: LoRARequest) -> str:
        """Registers (reading and checking the files now) and returns the adapter's key; adding the
        same name and path again is a no-op."""
        if not isinstance(request, LoRARequest) or not isinstance(request.name, str) or not request.name:
            raise AdapterError(f"expected a LoRARequest(name, path) with a non-empty name, got {request!r}")
        known = self.registered.get(request.name)
        if known is not None:
            if str(known.path) != str(request.path):
                raise AdapterError(
                    f"adapter {request.name!r} is already registered from {known.path}; remove it before adding {request.path}"
                )
            return self._keys[request.name]
        adapter = self._read(request)
        self.registered[request.name] = request
        self._keys[request.name] = adapter.key
        if adapter.touches_vision:
            self._on_vision.add(adapter.key)
        self._remember(adapter)
        return adapter.key

    def remove(self, name: str, in_use: Callable[[str], int]) -> str | None:
        """Unregisters `name`; returns the slot-free key, or None if no such adapter. Refused
        (AdapterInUseError) while `in_use(key)` requests still use it."""
        key = self._keys.get(name)
        if key is None:
            return None
        users = in_use(key)
        if users:
            raise AdapterInUseError(f"adapter {name!r} is used by {users} queued or running request(s); abort them or wait")
        del self.registered[name], self._keys[name]
        self._host.pop(key, None)
        self._on_vision.discard(key)
        return key

    def key_of(self, lora: LoRARequest | str | None) -> str | None:
        """The key a request runs under: None for the base model; a LoRARequest is registered on first use."""
        if lora is None:
            return None
        if isinstance(lora, LoRARequest):
            return self.add(lora)
        if isinstance(lora, str):
            key = self._keys.get(lora)
            if key is None:
                known = ", ".join(sorted(self.registered)) or "none"
                raise UnknownAdapterError(f"unknown LoRA adapter {lora!r} (registered: {known})")
            return key
        raise UnknownAdapterError(f"lora must be a LoRARequest, a registered adapter name or None, got {type(lora).__name__}")

    def name_of(self, key: str) -> str:
        return key.rsplit("#", 1)[0]

    def touches_vision(self, key: str) -> bool:
        """Whether the adapter changes the vision side: then its requests' encoder outputs are its own."""
        return key in self._on_vision

    def holds(self, key: str) -> bool:
        """Whether `key` is a registered adapter's current key."""
        return self._keys.get(self.name_of(key)) == key

    # -- host copies ----------------------------------------------------------

    def adapter(self, key: str) -> LoRAAdapter:
        adapter = self._host.get(key)
        if adapter is not None:
            self._host.move_to_end(key)
            return adapter
        name = self.name_of(key)
        request = self.registered.get(name)
        if request is None or self._keys[name] != key:
            raise AdapterError(f"adapter {name!r} was removed or replaced while requests still used it")
        adapter = self._read(request)
        if adapter.key != key:
            raise AdapterError(f"adapter {name!r}: the files at {request.path} changed since it was registered")
        self._remember(adapter)
        return adapter

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        self.num_disk_reads += 1
        return load_adapter(request.name, request.path, self.shape, self.max_rank, self.vision)

    def _remember(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.key] = adapter
        self._host.move_to_end(adapter.key)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    # -- device slots ---------------------------------------------------------

    def activate(
        self, keys: Iterable[str], running: set[str], load: Callable[[int, LoRAAdapter], None]
    ) -> dict[str, int]:
        """Makes every adapter in `keys` resident, calling `load(slot, adapter)` for the missing ones;
        returns each key's slot. A slot is booked empty while it is being written, so a load that
        fails leaves the books true to the tensors."""
        needed = list(dict.fromkeys(keys))
        assert len(needed) <= len(self.slots), f"{len(needed)} adapters in one step, {len(self.slots)} slots"
        slot_of = {}
        for key in needed:
            slot = self.slots.index(key) if key in self.slots else None
            if slot is None:
                slot = self._victim(set(needed), running)
                if self.slots[slot] is not None:
                    self.num_slot_evictions += 1
                self.slots[slot] = None
                load(slot, self.adapter(key))
                self.slots[slot] = key
                self.num_slot_loads += 1
            self._slot_order.move_to_end(slot)
            slot_of[key] = slot
        return slot_of

    def vacate(self, key: str) -> int | None:
        """Books the slot holding `key` (if any) as empty; returns it."""
        if key not in self.slots:
            return None
        slot = self.slots.index(key)
        self.slots[slot] = None
        return slot

    def _victim(self, needed: set[str], running: set[str]) -> int:
        order = list(self._slot_order)
        for keep in (needed | running, needed):
            for slot in order:
                if self.slots[slot] is None:
                    return slot
            for slot in order:
                if self.slots[slot] not in keep:
                    return slot
        raise RuntimeError("no LoRA slot can be reused")  # the scheduler's cap makes this unreachable

    def stats(self) -> dict[str, int]:
        return {
            "lora_adapters_registered": len(self.registered),
            "lora_adapters_on_vision": len(self._on_vision),  # their encoder outputs are cached per adapter
            "lora_slots_used": sum(key is not None for key in self.slots),
            "lora_slot_loads": self.num_slot_loads,
            "lora_slot_evictions": self.num_slot_evictions,
            "lora_adapters_in_host_memory": len(self._host),
            "lora_disk_reads": self.num_disk_reads,
        }
