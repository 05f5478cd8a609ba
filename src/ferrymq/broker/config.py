"""Broker configuration: one frozen, typed, validated object, resolved once at the edge.

Sources, lowest to highest priority: defaults, a TOML file (``--config``), environment variables
``FERRYMQ_<FIELD>`` (upper case), command-line flags / keyword arguments. :func:`load` merges them
once; nothing below it reads the environment. Every field documents its unit and reason;
``docs/configuration.md`` is generated from this module (``python -m ferrymq.docgen configuration``).
"""

from __future__ import annotations

import ipaddress
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ferrymq._deprecated import renamed_setting
from ferrymq.broker.dedup import DEFAULT_DEDUP_MAX_KEYS
from ferrymq.broker.heap import MAX_MALLOC_MMAP_THRESHOLD
from ferrymq.broker.logs import LOG_FORMATS
from ferrymq.errors import ConfigError, InvalidRequestError
from ferrymq.protocol.dedup import MAX_DEDUP_WINDOW_MS
from ferrymq.protocol.messages.schema import MAX_LIST_ITEMS
from ferrymq.storage.log import MAX_SEGMENT_BYTES

FLUSH_MODES = ("sync", "async")
TLS_CLIENT_AUTH = ("none", "optional", "required")
MAX_OFFSETS_TOPIC_QUEUES = 1024
"""Most queues of ``%GROUPS%offsets`` (``offsets_topic_queues``)."""
MAX_CONSOLE_PAGE_ROWS = 1000
"""Most ``console_page_rows``: a page is built in one request of the console (one DESCRIBE per
topic row), so its size stays small."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1)."""
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _f(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Every broker setting. Build with :func:`load` (or directly in tests)."""

    host: str = _f("127.0.0.1", "Address to listen on.")
    port: int = _f(9876, "TCP port to listen on (0: any free port).")
    data_dir: str = _f("./ferrymq-data", "Directory holding topics, offsets and state.")
    broker_id: int = _f(0, "This broker's id (in message ids and HELLO); in a cluster unique "
                           "(0..2**31-1): a second broker with a live broker's id refuses to "
                           "start.")
    flush: str = _f(
        "sync",
        "sync: acknowledge a send after its bytes are fsynced (group commit); "
        "async: acknowledge after write(2) and fsync every flush_interval_ms.",
    )
    flush_interval_ms: int = _f(200, "async mode: how often written data is fsynced.")
    flush_threads: int = _f(4, "most fsyncs of one flush round that run at once (a round "
                               "costs the slowest fsync, not their sum): after a round slower "
                               "than 2 ms, on this many threads; after a faster one, submitted "
                               "together (flush_aio) or one by one. 1: always one by one.")
    flush_aio: bool = _f(True, "after a fast flush round, fsync the next round's queues "
                               "together with one Linux native AIO submission (io_submit, no "
                               "extra threads); off, or where AIO is missing: one by one.")
    max_frame_bytes: int = _f(8 * 1024 * 1024, "Largest frame accepted; larger closes the connection.")
    max_message_bytes: int = _f(4 * 1024 * 1024, "Largest single message (record) accepted.")
    max_batch_records: int = _f(100_000, "Most records in one batch.")
    max_fetch_bytes: int = _f(8 * 1024 * 1024 - 65536, "Most bytes of record data in one fetch response.")
    max_fetch_wait_ms: int = _f(30_000, "Longest long-poll wait a fetch may ask for.")
    max_connections: int = _f(10_000, "Connections beyond this are closed at once.")
    max_in_flight_per_connection: int = _f(
        256, "Requests read but not yet answered per connection before reading pauses."
    )
    max_write_buffer_bytes: int = _f(
        32 * 1024 * 1024, "Unsent response bytes per connection before reading pauses."
    )
    idle_timeout_ms: int = _f(
        300_000, "A connection silent this long is closed (clients ping every 30 s by default)."
    )
    auto_create_topics: bool = _f(True, "Create a topic on first produce or metadata request.")
    default_queues: int = _f(4, "Queues of an auto-created topic.")
    max_queues: int = _f(1024, "Most queues one topic may have.")
    max_topics: int = _f(
        10_000,
        "Most topics clients may create, explicitly or by auto-creation; beyond it creation is "
        "refused with POLICY_VIOLATION naming this limit. The broker's internal topics "
        "(%RETRY%, %DLQ%, %HALF%, %TXN%) are not counted and never refused.",
    )
    max_total_queues: int = _f(
        40_000,
        "Most queues of those topics together (POLICY_VIOLATION beyond it). An idle queue holds "
        "no file descriptor (see max_open_segments) but about 4 KiB of memory and adds to the "
        "start-up time (about 0.2 ms per queue after a clean stop, 1.5 ms after a crash).",
    )
    auto_create_topics_per_minute: int = _f(
        600,
        "Most topics one client may auto-create per minute: per user with authentication, per "
        "connection without (a burst of this many, then one every 60/N s). Beyond it, "
        "POLICY_VIOLATION with a retry-after. Explicit creation (`ferrymq topic create`) is "
        "bounded by max_topics and max_total_queues only.",
    )
    max_delivery_groups: int = _f(
        10_000,
        "Most delivery groups (push and simple consumers; each broadcasting consumer is one) "
        "on the broker; a new one beyond it is refused with POLICY_VIOLATION naming this "
        "limit, before anything is created. Each costs memory, a directory with a snapshot "
        "and a journal, and work at every delivery tick while it has members; its journal's "
        "descriptor is in the descriptor cache (max_open_segments), closed while it is idle.",
    )
    max_consumer_groups: int = _f(
        10_000,
        "Most pull consumer groups (PullConsumer: committed offsets) on the broker; a new one "
        "beyond it (a join, a commit or an offset reset naming an unknown group) is refused "
        "with POLICY_VIOLATION naming this limit. Each costs memory and an offsets file; no "
        "descriptor.",
    )
    max_open_segments: int = _f(
        0,
        "Most segment files (and delivery-group journals) kept open at once over all queues "
        "and groups (a least-recently-used cache: idle queues' and groups' files are closed, "
        "and opened again on use). 0: what the descriptor "
        "limit (RLIMIT_NOFILE, raised to its hard limit at start) leaves after connections; "
        "the start log says the numbers (docs/operations.md).",
    )
    segment_bytes: int = _f(1024 * 1024 * 1024, "Roll a queue's segment at this size.")
    segment_ms: int = _f(7 * 24 * 3600 * 1000, "Roll a queue's segment at this age.")
    index_interval_bytes: int = _f(4096, "Bytes of log between two sparse index entries.")
    retention_ms: int = _f(
        7 * 24 * 3600 * 1000, "Delete whole segments older than this (-1: keep forever)."
    )
    retention_bytes: int = _f(-1, "Per queue: delete oldest segments beyond this size (-1: no limit).")
    retention_check_interval_ms: int = _f(60_000, "How often retention runs.")
    default_session_timeout_ms: int = _f(15_000, "Consumer session timeout when the client sends 0.")
    max_session_timeout_ms: int = _f(300_000, "Longest consumer session timeout accepted.")
    max_member_topics: int = _f(
        1000, "Most topics one consumer-group member may subscribe to (topics not created yet "
              "included: a member may wait for them)."
    )
    default_invisible_ms: int = _f(
        30_000, "Lease of a received message when the client asks for 0 (then redelivered)."
    )
    max_invisible_ms: int = _f(12 * 3600 * 1000, "Longest lease (invisible time) accepted.")
    max_in_flight_per_member: int = _f(
        20_000, "Most leased, unacknowledged messages one delivery-group member may hold."
    )
    max_receive_messages: int = _f(10_000, "Most messages one RECEIVE may lease.")
    delivery_journal_bytes: int = _f(
        16 * 1024 * 1024, "A delivery group's journal is compacted into a snapshot past this size."
    )
    delivery_ack_history: int = _f(
        20_000,
        "Acknowledged offset runs a delivery group remembers with their time (the CONSUMED time "
        "`ferrymq message status` shows); older ones are forgotten.",
    )
    orderly_retry_ms: int = _f(
        1000, "Orderly groups: a failed message is delivered again (in place) after this long, "
        "unless the consumer's nack names its own delay."
    )
    max_orderly_held: int = _f(
        10_000,
        "Orderly groups: most messages one queue holds back behind busy sharding keys; past it "
        "the queue waits until keys move on (bounds memory).",
    )
    max_retry_loaded: int = _f(
        10_000,
        "Most retry letters of one delivery group held in memory: due letters read from the "
        "retry queue ahead of receivers, not yet leased (letters not due yet are the "
        "scheduler's, on disk). Past it the group's retry queue waits for receivers.",
    )
    max_dlq_done_letters: int = _f(
        10_000,
        "Most dead letters of one delivery group redriven or purged one by one (ferrymq dlq "
        "... --offset) while older ones are still dead: each is remembered until the oldest "
        "dead letters pass it. Past it, one-letter requests are refused until the oldest "
        "letters are redriven or purged. At most 100000 (every answer lists them).",
    )
    delivery_tick_ms: int = _f(
        50, "How often leases, member sessions and orderly retries are checked (redelivery "
        "precision of expired leases)."
    )
    shutdown_timeout_ms: int = _f(10_000, "Graceful shutdown: longest wait for requests in flight.")
    key_index_enabled: bool = _f(
        True, "Build each queue's key index in the background (`ferrymq message find --key`)."
    )
    key_index_bytes_per_tick: int = _f(
        4 * 1024 * 1024,
        "Most log bytes the background key indexer reads per housekeeping tick (every 0.5 s), "
        "over all queues; it never runs on the produce path.",
    )
    key_index_file_bytes: int = _f(
        16 * 1024 * 1024, "Roll a queue's key index file at this size (retention drops whole files)."
    )
    max_find_results: int = _f(1000, "Most messages one find-by-key request may return.")
    find_scan_bytes: int = _f(
        32 * 1024 * 1024,
        "Most log bytes one find-by-key request reads: checking index candidates (hashes "
        "collide) and searching what the indexer has not reached yet.",
    )
    max_delay_ms: int = _f(
        40 * 24 * 3600 * 1000,
        "Longest delay of a scheduled message (`delay=`, `deliver_at=`); a batch asking for more "
        "is refused with INVALID_REQUEST.",
    )
    schedule_bucket_ms: int = _f(
        60_000,
        "Width of one time bucket of the scheduler's on-disk index (`<data_dir>/schedule/`): one "
        "file per bucket of due times.",
    )
    schedule_lookahead_ms: int = _f(
        120_000,
        "Buckets starting within this of now are held in memory (a heap of their entries); later "
        "ones stay on disk with a few counters each, so memory is bounded by the near future.",
    )
    schedule_cache_bytes: int = _f(
        64 * 1024 * 1024,
        "The scheduler keeps the batches of scheduled originals it read last (checked, records "
        "located), up to this many bytes: messages of one batch that come due apart are copied "
        "without reading it again.",
    )
    dedup_window_ms: int = _f(
        0,
        "Dedup window given to topics created without their own `dedup_window_ms` (0: none). "
        "A message whose dedup key the topic stored within its window is acknowledged as a "
        "duplicate and not stored again; a topic keeps the window it was created with. At most "
        "86400000 (one day) and at most `retention_ms`. See docs/dedup.md.",
    )
    dedup_max_keys: int = _f(
        DEFAULT_DEDUP_MAX_KEYS,
        "Most dedup keys one topic's window holds in memory (~280 bytes each with short keys); a "
        "send that would exceed it is refused with BUSY (retriable) until older keys expire.",
    )
    half_check_after_ms: int = _f(
        6_000,
        "Half messages: a half message whose outcome is unknown is first checked back this long "
        "after it was stored (RocketMQ: 6 s). Default for producer groups that do not set "
        "`check_after`.",
    )
    half_check_interval_ms: int = _f(
        30_000, "Half messages: later check-backs of an unresolved half message come this far "
        "apart (RocketMQ: 30 s). Default for groups that do not set `check_interval`.",
    )
    half_max_checks: int = _f(
        15, "Half messages: after this many check-backs without a definite answer the half "
        "message is rolled back, with the reason recorded (RocketMQ: 15). Default for groups "
        "that do not set `max_checks`.",
    )
    half_max_pending: int = _f(
        100_000, "Half messages: most half messages pending (neither committed nor rolled back) "
        "at once, held in memory (~300 bytes each); a new half message beyond it is refused "
        "with BUSY (retriable).",
    )
    txn_default_timeout_ms: int = _f(
        60_000, "Exactly-once transactions: an open transaction of a transactional id that "
        "did not ask for a timeout is aborted this long after it began (Kafka: 60 s).",
    )
    txn_max_timeout_ms: int = _f(
        900_000, "Exactly-once transactions: the longest timeout a producer may ask for; "
        "more is refused with INVALID_TXN_TIMEOUT (Kafka: 15 min).",
    )
    txn_staged_ttl_ms: int = _f(
        3_600_000, "Exactly-once transactions: a staged transaction (Spark sink task) that is "
        "not committed within this long is aborted and its rows dropped.",
    )
    txn_max_open: int = _f(
        10_000, "Exactly-once transactions: most transactions open (begun or staged) at once, "
        "held in memory; a new one beyond it is refused with BUSY (retriable).",
    )
    txn_id_expiration_ms: int = _f(
        7 * 24 * 3_600_000, "Exactly-once transactions: a transactional id idle this long "
        "with no open transaction is forgotten (Kafka: 7 days); its next use starts afresh.",
    )
    users_file: str = _f(
        "",
        "Security: TOML file of users (SCRAM-SHA-256 and -512 keys and ACLs, written by "
        "`ferrymq user add`); empty: authentication off. Reloaded when it changes. See "
        "docs/security.md.",
    )
    insecure: bool = _f(
        False, "Security: allow listening on a non-loopback address without authentication."
    )
    auth_timeout_ms: int = _f(
        10_000, "Security: a connection not authenticated this long after it opened is closed "
        "(also bounds the TLS handshake)."
    )
    auth_failure_delay_ms: int = _f(
        500, "Security: a failed authentication is answered this late (at least 100), then the "
        "connection is closed."
    )
    max_pre_auth_frame_bytes: int = _f(
        4096, "Security: largest frame accepted before authentication (at most 4096)."
    )
    max_connections_per_ip: int = _f(
        1000, "Connections from one IP address beyond this are refused (BUSY, then closed)."
    )
    max_write_queue_bytes: int = _f(
        64 * 1024 * 1024,
        "Unsent response bytes per connection beyond which the client is cut off as too slow "
        "(reading pauses earlier, at max_write_buffer_bytes).",
    )
    write_stall_timeout_ms: int = _f(
        60_000, "A client that reads none of its responses for this long is cut off."
    )
    malloc_mmap_threshold_bytes: int = _f(
        32 * 1024 * 1024,
        "Resilience: the `ferrymq broker` process asks glibc's malloc to serve blocks up to "
        "this size from its heap, reused, instead of mapping and unmapping each one (a "
        "request frame, a fetch's read, a Kafka fetch answer: megabytes, every request); "
        "with malloc_trim_threshold_bytes it cut the broker's CPU for a 10 KB Kafka consume "
        "by 5x (bench/README.md). At most 32 MiB (glibc's limit); 0: glibc's own policy. "
        "Not applied to an embedded broker or without glibc.",
    )
    malloc_trim_threshold_bytes: int = _f(
        64 * 1024 * 1024,
        "Resilience: free heap glibc keeps before giving memory back to the system (it counts "
        "in the broker's RSS, which memory_high_watermark_bytes watches); 0: glibc's own "
        "policy. Applied with malloc_mmap_threshold_bytes.",
    )
    memory_high_watermark_bytes: int = _f(
        0,
        "Resilience: while the broker's resident memory (RSS, sampled every 0.5 s) is above "
        "this, produce requests (also half messages, transactional and delayed sends) are "
        "refused with BUSY and a retry-after; fetches, acks and offset commits keep working. "
        "0: 40% of the machine's memory (or of the cgroup limit, if lower); -1: off.",
    )
    disk_free_low_watermark_bytes: int = _f(
        64 * 1024 * 1024,
        "Resilience: while the file system of data_dir has less free space than this "
        "(statvfs, sampled every disk_check_interval_ms and right after a write fails with "
        "ENOSPC), produce requests are refused with STORAGE_FULL and a retry-after; consumers "
        "keep working. 0: no watermark (a full disk is still refused cleanly).",
    )
    disk_check_interval_ms: int = _f(
        1000, "Resilience: how often the free space of data_dir is sampled."
    )
    busy_retry_after_ms: int = _f(
        500,
        "Resilience: the retry-after a produce refused by a watermark or a full disk carries; "
        "producers wait at least this long before sending it again.",
    )
    tls_cert_file: str = _f("", "TLS: certificate chain (PEM) of the listener; empty: plain TCP.")
    tls_key_file: str = _f("", "TLS: private key (PEM) of tls_cert_file.")
    tls_ca_file: str = _f("", "TLS: CA bundle (PEM) to verify client certificates with, and in a "
                              "cluster the other brokers' (empty: the system's CAs).")
    tls_client_auth: str = _f(
        "none", "TLS: client certificates: none, optional (verified if sent) or required."
    )
    http_port: int = _f(
        9877, "HTTP: port of the operations listener (/metrics, /healthz, /readyz) on host; "
              "0: no HTTP listener. Served by the broker's event loop.")
    kafka_port: int = _f(
        0, "Kafka: port of the Kafka-protocol listener on host (Kafka clients produce and "
           "consume the same topics, a partition being a queue); 0: off. Served by the "
           "broker's event loop with the wire port's limits (max_frame_bytes, connection "
           "caps); with users_file, SASL SCRAM-SHA-256 and the same ACLs; with tls_cert_file, "
           "TLS (Kafka's SSL / SASL_SSL). See docs/kafka.md.")
    kafka_key_headers_indexed: bool = _f(
        False, "Kafka: mark each uncompressed Kafka batch holding a `ferrymq.key` header so "
               "the key index and `ferrymq message find --key` cover Kafka-produced messages. "
               "Costs a scan of every batch produced through the Kafka port (about 0.2 ms per "
               "MB, a tenth of the broker's CPU at 10 KB messages); off: their FerryMQ keys "
               "still reach FerryMQ readers, but a search by key does not find them.")
    kafka_advertised_address: str = _f(
        "", "Kafka: host:port that Kafka clients are told to reach this broker at (Kafka's "
            "advertised.listeners; in a container, the published address). Empty: the "
            "address the client connected to; on a cluster, the host of advertised_address "
            "(else host) with kafka_port, registered in the metadata store for the other "
            "brokers' Metadata answers.")
    http_max_connections: int = _f(
        64, "HTTP: open connections to the operations listener beyond this are closed at once.")
    http_max_header_bytes: int = _f(
        8190, "HTTP: longest request line and longest header field accepted (431 or 400 "
              "beyond); at most 128 header fields.")
    http_max_body_bytes: int = _f(
        65_536, "HTTP: largest request body accepted (413 beyond, refused by its "
                "Content-Length before it is read).")
    http_idle_timeout_ms: int = _f(
        30_000, "HTTP: a keep-alive connection idle this long is closed.")
    console: bool = _f(
        True, "Console: serve the web console at / on the HTTP listener (see "
              "docs/operations.md). It reaches the broker through its own wire port as the "
              "logged-in user (users_file), so ACLs and admin rights apply as for the CLI.")
    console_session_timeout_ms: int = _f(
        1_800_000, "Console: a login session unused this long expires (log in again).")
    console_max_sessions: int = _f(
        32, "Console: most login sessions at once; a new login beyond it ends the session "
            "unused the longest. Each holds one wire connection to the broker.")
    console_page_rows: int = _f(
        50, "Console: most rows of one page of a list (topics, groups, queues of the cluster, "
            "dead letters, messages found by key); further rows are on the next pages. At "
            "most 1000.")
    console_body_preview_bytes: int = _f(
        4096, "Console: most bytes of a dead letter's body shown to an admin (the rest is "
              "cut, with its size said).")
    log_level: str = _f("INFO", "Logging level (DEBUG, INFO, WARNING, ERROR).")
    log_format: str = _f(
        "text", "text: one line per event; json: one JSON object per line (time in ISO 8601 "
                "UTC, level, logger, message, and fields such as topic, group, peer), for log "
                "shippers. See docs/operations.md.")
    metadata: str = _f(
        "",
        "Cluster: the metadata store, etcd://host:port[,host:port...]. Empty: a single broker "
        "with its metadata in data_dir (the default; nothing else runs).",
    )
    cluster: str = _f("ferrymq", "Cluster: the cluster's name (the key prefix in the metadata "
                                 "store); a data directory belongs to one cluster.")
    advertised_address: str = _f(
        "", "Cluster: host:port that clients and other brokers use to reach this broker. "
            "Empty: the address it listens on.")
    default_replicas: int = _f(
        0, "Cluster: replicas of a topic created without --replicas. 0: 1 on a one-broker "
           "cluster, min(3, live brokers) on bigger ones.")
    default_min_insync: int = _f(
        0, "Cluster: min_insync of a topic created without --min-insync. 0: min(2, replicas).")
    offsets_topic_queues: int = _f(
        8, "Cluster: queues of %GROUPS%offsets, the replicated log of consumer groups' committed "
           "offsets (created with default_replicas when a group is first used); each group's "
           "coordinator is the leader of one of them. Fixed once the topic exists.")
    offsets_segment_bytes: int = _f(
        16 * 1024 * 1024, "Cluster: segment size of %GROUPS%offsets (which has no retention). "
                          "When a queue of it has grown by this much since its last compaction, "
                          "its leader writes a snapshot of its groups' committed offsets and "
                          "deletes the segments the snapshot replaced, so a new coordinator "
                          "replays about two segments.")
    txn_state_segment_bytes: int = _f(
        16 * 1024 * 1024, "Segment size of %TXN%state, the transaction coordinator's log. In a "
                          "cluster, when it has grown by this much since its last compaction, "
                          "the coordinator writes a snapshot of every transactional id's state "
                          "and deletes the segments the snapshot replaced (one broker keeps a "
                          "snapshot file instead and lets retention delete them).")
    replica_lag_ms: int = _f(
        10_000, "Cluster: a follower that has not caught up with the leader's end for this long "
                "is dropped from the in-sync replicas (it rejoins by itself once caught up).")
    replica_fetch_wait_ms: int = _f(
        500, "Cluster: longest wait of a follower's long-polled fetch; appends wake it at once.")
    replica_fetch_bytes: int = _f(
        4 * 1024 * 1024, "Cluster: most bytes one follower fetch asks for per queue.")
    delivery_remote_buffer_bytes: int = _f(
        4 * 1024 * 1024,
        "Cluster: most bytes of one source queue a delivery group's coordinator holds in memory "
        "when it reads the queue from its leader (the coordinator's broker holds no replica of "
        "it): fetched ahead of receivers from the group's oldest unfinished message of the "
        "queue; past it, fetching waits until messages are finished (one batch may exceed it, "
        "as a fetch returns at least one).",
    )
    delivery_remote_buffers_total_bytes: int = _f(
        256 * 1024 * 1024,
        "Cluster: most bytes all of a broker's remote-read buffers hold together (every "
        "delivery group's, every queue's: each up to delivery_remote_buffer_bytes); past it, "
        "remote fetching waits until receivers finish messages.",
    )
    metadata_lease_ms: int = _f(
        3_000, "Cluster: TTL of this broker's lease in the metadata store (whole seconds; at least "
               "2000). A broker that cannot "
               "renew it stops acknowledging acks=all writes before it could have expired; "
               "the controller moves leadership away once it has.")
    dead_broker_probe_ms: int = _f(
        250, "Cluster: how often the controller connects to every other broker's address; one "
             "refused twice in a row (no process listens there: it died) has its lease revoked "
             "so its queues move at once instead of when the lease runs out. Timeouts change "
             "nothing (a partition is left to the lease). 0: off.")
    inter_broker_user: str = _f(
        "", "Cluster: the user this broker logs in as to fetch from other brokers "
            "(replication); needed when the brokers have users_file, and it needs admin rights. "
            "Empty: followers do not log in. With tls_cert_file set, followers also connect "
            "with TLS (see docs/cluster.md).")
    inter_broker_password: str = field(default="", repr=False, metadata={
        "doc": "Cluster: inter_broker_user's secret. Set it in the TOML file or "
               "FERRYMQ_INTER_BROKER_PASSWORD: a command line is visible to other local users."})

    def validate(self) -> BrokerConfig:
        """Check every field; return self.

        Raises:
            ConfigError: a field is out of range, naming it.
        """
        if self.flush not in FLUSH_MODES:
            raise ConfigError(f"flush must be one of {FLUSH_MODES}, not {self.flush!r}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be 0..65535, not {self.port}")
        if not 0 <= self.http_port <= 65535:
            raise ConfigError(f"http_port must be 0..65535 (0: off), not {self.http_port}")
        if self.http_port and self.http_port == self.port:
            raise ConfigError(f"http_port and port must differ (both {self.port})")
        self._validate_kafka()
        positive = (
            "flush_interval_ms", "flush_threads", "max_frame_bytes", "max_message_bytes", "max_batch_records",
            "max_fetch_bytes", "max_connections", "max_in_flight_per_connection",
            "max_write_buffer_bytes", "idle_timeout_ms", "default_queues", "max_queues",
            "segment_bytes", "segment_ms", "index_interval_bytes",
            "retention_check_interval_ms", "default_session_timeout_ms",
            "max_session_timeout_ms", "max_member_topics", "shutdown_timeout_ms", "default_invisible_ms",
            "max_invisible_ms", "max_in_flight_per_member", "max_receive_messages",
            "delivery_journal_bytes", "delivery_ack_history", "delivery_tick_ms",
            "max_orderly_held", "max_retry_loaded", "max_dlq_done_letters",
            "key_index_bytes_per_tick",
            "key_index_file_bytes", "max_find_results", "find_scan_bytes", "max_delay_ms",
            "schedule_bucket_ms", "schedule_cache_bytes", "dedup_max_keys",
            "half_check_after_ms", "half_check_interval_ms", "half_max_checks", "half_max_pending",
            "txn_default_timeout_ms", "txn_max_timeout_ms", "txn_staged_ttl_ms", "txn_max_open",
            "txn_id_expiration_ms", "auth_timeout_ms", "max_connections_per_ip",
            "max_write_queue_bytes", "write_stall_timeout_ms", "disk_check_interval_ms",
            "busy_retry_after_ms", "max_topics", "max_total_queues",
            "auto_create_topics_per_minute", "max_delivery_groups", "max_consumer_groups",
            "replica_lag_ms", "replica_fetch_wait_ms", "replica_fetch_bytes", "metadata_lease_ms",
            "delivery_remote_buffer_bytes", "delivery_remote_buffers_total_bytes",
            "offsets_segment_bytes", "txn_state_segment_bytes",
            "http_max_connections", "http_max_header_bytes", "http_max_body_bytes",
            "http_idle_timeout_ms", "console_session_timeout_ms", "console_max_sessions",
            "console_page_rows", "console_body_preview_bytes",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, not {getattr(self, name)}")
        if not 0 <= self.malloc_mmap_threshold_bytes <= MAX_MALLOC_MMAP_THRESHOLD:
            raise ConfigError(f"malloc_mmap_threshold_bytes must be 0..{MAX_MALLOC_MMAP_THRESHOLD}"
                              f" (glibc's limit), not {self.malloc_mmap_threshold_bytes}")
        if not 0 <= self.malloc_trim_threshold_bytes <= 2**31 - 1:
            raise ConfigError(f"malloc_trim_threshold_bytes must be 0..{2**31 - 1}, not "
                              f"{self.malloc_trim_threshold_bytes}")
        if self.max_dlq_done_letters > MAX_LIST_ITEMS:
            raise ConfigError(f"max_dlq_done_letters must be 1..{MAX_LIST_ITEMS}, not "
                              f"{self.max_dlq_done_letters}")
        if self.console_page_rows > MAX_CONSOLE_PAGE_ROWS:
            raise ConfigError(f"console_page_rows must be 1..{MAX_CONSOLE_PAGE_ROWS}, not "
                              f"{self.console_page_rows}")
        if self.max_message_bytes + 1024 > self.max_frame_bytes:
            raise ConfigError("max_message_bytes must be at least 1 KiB below max_frame_bytes")
        if self.max_fetch_bytes + 65536 > self.max_frame_bytes:
            raise ConfigError("max_fetch_bytes must be at least 64 KiB below max_frame_bytes")
        if self.schedule_lookahead_ms < 0:
            raise ConfigError(f"schedule_lookahead_ms must be >= 0, not {self.schedule_lookahead_ms}")
        if not 0 <= self.dedup_window_ms <= MAX_DEDUP_WINDOW_MS:
            raise ConfigError(f"dedup_window_ms must be 0..{MAX_DEDUP_WINDOW_MS} (one day), "
                              f"not {self.dedup_window_ms}")
        if 0 <= self.retention_ms < self.dedup_window_ms:
            raise ConfigError(f"dedup_window_ms {self.dedup_window_ms} exceeds retention_ms "
                              f"{self.retention_ms}")
        if self.txn_default_timeout_ms > self.txn_max_timeout_ms:
            raise ConfigError("txn_default_timeout_ms must not exceed txn_max_timeout_ms")
        if self.default_queues > self.max_queues:
            raise ConfigError("default_queues must not exceed max_queues")
        if self.default_queues > self.max_total_queues:
            raise ConfigError("default_queues must not exceed max_total_queues")
        if self.max_open_segments < 0:
            raise ConfigError(f"max_open_segments must be 0 (auto) or more, not "
                              f"{self.max_open_segments}")
        if self.orderly_retry_ms < 0:
            raise ConfigError(f"orderly_retry_ms must be >= 0, not {self.orderly_retry_ms}")
        self._validate_security()
        self._validate_cluster()
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(f"unknown log_level {self.log_level!r}")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {LOG_FORMATS}, not {self.log_format!r}")
        return self

    def _validate_cluster(self) -> None:
        if not 0 <= self.broker_id < 2**31:
            raise ConfigError(f"broker_id must be 0..2**31-1, not {self.broker_id}")
        if self.metadata and not self.metadata.startswith(("etcd://", "memory://")):
            raise ConfigError(f"metadata must be etcd://host:port[,host:port...], not "
                              f"{self.metadata!r}")
        if not self.cluster or not all(c.isalnum() or c in "-_." for c in self.cluster):
            raise ConfigError(f"cluster must be a non-empty name of letters, digits, '-', '_' "
                              f"and '.', not {self.cluster!r}")
        if self.advertised_address:
            host, sep, port = self.advertised_address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"advertised_address must be host:port, not "
                                  f"{self.advertised_address!r}")
        if self.default_replicas < 0 or self.default_min_insync < 0:
            raise ConfigError("default_replicas and default_min_insync must be >= 0 (0: auto)")
        if self.dead_broker_probe_ms < 0:
            raise ConfigError(f"dead_broker_probe_ms must be >= 0 (0: off), not "
                              f"{self.dead_broker_probe_ms}")
        for name in ("offsets_segment_bytes", "txn_state_segment_bytes"):
            if getattr(self, name) > MAX_SEGMENT_BYTES:
                raise ConfigError(f"{name} must be 1..{MAX_SEGMENT_BYTES}, not "
                                  f"{getattr(self, name)}")
        if not 1 <= self.offsets_topic_queues <= MAX_OFFSETS_TOPIC_QUEUES:
            raise ConfigError(f"offsets_topic_queues must be 1..{MAX_OFFSETS_TOPIC_QUEUES}, not "
                              f"{self.offsets_topic_queues}")
        if bool(self.inter_broker_user) != bool(self.inter_broker_password):
            raise ConfigError("inter_broker_user and inter_broker_password go together")
        if self.metadata and self.users_file and not self.inter_broker_user:
            raise ConfigError(
                "a cluster broker with users_file needs inter_broker_user and "
                "inter_broker_password: followers log in to their leaders as that user (an "
                "admin of the users file)")
        if self.metadata_lease_ms < 2000:
            raise ConfigError(f"metadata_lease_ms must be >= 2000 (etcd leases count whole "
                              f"seconds), not {self.metadata_lease_ms}")

    def _validate_kafka(self) -> None:
        if not 0 <= self.kafka_port <= 65535:
            raise ConfigError(f"kafka_port must be 0..65535 (0: off), not {self.kafka_port}")
        if self.kafka_advertised_address:
            host, sep, port = self.kafka_advertised_address.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"kafka_advertised_address must be host:port, not "
                                  f"{self.kafka_advertised_address!r}")
        if not self.kafka_port:
            return
        if self.kafka_port in (self.port, self.http_port):
            raise ConfigError(f"kafka_port {self.kafka_port} must differ from port and http_port")

    def _validate_security(self) -> None:
        if not 100 <= self.auth_failure_delay_ms <= 60_000:
            raise ConfigError(f"auth_failure_delay_ms must be 100..60000, not "
                              f"{self.auth_failure_delay_ms}")
        if not 256 <= self.max_pre_auth_frame_bytes <= 4096:
            raise ConfigError(f"max_pre_auth_frame_bytes must be 256..4096, not "
                              f"{self.max_pre_auth_frame_bytes}")
        if self.memory_high_watermark_bytes < -1:
            raise ConfigError(f"memory_high_watermark_bytes must be -1 (off), 0 (auto) or a "
                              f"size, not {self.memory_high_watermark_bytes}")
        if self.disk_free_low_watermark_bytes < 0:
            raise ConfigError(f"disk_free_low_watermark_bytes must be >= 0, not "
                              f"{self.disk_free_low_watermark_bytes}")
        if self.max_write_queue_bytes < self.max_write_buffer_bytes + self.max_frame_bytes:
            raise ConfigError("max_write_queue_bytes must be at least max_write_buffer_bytes + "
                              "max_frame_bytes")
        if self.tls_client_auth not in TLS_CLIENT_AUTH:
            raise ConfigError(f"tls_client_auth must be one of {TLS_CLIENT_AUTH}, not "
                              f"{self.tls_client_auth!r}")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file go together")
        if self.tls_client_auth != "none" and not (self.tls_cert_file and self.tls_ca_file):
            raise ConfigError("tls_client_auth needs tls_cert_file, tls_key_file and tls_ca_file")
        if not self.users_file and not self.insecure and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to listen on {self.host!r} without authentication: anyone who can "
                "reach it could read and write every topic. Set users_file (see `ferrymq user "
                "add`), listen on 127.0.0.1, or pass --insecure to accept the risk.")

    def session_timeout_ms(self, requested_ms: int) -> int:
        """A member's session timeout: ``requested_ms``, or the default when 0.

        Raises:
            InvalidRequestError: outside ``1..max_session_timeout_ms``.
        """
        timeout = requested_ms or self.default_session_timeout_ms
        if not 0 < timeout <= self.max_session_timeout_ms:
            raise InvalidRequestError(
                f"session_timeout_ms must be 1..{self.max_session_timeout_ms}, not {timeout}"
            )
        return timeout

    @property
    def data_path(self) -> Path:
        """``data_dir`` as a Path."""
        return Path(self.data_dir)


_FIELDS = {f.name: f for f in fields(BrokerConfig)}


def _coerce(name: str, value: Any) -> Any:
    f = _FIELDS.get(name)
    if f is None:
        raise ConfigError(f"unknown broker setting {name!r}")
    kind: type[Any] = type(f.default)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if isinstance(value, str):
        try:
            if kind is bool:
                low = value.strip().lower()
                if low in ("1", "true", "yes", "on"):
                    return True
                if low in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if kind is int:
                return int(value.replace("_", ""))
        except ValueError:
            raise ConfigError(f"{name}: cannot read {value!r} as {kind.__name__}") from None
        if kind is str:
            return value
    raise ConfigError(f"{name}: expected {kind.__name__}, got {type(value).__name__}")


def load(
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> BrokerConfig:
    """Merge defaults, a TOML file, ``FERRYMQ_*`` variables and overrides; validate once.

    Args:
        file: a TOML file with top-level keys named like the fields (or a ``[broker]`` table).
        env: the environment to read ``FERRYMQ_<FIELD>`` from (pass ``os.environ``).
        overrides: flags or keyword arguments; None values are ignored.

    A setting renamed since (``txn_check_after_ms``, now ``half_check_after_ms``; see
    :mod:`ferrymq._deprecated`) is taken under its old name too, with a DeprecationWarning.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or out-of-range value.
    """
    values: dict[str, Any] = {}
    if file is not None:
        try:
            data = tomllib.loads(Path(file).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {file}: {exc}") from None
        table = data.get("broker", data)
        for k, v in table.items():
            k = renamed_setting(k, source=f"in {file}")
            values[k] = _coerce(k, v)
    for k, v in (env or {}).items():
        if k.startswith("FERRYMQ_"):
            name = renamed_setting(k[len("FERRYMQ_"):].lower(), source=k)
            if name in _FIELDS:
                values[name] = _coerce(name, v)
    for k, v in (overrides or {}).items():
        if v is not None:
            k = renamed_setting(k, source="argument")
            values[k] = _coerce(k, v)
    return BrokerConfig(**values).validate()


def render_docs() -> str:
    """The configuration reference as Markdown (docs/configuration.md)."""
    lines = [
        "| setting | env | default | meaning |",
        "|---|---|---|---|",
    ]
    for f in fields(BrokerConfig):
        lines.append(
            f"| `{f.name}` | `FERRYMQ_{f.name.upper()}` | `{f.default!r}` | {f.metadata['doc']} |"
        )
    return "\n".join(lines)

