"""EngineConfig's option groups (config.py): flat options in, each read from the one group that owns it and
validated there; bad values are ConfigErrors that name the option; the flat form round-trips."""

from __future__ import annotations

import dataclasses

import pytest

from mmengine.config import GROUPS, CacheConfig, EngineConfig, LoRAConfig, MultimodalConfig, SchedulerConfig
from mmengine.errors import ConfigError


def test_every_option_belongs_to_exactly_one_group_and_is_read_there():
    config = EngineConfig("m", block_size=32, max_num_seqs=3, mm_processor_workers=2, enable_lora=True, engine_core="process")
    assert config.cache_config.block_size == 32 and config.scheduler_config.max_num_seqs == 3
    assert config.multimodal_config.mm_processor_workers == 2 and config.lora_config.enable_lora
    assert config.parallel_config.engine_core == "process"
    names = [f.name for _, f in EngineConfig.option_fields()]
    assert len(names) == len(set(names)) and "model" not in names
    assert {owner for owner, _ in EngineConfig.option_fields()} == set(GROUPS.values())
    for attribute, group in GROUPS.items():
        assert isinstance(getattr(config, attribute), group)


def test_the_flat_form_round_trips():
    config = EngineConfig("m", max_model_len=128, kv_cache_dtype="fp8", limit_mm_per_prompt={"image": 2})
    again = EngineConfig(config.model, **config.options())
    assert again == config and again.options()["limit_mm_per_prompt"] == {"image": 2}
    assert EngineConfig("m") != config


@pytest.mark.parametrize(("group", "options", "named"), [
    (CacheConfig, {"block_size": 24}, "block_size"),
    (CacheConfig, {"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
    (SchedulerConfig, {"max_num_seqs": 0}, "max_num_seqs"),
    (MultimodalConfig, {"limit_mm_per_prompt": {"smell": 1}}, "limit_mm_per_prompt"),
    (LoRAConfig, {"max_loras": 4, "max_cpu_loras": 2}, "max_cpu_loras"),
])
def test_each_group_validates_itself_and_names_the_option(group, options, named):
    with pytest.raises(ConfigError, match=named):
        group(**options)
    with pytest.raises(ConfigError, match=named):  # the same check through the flat form
        EngineConfig("m", **options)


def test_an_unknown_option_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown engine option\(s\): tensor_paralel_size; known: .*block_size"):
        EngineConfig("m", tensor_paralel_size=2)


def test_groups_are_plain_dataclasses_with_defaults():
    for group in GROUPS.values():
        assert dataclasses.is_dataclass(group)
        group()  # every option has a default
