"""A cluster in subprocesses, for tests and ``ferrymq dev-cluster``: one etcd and N brokers.

Theory of operation
-------------------
:class:`ClusterProcess` starts an :class:`~ferrymq._etcd_launcher.EtcdProcess` and then
``brokers`` :class:`~ferrymq._launcher.BrokerProcess` es on 127.0.0.1, broker ``i`` (from 1)
with ``--metadata <etcd url> --cluster <name> --broker-id i`` and its data under
``<base_dir>/broker-<i>/data`` (etcd's under ``<base_dir>/etcd/``). Each broker gets a free
port once and keeps it across restarts (so a client's bootstrap list stays right after
:meth:`~ClusterProcess.restart`). Brokers and etcd are the same launchers the single-broker
tests use: kill -9, SIGTERM, restart on the same files.

It lives outside :mod:`ferrymq.testing` (which re-exports it) because ``ferrymq dev-cluster``
uses it too and must not need pytest.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from ferrymq._etcd_launcher import EtcdProcess
from ferrymq._launcher import BrokerProcess, free_port

__all__ = ["ClusterProcess"]


class ClusterProcess:
    """etcd and ``brokers`` brokers in subprocesses, forming one cluster.

    Args:
        brokers: how many brokers (ids 1..brokers).
        base_dir: where the data goes; None: a temporary directory, removed when stopped.
        cluster: the cluster's name (``--cluster``).
        flush: the brokers' ``--flush``.
        extra: more ``ferrymq broker`` flags for every broker.
        env: environment variables for the brokers (see :class:`BrokerProcess`).
        log_level: the brokers' log level (None: INFO).
        broker_port: broker 1's port, broker ``i``'s is ``broker_port + i - 1`` (0: free ports).
        etcd_port: etcd's client port, its peer port the next one (0: free ports).
        new_session: start every process in a session of its own (a Ctrl-C in the terminal
            reaches only the caller, which stops them in order).
        kafka: give every broker a Kafka port (``--kafka-port``, a free port kept across
            restarts; :attr:`kafka_addresses`).
        kafka_port: broker 1's Kafka port, broker ``i``'s ``kafka_port + i - 1`` (0: as
            ``kafka`` says).
    """

    def __init__(self, brokers: int = 3, base_dir: str | Path | None = None, *,
                 cluster: str = "dev", flush: str = "sync", extra: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, log_level: str | None = None,
                 broker_port: int = 0, etcd_port: int = 0, new_session: bool = False,
                 kafka: bool = False, kafka_port: int = 0) -> None:
        if brokers < 1:
            raise ValueError(f"a cluster needs at least 1 broker, not {brokers}")
        self._scratch: Path | None = None
        if base_dir is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="ferrymq-cluster-"))
            base_dir = self._scratch
        self.base_dir = Path(base_dir)
        self.cluster = cluster
        self.etcd = EtcdProcess(self.base_dir / "etcd" / "data", client_port=etcd_port,
                                peer_port=etcd_port + 1 if etcd_port else 0,
                                new_session=new_session)
        self.brokers = {
            i: BrokerProcess(self.base_dir / f"broker-{i}" / "data", flush=flush,
                             port=broker_port + i - 1 if broker_port else 0,
                             extra=["--metadata", self.etcd.url, "--cluster", cluster,
                                    "--broker-id", str(i), *extra,
                                    *(("--kafka-port", str(kafka_port + i - 1 if kafka_port
                                                           else free_port()))
                                      if kafka or kafka_port else ())],
                             env=env, log_level=log_level, new_session=new_session)
            for i in range(1, brokers + 1)}

    @property
    def metadata_url(self) -> str:
        """The brokers' ``--metadata``: ``etcd://127.0.0.1:PORT``."""
        return self.etcd.url

    @property
    def addresses(self) -> dict[int, str]:
        """Broker id → ``host:port``."""
        return {i: b.address for i, b in self.brokers.items()}

    @property
    def bootstrap(self) -> str:
        """Every broker's address, ``h:p,h:p,...``: what a client takes."""
        return ",".join(self.addresses.values())

    @property
    def kafka_addresses(self) -> dict[int, str]:
        """Broker id → ``host:port`` of its Kafka port (brokers started with ``kafka``)."""
        out = {}
        for i, b in self.brokers.items():
            if "--kafka-port" in b.extra:
                out[i] = f"127.0.0.1:{b.extra[b.extra.index('--kafka-port') + 1]}"
        return out

    def broker(self, broker_id: int) -> BrokerProcess:
        """The broker with this id."""
        return self.brokers[broker_id]

    def route(self, broker_id: int, *, advertised_address: str | None = None,
              metadata_url: str | None = None) -> None:
        """From broker ``broker_id``'s next start on, have it advertise ``advertised_address``
        (``--advertised-address``: where clients and the other brokers reach it) and reach
        etcd at ``metadata_url`` instead of :attr:`metadata_url`: tests put a fault proxy on
        each link this way (None: leave that one as it is)."""
        b = self.brokers[broker_id]
        flags = b.extra
        if metadata_url is not None:
            flags[flags.index("--metadata") + 1] = metadata_url
        if advertised_address is not None:
            if "--advertised-address" in flags:
                flags[flags.index("--advertised-address") + 1] = advertised_address
            else:
                flags += ["--advertised-address", advertised_address]

    def start(self, timeout: float = 30.0) -> ClusterProcess:
        """Start etcd, then every broker, each waited for (healthy, listening).

        Raises:
            RuntimeError: a process exited or did not come up in time (with its log); the
                ones already started are stopped.
        """
        try:
            self.etcd.start(timeout)
            for b in self.brokers.values():
                b.start(timeout)
        except BaseException:
            self.kill()
            raise
        return self

    def kill9(self, broker_id: int) -> None:
        """SIGKILL broker ``broker_id``."""
        self.brokers[broker_id].kill9()

    def restart(self, broker_id: int, timeout: float = 30.0) -> None:
        """Start broker ``broker_id`` again on its port and data (after :meth:`kill9` or
        :meth:`stop_broker`)."""
        self.brokers[broker_id].start(timeout)

    def stop_broker(self, broker_id: int, timeout: float = 60.0) -> None:
        """Stop broker ``broker_id`` gracefully."""
        self.brokers[broker_id].stop(timeout)

    def running(self) -> dict[str, bool]:
        """Which processes are alive: ``etcd`` and ``broker-<i>``."""
        alive = {"etcd": self.etcd.running()}
        for i, b in self.brokers.items():
            alive[f"broker-{i}"] = b.running()
        return alive

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the brokers gracefully, then etcd (the brokers deregister while it is there);
        remove a temporary base directory."""
        try:
            for b in self.brokers.values():
                b.stop(timeout)
            self.etcd.stop()
        finally:
            self._remove_scratch()

    def kill(self) -> None:
        """SIGKILL everything still running; remove a temporary base directory."""
        for b in self.brokers.values():
            if b.running():
                b.kill9()
        if self.etcd.running():
            self.etcd.kill9()
        self._remove_scratch()

    def _remove_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self) -> ClusterProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
