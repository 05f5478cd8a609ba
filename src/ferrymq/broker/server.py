"""The broker process: lifecycle, connections, housekeeping, graceful shutdown.

Theory of operation
-------------------
:class:`BrokerServer` owns everything: the topic registry (and through it every log), the
flusher thread, the group coordinator, the producer-id manager and the listening socket. One
event loop runs it all; only fsyncs run on the flusher thread.

Start: raise the soft descriptor limit and plan its use (refusing a limit too small,
:mod:`ferrymq.broker.descriptors`), take an exclusive lock on the data directory (two brokers on
one directory would corrupt it), note whether the previous run left the clean-shutdown marker
(then recovery can trust the files) and remove it, start answering HTTP (``/readyz`` says
"recovering"), open every log and rebuild the dedup windows from the logs' tails (on a worker
thread: the loop stays free for the HTTP probes), load the groups, the scheduler, half messages
and transactions (on the loop), start the flusher, join the cluster (with ``metadata``), listen: a
broker accepts no connection before it has its view of the cluster.

Stop (SIGTERM/SIGINT, or :meth:`stop`): stop accepting connections, refuse new produces with
BROKER_SHUTTING_DOWN, let requests in flight finish (bounded by ``shutdown_timeout_ms``), answer
long polls with what they have, flush everything, close the logs, write the clean-shutdown marker,
release the lock. The seeds call this 优雅停机 (graceful shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ferrymq import _faults, _sockets
from ferrymq._faults import NO_FAULTS, Faults
from ferrymq._time import SYSTEM_CLOCK, Clock
from ferrymq._version import __version__
from ferrymq.broker.auth import Authenticator, UserStore
from ferrymq.broker.config import BrokerConfig
from ferrymq.broker.connection import BrokerConnection
from ferrymq.broker.consumer_groups import ConsumerGroupCoordinator
from ferrymq.broker.context import ReplicaService
from ferrymq.broker.dedup import Deduplicator
from ferrymq.broker.delivery import DeliveryManager
from ferrymq.broker.descriptors import DescriptorBudget, plan_descriptors, raise_descriptor_limit
from ferrymq.broker.flusher import Flusher
from ferrymq.broker.half_messages import HalfMessageManager
from ferrymq.broker.handlers import HANDLERS, Handler
from ferrymq.broker.heap import CHECK_INTERVAL_S as HEAP_CHECK_INTERVAL_S
from ferrymq.broker.heap import HeapFreezer, tune_malloc
from ferrymq.broker.keyindexer import KeyIndexer
from ferrymq.broker.limits import ByteRateQuota, ConnectionLimits, CreationRate
from ferrymq.broker.logs import configure_logging
from ferrymq.broker.producer_ids import ProducerIdManager
from ferrymq.broker.scheduler import Scheduler
from ferrymq.broker.sdnotify import READY, STOPPING, sd_notify
from ferrymq.broker.stats import RequestStats
from ferrymq.broker.tls import server_context
from ferrymq.broker.topics import TopicRegistry
from ferrymq.broker.txn import TxnCoordinator
from ferrymq.broker.watermarks import Watermarks
from ferrymq.errors import ConfigError
from ferrymq.protocol.codes import ErrorCode
from ferrymq.protocol.coordinator import OFFSETS_TOPIC, TXN_TOPIC
from ferrymq.protocol.messages import ApiKey
from ferrymq.storage import LogConfig
from ferrymq.storage.files import fsync_directory
from ferrymq.storage.handles import FileHandles

if TYPE_CHECKING:
    from ferrymq.broker.cluster_link import ClusterLink
    from ferrymq.cluster.metadata import MetadataStore
    from ferrymq.kafka.groups import KafkaGroupCoordinator
    from ferrymq.kafka.listener import KafkaListener
    from ferrymq.ops.http import HttpListener

log = logging.getLogger("ferrymq.broker")

CLEAN_SHUTDOWN_MARKER = ".clean_shutdown"
LOCK_FILE = ".lock"
HOUSEKEEPING_INTERVAL_S = 0.5


class BrokerServer:
    """One broker. Create, ``await start()``, ``await stop()`` (or ``await run()``)."""

    def __init__(self, config: BrokerConfig, clock: Clock = SYSTEM_CLOCK, *,
                 metadata_store: MetadataStore | None = None) -> None:
        """A broker of ``config``; ``metadata_store``: the cluster's store object to use
        instead of opening ``config.metadata`` (tests run brokers of one process on one memory
        store)."""
        self.config = config
        self.clock = clock
        self.sync_flush = config.flush == "sync"
        self.handlers: dict[int, Handler] = dict(HANDLERS)
        self.data_dir = Path(config.data_dir)
        self.connections: set[BrokerConnection] = set()
        self.auth = (Authenticator(UserStore.open(config.users_file), config.auth_failure_delay_ms)
                     if config.users_file else None)
        """Authentication (None: off, every connection has every right)."""
        self.replicas: ReplicaService | None = None
        """In a cluster, the replica manager (set by the cluster node; None: a single broker)."""
        self.ssl_context = server_context(config)
        self.limits = ConnectionLimits(config.max_connections, config.max_connections_per_ip)
        self.quota = ByteRateQuota(clock.monotonic)
        self.watermarks = Watermarks(
            self.data_dir, memory_high_bytes=config.memory_high_watermark_bytes,
            disk_free_low_bytes=config.disk_free_low_watermark_bytes,
            disk_check_interval_s=config.disk_check_interval_ms / 1000,
            retry_after_ms=config.busy_retry_after_ms, clock=clock.monotonic)
        """Memory and free-disk watermarks: whether produce is refused (sampled by housekeeping)."""
        self.shutting_down = False
        self.recovered = False
        """Whether the data directory was recovered and every manager loaded (``/readyz``)."""
        self.serving = False
        """Whether the wire listener accepts connections (``/readyz``)."""
        self.request_stats: dict[int, RequestStats] = {
            ApiKey.PRODUCE: RequestStats(), ApiKey.FETCH: RequestStats()}
        """PRODUCE and FETCH counts, bytes and latency (``/metrics``)."""
        self.http: HttpListener | None = None
        """The operations listener (None: ``http_port = 0``)."""
        self.kafka: KafkaListener | None = None
        """The Kafka-protocol listener (None: ``kafka_port = 0``)."""
        self.address: tuple[str, int] = (config.host, config.port)
        self.topics: TopicRegistry
        self.descriptors: DescriptorBudget
        """How the descriptor limit is spent (planned at start)."""
        self.flusher: Flusher
        self.delivery: DeliveryManager
        self.key_index: KeyIndexer
        self.scheduler: Scheduler
        self.half_messages: HalfMessageManager
        self.txn: TxnCoordinator
        self.dedup: Deduplicator
        self.consumer_groups = ConsumerGroupCoordinator(
            self.data_dir, max_groups=config.max_consumer_groups, files=not config.metadata)
        self.producer_ids = ProducerIdManager(self.data_dir)
        self._server: asyncio.Server | None = None
        self._lock_file: IO[bytes] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = asyncio.Event()
        self._last_retention = 0.0
        self.shutdown_error: BaseException | None = None
        self._metadata_store = metadata_store
        self.cluster: ClusterLink | None = None
        """This broker's part in a cluster (None without ``metadata``)."""

    @property
    def kafka_groups(self) -> KafkaGroupCoordinator | None:
        """The Kafka port's group membership (None: no Kafka port)."""
        return self.kafka.groups if self.kafka is not None else None

    def now_monotonic_ms(self) -> int:
        """Monotonic milliseconds (sessions, timeouts)."""
        return int(self.clock.monotonic() * 1000)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind the listener, recover the data directory, start serving.

        The port is bound first: a broker that cannot listen (the port is taken) fails before
        it creates anything on disk. A data directory that exists is locked before that, so a
        second broker on it is told the directory is in use, whatever its port.

        Raises:
            ConfigError: the port cannot be bound, the data directory is locked by another
                broker or unusable, or the descriptor limit is too small
                (:func:`~ferrymq.broker.descriptors.plan_descriptors`).
        """
        loop = asyncio.get_running_loop()
        cfg = self.config
        before, limit = raise_descriptor_limit()
        self.descriptors = plan_descriptors(limit, max_connections=cfg.max_connections,
                                            max_open_segments=cfg.max_open_segments,
                                            raised_from=before)
        if (self.data_dir / LOCK_FILE).exists():
            self._lock_data_dir()
        try:
            self._server = await self._bind(loop)
            if cfg.kafka_port:
                await self._bind_kafka()
            if cfg.http_port:
                from ferrymq.ops.http import HttpListener  # aiohttp: only when it is used

                self.http = HttpListener(self)
                await self.http.bind()
                # answering while the logs recover: /healthz 200, /readyz 503 "recovering"
                await self.http.start()
            sock = self._server.sockets[0].getsockname()
            self.address = (sock[0], sock[1])
            await self._open(loop)
        except BaseException:
            if self._server is not None:
                self._server.close()
            if self.kafka is not None:
                self.kafka.close()
            if self.http is not None:
                await self.http.close()
            if self._lock_file is not None:
                self._lock_file.close()
            raise
        self.recovered = True  # /readyz says "starting" while the cluster is joined
        if cfg.metadata:
            # before accepting a connection: a broker that served before it joined (it may
            # wait for its former self's lease) would answer with an empty view (UNKNOWN_TOPIC,
            # which clients do not retry); refused connections make them try another broker
            await self._join_cluster()
        try:
            await self._server.start_serving()
        except OSError as exc:  # another process listened on it since the bind
            if self.cluster is not None:
                await self.stop()
                raise self._listen_error(exc) from exc
            self._server.close()
            if self.kafka is not None:
                self.kafka.close()
            if self.http is not None:
                await self.http.close()
            self.flusher.stop()
            self.scheduler.close()
            self.topics.close()
            if self._lock_file is not None:
                self._lock_file.close()
            raise self._listen_error(exc) from exc
        for listener in self._server.sockets:
            _sockets.tune_listener(listener)
        if self.kafka is not None:
            try:
                await self.kafka.start()
            except OSError as exc:  # another process listened on it since the bind
                await self.stop()
                raise self._listen_error(exc, cfg.kafka_port) from exc
        self.serving = True
        self._tasks.append(loop.create_task(self._housekeeping()))
        self._tasks.append(loop.create_task(self._delivery_ticks()))
        self.scheduler.start()
        self.half_messages.start()
        self._log_started()
        log.info("%s", self.descriptors.describe(cfg.max_total_queues, cfg.max_delivery_groups))
        if cfg.max_connections > self.descriptors.connections:
            log.warning("max_connections=%d is above the %d connections the descriptor limit "
                        "leaves room for: connections beyond those are refused when accepted "
                        "(raise the limit: ulimit -n, LimitNOFILE=)", cfg.max_connections,
                        self.descriptors.connections)
        log.info("security: %s, %s", "TLS" if self.ssl_context else "plain TCP (no TLS)",
                 f"authentication on ({len(self.auth.store.users)} users)" if self.auth
                 else "authentication OFF (every client may do everything)")

    def _log_started(self) -> None:
        """The start lines an operator looks for: version, addresses, data, flush mode, console."""
        cfg = self.config
        host, port = self.address
        data = str(self.data_dir.resolve())
        log.info("FerryMQ %s broker listening on %s:%d (data %s, flush %s)", __version__, host,
                 port, data, cfg.flush, extra={"version": __version__, "address": f"{host}:{port}",
                                               "data_dir": data, "flush": cfg.flush})
        if cfg.advertised_address:
            log.info("advertised to clients and brokers as %s", cfg.advertised_address,
                     extra={"advertised_address": cfg.advertised_address})
        if self.http is not None:
            url = "http://{}:{}/".format(*self.http.address)
            log.info("HTTP on %s (/metrics, /healthz, /readyz)", url, extra={"console_url": url})

    async def _join_cluster(self) -> None:
        """Join the cluster of ``metadata``; on failure stop everything started and raise."""
        from ferrymq.broker.cluster_link import ClusterLink

        self.cluster = ClusterLink(self, self._metadata_store)
        try:
            await self.cluster.start()
        except BaseException:
            link, self.cluster = self.cluster, None
            with contextlib.suppress(Exception):
                await link.stop()
            await self.stop()
            raise

    def _lock_data_dir(self) -> None:
        """Take the data directory's lock (creating the directory and its lock file).

        Raises:
            ConfigError: another broker holds it.
        """
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.data_dir / LOCK_FILE, "ab")  # noqa: SIM115 - held for life
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise ConfigError(f"data dir {self.data_dir} is in use by another broker") from None

    async def _bind(self, loop: asyncio.AbstractEventLoop) -> asyncio.Server:
        """The listening socket, bound but not accepting yet (start_serving does that).

        Raises:
            ConfigError: the address cannot be bound (in use, not an address of this host).
        """
        cfg = self.config
        try:
            return await loop.create_server(
                lambda: BrokerConnection(self), cfg.host, cfg.port, reuse_address=True,
                backlog=1024, ssl=self.ssl_context, start_serving=False,
                ssl_handshake_timeout=cfg.auth_timeout_ms / 1000 if self.ssl_context else None,
            )
        except OSError as exc:
            raise self._listen_error(exc) from exc

    async def _bind_kafka(self) -> None:
        """Bind the Kafka port (``kafka_port``; kio is imported only when it is on).

        Raises:
            ConfigError: the port cannot be bound.
        """
        from ferrymq.kafka.listener import KafkaListener

        self.kafka = KafkaListener(self)
        try:
            await self.kafka.bind()
        except OSError as exc:
            self.kafka = None
            raise self._listen_error(exc, self.config.kafka_port) from exc

    def _listen_error(self, exc: OSError, port: int | None = None) -> ConfigError:
        reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
        if exc.errno == errno.EADDRINUSE:
            reason += " (another broker or program listens on it)"
        port = self.config.port if port is None else port
        return ConfigError(f"cannot listen on {self.config.host}:{port}: {reason}")

    async def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        """Lock and recover the data directory; open the logs and every manager."""
        if self._lock_file is None:
            self._lock_data_dir()
        marker = self.data_dir / CLEAN_SHUTDOWN_MARKER
        clean = marker.exists()
        fresh = not (self.data_dir / "meta").exists()
        if clean:
            marker.unlink()
            fsync_directory(self.data_dir)
        cfg = self.config
        base = LogConfig(
            segment_bytes=cfg.segment_bytes,
            segment_ms=cfg.segment_ms,
            index_interval_bytes=cfg.index_interval_bytes,
            retention_ms=None if cfg.retention_ms < 0 else cfg.retention_ms,
            retention_bytes=None if cfg.retention_bytes < 0 else cfg.retention_bytes,
            max_converted_batch_bytes=cfg.max_fetch_bytes,
        )
        t0 = loop.time()
        # the long part (every log's recovery, the dedup rescans) runs on a worker thread so
        # the loop keeps answering /healthz and /readyz; nothing on the loop reads the topics
        # before self.recovered (the wire port does not serve yet, /metrics waits for it)
        recovering = asyncio.ensure_future(asyncio.to_thread(self._recover_logs, base, clean))
        try:
            await asyncio.shield(recovering)
        except asyncio.CancelledError:
            # a thread cannot be stopped: the data directory stays locked until it is done
            with contextlib.suppress(Exception):
                await recovering
            raise
        self.consumer_groups.load()
        self.consumer_groups.sync_queue_counts({n: len(t.queues) for n, t in self.topics.topics.items()})
        self.producer_ids.load()
        log.info("opened %d topics in %.3f s (%s)", len(self.topics.topics), loop.time() - t0,
                 "new data directory" if fresh else
                 "clean shutdown before" if clean else "recovered after an unclean stop")
        self.watermarks.sample()
        self.flusher = Flusher(loop, sync=self.sync_flush, interval_ms=cfg.flush_interval_ms,
                               threads=cfg.flush_threads, aio=cfg.flush_aio)
        self.flusher.on_disk_full = self.watermarks.on_disk_full
        self.flusher.retry_after_ms = cfg.busy_retry_after_ms
        self.scheduler = Scheduler(cfg, self.topics, self.flusher, self.clock, self.data_dir)
        self.delivery = DeliveryManager(cfg, self.topics, self.flusher, self.clock, self.data_dir,
                                        self.scheduler)  # retry letters are scheduled
        self.delivery.load()
        self.scheduler.load()
        self.half_messages = HalfMessageManager(cfg, self.topics, self.flusher, self.scheduler,
                                                self.clock, self.data_dir)
        self.half_messages.load()
        self.txn = TxnCoordinator(cfg, self.topics, self.flusher, self.consumer_groups, self.producer_ids,
                                  self.clock, self.data_dir)
        self.txn.load()  # finishes interrupted commits before anyone can read
        self.key_index = KeyIndexer(self.topics, cfg)
        self.flusher.start()

    def _recover_logs(self, base: LogConfig, clean: bool) -> None:
        """Open every log (recovering each after an unclean stop) and rebuild the dedup windows
        from their tails; runs on a worker thread (see :meth:`_open`)."""
        cfg = self.config
        self.topics = TopicRegistry(
            self.data_dir, base, sync_visibility=self.sync_flush, clean_shutdown=clean,
            max_queues=cfg.max_queues, default_dedup_window_ms=cfg.dedup_window_ms,
            max_topics=cfg.max_topics, max_total_queues=cfg.max_total_queues,
            auto_create_rate=CreationRate(cfg.auto_create_topics_per_minute,
                                          self.clock.monotonic),
            handles=FileHandles(self.descriptors.open_segments),
            internal_logs={OFFSETS_TOPIC: replace(base, segment_bytes=cfg.offsets_segment_bytes,
                                                  retention_ms=None, retention_bytes=None),
                           TXN_TOPIC: replace(base, segment_bytes=cfg.txn_state_segment_bytes)})
        self.topics.open_all(self.clock.wall_ms())
        self.dedup = Deduplicator(self.topics, max_keys=cfg.dedup_max_keys)
        self.dedup.load(self.clock.wall_ms())
        _faults.recovery_hold()

    async def stop(self) -> None:
        """Shut down gracefully (idempotent)."""
        if self.shutting_down:
            await self._stopped.wait()
            return
        self.shutting_down = True
        log.info("shutting down")
        try:
            await self._shutdown()
        except BaseException as exc:
            self.shutdown_error = exc
            log.critical("shutdown failed: %s", exc, exc_info=exc)
            raise
        finally:  # whatever failed, the process must be able to exit
            self._stopped.set()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self.kafka is not None:
            self.kafka.stop_accepting()
        if self.cluster is not None:  # first: the lease goes, leadership moves at once
            await self.cluster.stop()
        self.scheduler.stop()
        self.half_messages.stop()  # answers waiting check polls
        for qs in self.topics.all_queues():  # answer long polls now
            for w in list(qs.waiters):
                if not w.done():
                    w.set_result(None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.shutdown_timeout_ms / 1000
        while ((any(c.pending for c in self.connections)  # noqa: ASYNC110
                or (self.kafka is not None and self.kafka.pending))
               and loop.time() < deadline):
            await asyncio.sleep(0.01)
        for t in self._tasks:
            t.cancel()
        if self.http is not None:  # answered 503 "shutting down" during the drain
            await self.http.close()
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.close()
        if self.kafka is not None:
            self.kafka.close()
        await asyncio.sleep(0)
        self.flusher.stop()
        await asyncio.sleep(0)  # run the flusher's last callbacks (they may journal moves)
        try:
            self.scheduler.close()
            self.half_messages.close()
            self.txn.close()
            self.delivery.close()
        finally:
            self.topics.close()
        (self.data_dir / CLEAN_SHUTDOWN_MARKER).write_bytes(b"")
        fsync_directory(self.data_dir)
        if self._lock_file is not None:
            self._lock_file.close()
        log.info("stopped cleanly")

    async def wait_stopped(self) -> None:
        """Wait until :meth:`stop` has finished."""
        await self._stopped.wait()

    # -- connections -------------------------------------------------------------------------

    def register(self, conn: BrokerConnection) -> str | None:
        """Admit a new connection; the reason it is refused (shutting down, over
        ``max_connections`` or ``max_connections_per_ip``), or None."""
        if self.shutting_down:
            return "broker is shutting down"
        refused = self.limits.admit(conn.ip)
        if refused is None:
            self.connections.add(conn)
        return refused

    def unregister(self, conn: BrokerConnection) -> None:
        """Forget a closed connection (one that :meth:`register` admitted)."""
        self.connections.discard(conn)
        self.limits.release(conn.ip)

    def produce_throttle(self, user: str, nbytes: int) -> float:
        """Seconds to stop reading from ``user``'s connection after a produce of ``nbytes``
        (its ``produce_bytes_per_s`` quota; 0 when within it or unlimited)."""
        u = self.auth.store.get(user) if self.auth is not None else None
        if u is None or u.produce_bytes_per_s <= 0:
            return 0.0
        return self.quota.spend(user, u.produce_bytes_per_s, nbytes)

    # -- housekeeping ------------------------------------------------------------------------

    async def _delivery_ticks(self) -> None:
        interval = self.config.delivery_tick_ms / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                self.delivery.tick()
            except Exception:
                log.exception("delivery tick failed")

    def close_removed_users(self) -> None:
        """After the users file was edited offline: close the connections of users it no longer
        has, as DELETE_USER does (their reconnects then fail the handshake)."""
        assert self.auth is not None
        users = self.auth.store.users
        for c in list(self.connections):
            if c.principal is not None and c.principal not in users and not c.closed:
                c.fail(ErrorCode.AUTHENTICATION_FAILED,
                       f"user {c.principal!r} was removed from the users file: connection closed")
        if self.kafka is not None:
            self.kafka.close_removed_users(users)

    async def _housekeeping(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
            try:
                self.watermarks.sample()
                self.flusher.retry_full(self.watermarks.disk_ok)
                counts = {n: len(t.queues) for n, t in self.topics.topics.items()}
                self.consumer_groups.expire(self.now_monotonic_ms(), counts)
                self.consumer_groups.sync_queue_counts(counts)  # topics created: their readers rebalance
                now = self.clock.monotonic()
                idle_s = cfg.idle_timeout_ms / 1000
                stall_s = cfg.write_stall_timeout_ms / 1000
                for c in list(self.connections):
                    if now - c.last_activity > idle_s and not c.pending and c.transport:
                        c.fail_quietly(f"idle for idle_timeout_ms={cfg.idle_timeout_ms}")
                    elif c.write_paused_since is not None and now - c.write_paused_since > stall_s:
                        c.cut_off(f"stalled reader: no response bytes taken for "
                                  f"write_stall_timeout_ms={cfg.write_stall_timeout_ms}")
                if self.kafka is not None:
                    self.kafka.check_connections(now)
                if self.auth is not None and self.auth.store.reload_if_changed():
                    self.close_removed_users()
                    if self.cluster is not None:  # the cluster's users, not this file's
                        self.cluster.users.file_changed()
                if now - self._last_retention >= cfg.retention_check_interval_ms / 1000:
                    self._last_retention = now
                    wall = self.clock.wall_ms()
                    floors = {**self.scheduler.retention_floors(),
                              **self.half_messages.retention_floors(),
                              **self.txn.retention_floors()}
                    for qs in self.topics.all_queues():
                        n = qs.log.delete_old_segments(
                            wall, keep_from=floors.get((qs.topic_id, qs.queue)))
                        if n:
                            log.info("retention deleted %d segments of %s/%d", n, qs.topic,
                                     qs.queue, extra={"topic": qs.topic, "queue": qs.queue})
                self.dedup.expire(self.clock.wall_ms())
                self.txn.tick()
                await self.key_index.tick()
            except Exception:
                log.exception("housekeeping failed")


def install_event_loop_policy() -> None:
    """Use uvloop when installed."""
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def serve(config: BrokerConfig, on_started: Callable[[BrokerServer], Any] | None = None,
                *, faults: Faults = NO_FAULTS, notify_socket: str | None = None,
                freeze_heap: bool = False) -> None:
    """Run a broker until SIGTERM or SIGINT, then stop gracefully.

    Args:
        config: the broker's configuration.
        on_started: called with the server once it listens.
        faults: fault hooks for tests (installed for this process first; its clock too).
        notify_socket: systemd's ``$NOTIFY_SOCKET``: told READY=1 once the broker serves
            (after recovery), STOPPING=1 when it begins to stop (:mod:`~ferrymq.broker.sdnotify`).
        freeze_heap: keep the garbage collector's pauses short by freezing the broker's
            long-lived objects (:mod:`~ferrymq.broker.heap`; process-wide: the broker's own
            process only).

    Raises:
        BaseException: whatever made the shutdown fail (so the process exits non-zero).
    """
    _faults.configure(faults)
    server = BrokerServer(config, faults.clock())
    await server.start()
    if on_started is not None:
        on_started(server)
    host, port = server.address
    sd_notify(notify_socket, READY, f"STATUS=serving on {host}:{port}")
    loop = asyncio.get_running_loop()
    stop_task: list[asyncio.Task[None]] = []

    def _signal() -> None:
        if not stop_task:
            sd_notify(notify_socket, STOPPING, "STATUS=shutting down")
            stop_task.append(loop.create_task(server.stop()))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _signal)
    heap = loop.create_task(_keep_heap_frozen(server)) if freeze_heap else None
    await server.wait_stopped()
    if heap is not None:
        heap.cancel()
    if server.shutdown_error is not None:
        raise server.shutdown_error


async def _keep_heap_frozen(server: BrokerServer) -> None:
    """Freeze the started broker's objects, then again as its queue count moves (heap.py)."""
    freezer = HeapFreezer(lambda: sum(len(t.queues) for t in server.topics.topics.values()))
    while True:
        freezer.tick()
        await asyncio.sleep(HEAP_CHECK_INTERVAL_S)


GIL_SWITCH_INTERVAL_S = 0.0005
"""The flusher thread must get the GIL back promptly after each fsync, or a busy event loop
keeps it waiting for Python's default 5 ms switch interval and sync-mode acks stall."""


def run(config: BrokerConfig, faults: Faults = NO_FAULTS, notify_socket: str | None = None) -> None:
    """Blocking entry point of ``ferrymq broker`` (``faults``: a test's fault hooks;
    ``notify_socket``: systemd's ``$NOTIFY_SOCKET``, see :func:`serve`)."""
    configure_logging(config.log_level, config.log_format)
    install_event_loop_policy()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    tune_malloc(config.malloc_mmap_threshold_bytes, config.malloc_trim_threshold_bytes)
    asyncio.run(serve(config, faults=faults, notify_socket=notify_socket, freeze_heap=True))
