"""The data source's options: parsed and checked once, with errors that name the option.

Spark hands options over as a case-insensitive map of strings (keys lower-cased). The names
mirror Spark's Kafka source where they apply (``subscribe``, ``startingOffsets``,
``maxOffsetsPerTrigger``, ...); ``docs/spark.md`` lists them all. Every malformed value raises
:class:`~ferrymq.errors.ConfigError` naming the option and what it accepts, so a typo fails at
``load()`` / ``start()``, not inside a task.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ferrymq.errors import ConfigError
from ferrymq.protocol.auth import check_user_name
from ferrymq.protocol.tags import parse_tag_expression
from ferrymq.spark._wire import WireConfig

DEFAULT_SERVERS = "127.0.0.1:9876"
DEFAULT_FETCH_MAX_BYTES = 4 * 1024 * 1024
"""Bytes asked for per FETCH by a task (the broker's default frame cap is 8 MiB)."""
DEFAULT_MAX_TRIGGER_DELAY_MS = 15 * 60 * 1000  # Kafka's default maxTriggerDelay (15m)
DEFAULT_RETRY_TIMEOUT_MS = 30_000
"""``retryTimeout``: how long the driver's offset look-ups and a task's reads retry through a
failover (a leader that died or moved, brokers that do not answer) before they fail. A dead
leader is replaced once its lease runs out (the broker's ``metadata_lease_ms``, 3 s)."""

QueueOffsets = dict[tuple[str, int], int]
"""Offsets per (topic, queue)."""

EARLIEST = -2
LATEST = -1
"""Special offsets inside JSON offset options (Kafka's convention)."""

DELIVERY_MODES = ("transactional", "idempotent", "atLeastOnce")


def _get(options: Mapping[str, str], name: str) -> str | None:
    value = options.get(name.lower())
    if value is None:
        return None
    return str(value).strip()


def _bad(name: str, accepted: str, value: object) -> ConfigError:
    return ConfigError(f"option {name!r}: expected {accepted}, got {value!r}")


def _int(options: Mapping[str, str], name: str, *, minimum: int = 1) -> int | None:
    raw = _get(options, name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise _bad(name, f"an integer >= {minimum}", raw) from None
    if value < minimum:
        raise _bad(name, f"an integer >= {minimum}", raw)
    return value


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _get(options, name)
    if raw is None or raw == "":
        return default
    low = raw.lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise _bad(name, "true or false", raw)


_DURATION = re.compile(r"^\s*(\d+)\s*(ms|s|m|min|h|d)?\s*$")
_UNIT_MS = {None: 1, "ms": 1, "s": 1000, "m": 60_000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}


def _duration_ms(options: Mapping[str, str], name: str, default: int) -> int:
    raw = _get(options, name)
    if raw is None or raw == "":
        return default
    match = _DURATION.match(raw.lower())
    if match is None:
        raise _bad(name, "a duration such as 500ms, 30s, 15m or 1h", raw)
    return int(match.group(1)) * _UNIT_MS[match.group(2)]


def parse_wire(options: Mapping[str, str]) -> WireConfig:
    """``servers`` plus the security options (Kafka's ``kafka.sasl.*``/``kafka.ssl.*`` in spirit):
    ``auth.user`` + ``auth.secret`` (SCRAM, see docs/security.md), ``tls`` (true/false; implied
    by ``tls.cafile``), ``tls.cafile``, ``tls.certfile`` + ``tls.keyfile``.

    Raises:
        ConfigError: a user without a secret (or the reverse), a bad user name, a client
            certificate without its key, or TLS files without TLS.
    """
    user = _get(options, "auth.user") or None
    secret = options.get("auth.secret") or None  # not stripped: a secret is taken as given
    if (user is None) != (secret is None):
        raise ConfigError("options 'auth.user' and 'auth.secret' go together (the broker's "
                          "users_file user and its secret)")
    if user is not None:
        try:
            check_user_name(user)
        except ValueError as exc:
            raise _bad("auth.user", "a user name of A-Z a-z 0-9 . _ @ -", user) from exc
    cafile = _get(options, "tls.cafile") or None
    certfile = _get(options, "tls.certfile") or None
    keyfile = _get(options, "tls.keyfile") or None
    tls = _bool(options, "tls", cafile is not None or certfile is not None)
    if not tls and (cafile or certfile):
        raise ConfigError("options 'tls.cafile'/'tls.certfile' need tls=true")
    if (certfile is None) != (keyfile is None):
        raise ConfigError("options 'tls.certfile' and 'tls.keyfile' go together")
    return WireConfig(_get(options, "servers") or DEFAULT_SERVERS, user, secret, tls, cafile,
                      certfile, keyfile)


def parse_offsets_json(name: str, raw: str) -> QueueOffsets:
    """``{"topic": {"0": 23, "1": -2}}`` (-2 earliest, -1 latest) into offsets per queue."""
    try:
        value = json.loads(raw)
    except ValueError:
        raise _bad(name, 'earliest, latest or JSON such as {"orders": {"0": 23, "1": -2}}',
                   raw) from None
    out: QueueOffsets = {}
    if not isinstance(value, dict):
        raise _bad(name, 'a JSON object {"topic": {"queue": offset}}', raw)
    for topic, queues in value.items():
        if not isinstance(queues, dict):
            raise _bad(name, 'a JSON object {"topic": {"queue": offset}}', raw)
        for q, off in queues.items():
            try:
                queue = int(q)
            except ValueError:
                raise _bad(name, "queue numbers as keys", q) from None
            if isinstance(off, bool) or not isinstance(off, int) or off < EARLIEST:
                raise _bad(name, "offsets >= 0, or -2 (earliest) / -1 (latest)", off)
            out[(str(topic), queue)] = off
    return out


def _assign(raw: str) -> dict[str, list[int]]:
    try:
        value = json.loads(raw)
    except ValueError:
        raise _bad("assign", 'JSON such as {"orders": [0, 2]}', raw) from None
    if not isinstance(value, dict) or not value or not all(
        isinstance(t, str) and isinstance(qs, list) and qs
        and all(isinstance(q, int) and not isinstance(q, bool) and q >= 0 for q in qs)
        for t, qs in value.items()
    ):
        raise _bad("assign", 'JSON such as {"orders": [0, 2]}', raw)
    return {t: sorted(set(qs)) for t, qs in value.items()}


@dataclass(frozen=True)
class Subscription:
    """Which queues to read: exactly one of the three forms."""

    topics: tuple[str, ...] = ()
    pattern: str | None = None
    assign: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def describe(self) -> str:
        """For error messages."""
        if self.pattern is not None:
            return f"subscribePattern={self.pattern!r}"
        if self.assign:
            return f"assign={dict(self.assign)!r}"
        return f"subscribe={','.join(self.topics)!r}"


@dataclass(frozen=True)
class SourceOptions:
    """Checked options of a read (batch or streaming)."""

    wire: WireConfig
    """``servers`` and the security options (:func:`parse_wire`)."""
    subscription: Subscription
    starting: str | QueueOffsets
    """"earliest", "latest", "committed" or explicit offsets (may hold -2/-1)."""
    starting_timestamp_ms: int | None
    ending: str | QueueOffsets
    """"latest" or explicit offsets (batch reads only)."""
    group: str | None
    starting_fallback: str
    max_offsets_per_trigger: int | None
    min_offsets_per_trigger: int | None
    max_trigger_delay_ms: int
    min_partitions: int | None
    max_records_per_partition: int | None
    fail_on_data_loss: bool
    tags: str
    include_properties: bool
    commit_to_group: str | None
    fetch_max_bytes: int
    read_committed: bool = True
    """isolationLevel=read_committed (the default, like FerryMQ's consumers): skip aborted
    transactional data, read up to the last stable offset."""
    retry_timeout_s: float = DEFAULT_RETRY_TIMEOUT_MS / 1000
    """``retryTimeout``: how long a failover is retried (:data:`DEFAULT_RETRY_TIMEOUT_MS`)."""

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool) -> SourceOptions:
        """Check every option of a read.

        Raises:
            ConfigError: a malformed or contradictory option (the message names it).
        """
        wire = parse_wire(options)
        subscribe = _get(options, "subscribe")
        pattern = _get(options, "subscribePattern")
        assign = _get(options, "assign")
        given = [n for n, v in (("subscribe", subscribe), ("subscribePattern", pattern),
                                ("assign", assign)) if v]
        if len(given) != 1:
            raise ConfigError(
                "exactly one of the options 'subscribe' (comma list of topics), "
                "'subscribePattern' (regex) or 'assign' (JSON {\"topic\": [queues]}) is required"
                + (f"; got {', '.join(given)}" if given else "")
            )
        if subscribe:
            topics = tuple(t.strip() for t in subscribe.split(",") if t.strip())
            if not topics:
                raise _bad("subscribe", "a comma-separated list of topics", subscribe)
            sub = Subscription(topics=topics)
        elif pattern:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise _bad("subscribePattern", f"a regular expression ({exc})", pattern) from None
            sub = Subscription(pattern=pattern)
        else:
            assert assign is not None
            sub = Subscription(assign=tuple((t, tuple(qs)) for t, qs in sorted(_assign(assign).items())))

        group = _get(options, "group") or None
        raw_start = _get(options, "startingOffsets")
        starting: str | QueueOffsets
        if raw_start is None or raw_start == "":
            starting = "latest" if streaming else "earliest"
        elif raw_start.lower() in ("earliest", "latest", "committed"):
            starting = raw_start.lower()
        else:
            starting = parse_offsets_json("startingOffsets", raw_start)
        if starting == "latest" and not streaming:
            raise _bad("startingOffsets", "earliest, committed or JSON offsets in a batch read "
                       "(latest would read nothing)", raw_start)
        if starting == "committed" and not group:
            raise ConfigError("option 'startingOffsets'=committed needs option 'group' "
                              "(the consumer group whose committed offsets to start from)")
        fallback = (_get(options, "startingOffsetsFallback") or "earliest").lower()
        if fallback not in ("earliest", "latest"):
            raise _bad("startingOffsetsFallback", "earliest or latest", fallback)
        starting_ts = _int(options, "startingTimestamp", minimum=0)

        raw_end = _get(options, "endingOffsets")
        ending: str | QueueOffsets = "latest"
        if raw_end:
            if streaming:
                raise ConfigError("option 'endingOffsets' is for batch reads only "
                                  "(spark.read), not for readStream")
            if raw_end.lower() == "latest":
                ending = "latest"
            elif raw_end.lower() == "earliest":
                raise _bad("endingOffsets", "latest or JSON offsets", raw_end)
            else:
                ending = parse_offsets_json("endingOffsets", raw_end)
                if any(v == EARLIEST for v in ending.values()):
                    raise _bad("endingOffsets", "offsets >= 0 or -1 (latest)", raw_end)

        tags = _get(options, "tags") or "*"
        try:
            parse_tag_expression(tags)
        except Exception as exc:
            raise _bad("tags", "a tag expression such as 'created || paid' or '*'", tags) from exc

        isolation = (_get(options, "isolationLevel") or "read_committed").lower()
        if isolation not in ("read_uncommitted", "read_committed"):
            raise _bad("isolationLevel", "read_uncommitted or read_committed", isolation)
        max_per_trigger = _int(options, "maxOffsetsPerTrigger")
        min_per_trigger = _int(options, "minOffsetsPerTrigger")
        if max_per_trigger and min_per_trigger and min_per_trigger > max_per_trigger:
            raise ConfigError("option 'minOffsetsPerTrigger' must not exceed 'maxOffsetsPerTrigger'")
        return cls(
            wire=wire,
            subscription=sub,
            starting=starting,
            starting_timestamp_ms=starting_ts,
            ending=ending,
            group=group,
            starting_fallback=fallback,
            max_offsets_per_trigger=max_per_trigger,
            min_offsets_per_trigger=min_per_trigger,
            max_trigger_delay_ms=_duration_ms(options, "maxTriggerDelay", DEFAULT_MAX_TRIGGER_DELAY_MS),
            min_partitions=_int(options, "minPartitions"),
            max_records_per_partition=_int(options, "maxRecordsPerPartition"),
            fail_on_data_loss=_bool(options, "failOnDataLoss", True),
            tags=tags,
            include_properties=_bool(options, "includeProperties", False),
            commit_to_group=_get(options, "commitToGroup") or None,
            fetch_max_bytes=_int(options, "fetchMaxBytes", minimum=1024) or DEFAULT_FETCH_MAX_BYTES,
            read_committed=isolation == "read_committed",
            retry_timeout_s=_duration_ms(options, "retryTimeout", DEFAULT_RETRY_TIMEOUT_MS) / 1000,
        )


@dataclass(frozen=True)
class SinkOptions:
    """Checked options of a write (batch or streaming)."""

    wire: WireConfig
    topic: str | None
    delivery_mode: str
    sink_id: str | None
    include_properties: bool
    batch_max_records: int
    transaction_timeout_ms: int | None = None
    """``transactionTimeout`` (transactional): how long a task's transaction may stay open
    before the broker aborts it (None: the broker's ``txn_default_timeout_ms``, 60 s)."""
    staged_ttl_ms: int | None = None
    """``stagedTtl`` (transactional): how long a staged task output waits for the driver's
    commit before the broker aborts it (None: the broker's ``txn_staged_ttl_ms``, 1 h)."""

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> SinkOptions:
        """Check every option of a write.

        Raises:
            ConfigError: a malformed option (the message names it).
        """
        mode_raw = _get(options, "deliveryMode") or "transactional"
        modes = {m.lower(): m for m in DELIVERY_MODES}
        mode = modes.get(mode_raw.lower())
        if mode is None:
            raise _bad("deliveryMode", "transactional (the default), idempotent or atLeastOnce",
                       mode_raw)
        return cls(
            wire=parse_wire(options),
            topic=_get(options, "topic") or None,
            delivery_mode=mode,
            sink_id=_get(options, "sinkId") or _get(options, "checkpointLocation") or None,
            include_properties=_bool(options, "includeProperties", True),
            batch_max_records=_int(options, "batchMaxRecords") or 16_384,
            transaction_timeout_ms=_duration_ms(options, "transactionTimeout", 0) or None,
            staged_ttl_ms=_duration_ms(options, "stagedTtl", 0) or None,
        )


def options_dict(options: Mapping[str, Any]) -> dict[str, str]:
    """A plain, picklable copy of Spark's case-insensitive options (keys lower-cased)."""
    return {str(k).lower(): str(v) for k, v in options.items()}
