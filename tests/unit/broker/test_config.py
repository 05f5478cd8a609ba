"""Broker configuration: merged once from file, environment and flags; every field validated."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrymq.broker.config import load
from ferrymq.errors import ConfigError


def test_priority_file_then_env_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "ferrymq.toml"
    f.write_text('[broker]\nport = 1111\nflush = "async"\nsegment_bytes = 4096\n')
    cfg = load(f, {"FERRYMQ_PORT": "2222", "FERRYMQ_SEGMENT_BYTES": "8_192", "OTHER": "x"},
               {"port": 3333, "host": None})
    assert (cfg.port, cfg.flush, cfg.segment_bytes, cfg.host) == (3333, "async", 8192, "127.0.0.1")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"flush": "sometimes"}, "flush"),
        ({"port": 70000}, "port"),
        ({"max_frame_bytes": 0}, "max_frame_bytes"),
        ({"max_message_bytes": 8 * 1024 * 1024}, "max_message_bytes"),
        ({"nonsense": 1}, "nonsense"),
        ({"port": "abc"}, "port"),
        ({"auto_create_topics": "maybe"}, "auto_create_topics"),
    ],
)
def test_bad_values_name_the_setting(overrides: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load(overrides=overrides)


def test_bad_file_is_a_config_error(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("port = [")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(f)


def test_kafka_port_is_off_by_default_and_read_from_the_environment() -> None:
    assert load().kafka_port == 0
    assert load(env={"FERRYMQ_KAFKA_PORT": "9092"}).kafka_port == 9092


def test_a_cluster_broker_may_have_a_kafka_port() -> None:
    cfg = load(overrides={"kafka_port": 9092, "metadata": "etcd://127.0.0.1:2379",
                          "broker_id": 1})
    assert (cfg.kafka_port, cfg.metadata) == (9092, "etcd://127.0.0.1:2379")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"kafka_port": 70000}, "kafka_port must be 0..65535"),
        ({"kafka_port": 9876, "port": 9876}, "must differ from port"),
        ({"kafka_port": 9877, "http_port": 9877}, "must differ from port and http_port"),
        ({"kafka_advertised_address": "no-port"}, "kafka_advertised_address must be host:port"),
    ],
)
def test_kafka_port_limits_are_named(overrides: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load(overrides=overrides)
