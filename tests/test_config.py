"""The settings split: CacheConfig (the cache) and SchedulerConfig (one step's work), and
Engine.from_pretrained's keyword settings sorted into them by name."""

from __future__ import annotations

import mlxpaged
from mlxpaged.config import CacheConfig, SchedulerConfig, split_settings
from mlxpaged.errors import ConfigError, MlxpagedError

import pytest


def test_settings_go_to_the_config_that_has_the_field():
    cache, scheduler = split_settings({"block_size": 8, "kv_memory": "2GB", "max_num_seqs": 4, "max_batch_tokens": 64})
    assert cache == CacheConfig(block_size=8, kv_memory=2 * 10**9)
    assert scheduler == SchedulerConfig(max_batch_tokens=64, max_num_seqs=4)
    assert split_settings({}) == (CacheConfig(), SchedulerConfig())


def test_an_unknown_setting_is_named_before_anything_is_built():
    with pytest.raises(ConfigError, match="unknown setting 'max_tokens'; the settings are block_size, ") as info:
        split_settings({"cache_tokens": 64, "max_tokens": 64})
    assert info.value.param == "max_tokens"
    assert "max_num_seqs" in str(info.value) and "cache_tokens" in str(info.value)


def test_each_config_checks_its_own_fields():
    with pytest.raises(ConfigError) as info:
        split_settings({"block_size": 8, "max_num_seqs": 0})
    assert info.value.param == "max_num_seqs"
    with pytest.raises(TypeError):  # the step's settings are not the cache's
        CacheConfig(max_num_seqs=4)


def test_the_package_exports_the_configs_and_the_error_base():
    assert mlxpaged.SchedulerConfig is SchedulerConfig and mlxpaged.CacheConfig is CacheConfig
    assert mlxpaged.MlxpagedError is MlxpagedError
    assert {"SchedulerConfig", "MlxpagedError"} <= set(mlxpaged.__all__)


def test_from_pretrained_refuses_an_unknown_setting_before_looking_for_the_model():
    from mlxpaged.engine.engine import Engine

    with pytest.raises(ConfigError, match="unknown setting 'max_tokens'"):
        Engine.from_pretrained("/nonexistent/model", max_tokens=256)  # a reply's length is SamplingParams'


def test_speculative_decoding_is_a_scheduler_setting_checked_by_name():
    assert split_settings({"speculative": "ngram"})[1] == SchedulerConfig(speculative="ngram")
    with pytest.raises(ConfigError, match="must be one of") as info:
        SchedulerConfig(speculative="eagle")
    assert info.value.param == "speculative"
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(speculative="ngram", num_speculative_tokens=0)
    assert info.value.param == "num_speculative_tokens"


def test_max_model_len_is_a_positive_count_or_none():
    assert SchedulerConfig().max_model_len is None and SchedulerConfig(max_model_len=16384).max_model_len == 16384
    with pytest.raises(ConfigError, match="max_model_len") as info:
        split_settings({"max_model_len": 0})
    assert info.value.param == "max_model_len"
