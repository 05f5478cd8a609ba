"""``ferrymq dev-cluster``: a local etcd and N brokers on loopback for trying a cluster, stopped
together on Ctrl-C (what ``make cluster`` runs).

The processes are :class:`~ferrymq._cluster_launcher.ClusterProcess` (the tests' launcher), each
in a session of its own so that Ctrl-C (or SIGTERM, SIGHUP) reaches only this command, which
then stops the brokers gracefully and etcd last (a second Ctrl-C kills what is left). Data stays
under ``--dir`` for the next start. A process that exits on its own stops the rest and the
command fails, naming it.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from ferrymq._cluster_launcher import ClusterProcess
from ferrymq._etcd_launcher import ETCD_INSTALL_HINT, etcd_binary
from ferrymq._stop_signals import stop_signals_interrupt
from ferrymq.admin.cli_state import CommandError

MAX_DEV_BROKERS = 9
"""At most this many brokers in a dev cluster: each is a Python process on this machine."""
DEFAULT_DIR = "./ferrymq-cluster"
DEFAULT_BROKER_PORT = 9876
"""Broker 1's port (``make run``'s), then 9877, 9878, ..."""
DEFAULT_ETCD_PORT = 2379
"""etcd's usual client port (its peer port is the next one)."""
_WATCH_INTERVAL_S = 0.5


@click.command("dev-cluster")
@click.option("--brokers", type=click.IntRange(1, MAX_DEV_BROKERS), default=3, show_default=True,
              help=f"How many brokers (ids 1..N, at most {MAX_DEV_BROKERS}).")
@click.option("--dir", "base_dir", type=click.Path(file_okay=False), default=DEFAULT_DIR,
              show_default=True, help="Where etcd's and the brokers' data go (kept for the "
                                      "next start).")
@click.option("--cluster", "cluster_name", default="dev", show_default=True,
              help="The cluster's name (the brokers' --cluster).")
@click.option("--port", "broker_port", type=click.IntRange(0, 65535), default=DEFAULT_BROKER_PORT,
              show_default=True, help="Broker 1's port; broker i listens on PORT+i-1 (0: free "
                                      "ports).")
@click.option("--etcd-port", type=click.IntRange(0, 65535), default=DEFAULT_ETCD_PORT,
              show_default=True, help="etcd's client port; its peer port is the next one (0: "
                                      "free ports).")
@click.option("--flush", type=click.Choice(["sync", "async"]), default="sync", show_default=True,
              help="The brokers' flush mode.")
@click.option("--kafka-port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Broker 1's Kafka-protocol port; broker i's is KAFKA_PORT+i-1 (0: no Kafka "
                   "port).")
def dev_cluster(brokers: int, base_dir: str, cluster_name: str, broker_port: int,
                etcd_port: int, flush: str, kafka_port: int) -> None:
    """Start a local etcd and N brokers forming one cluster; Ctrl-C stops them all.

    Needs etcd (Debian: apt-get install -y etcd-server). Try it from another shell with
    --server set to the printed bootstrap list.
    """
    if etcd_binary() is None:
        raise CommandError(f"dev-cluster needs etcd, which is not installed ({ETCD_INSTALL_HINT})")
    for port, hint in ((broker_port, "--port"), (kafka_port, "--kafka-port")):
        if port and port + brokers - 1 > 65535:
            raise click.BadParameter(f"{brokers} brokers from port {port} pass 65535",
                                     param_hint=hint)
    if kafka_port and broker_port and (
            max(kafka_port, broker_port) < min(kafka_port, broker_port) + brokers):
        raise click.BadParameter(f"ports {kafka_port}.. of {brokers} brokers overlap their "
                                 f"ports {broker_port}..", param_hint="--kafka-port")
    cluster = ClusterProcess(brokers, Path(base_dir), cluster=cluster_name, flush=flush,
                             broker_port=broker_port, etcd_port=etcd_port, new_session=True,
                             kafka_port=kafka_port)
    with stop_signals_interrupt():
        _run(cluster, brokers, cluster_name, base_dir)
    click.echo("stopped", err=True)


def _run(cluster: ClusterProcess, brokers: int, cluster_name: str, base_dir: str) -> None:
    try:
        click.echo(f"starting etcd and {brokers} broker(s) of cluster {cluster_name!r} "
                   f"(data under {base_dir}) ...", err=True)
        try:
            cluster.start()
        except RuntimeError as exc:
            raise CommandError(f"the dev cluster did not start: {exc}") from exc
        click.echo(f"etcd      {cluster.metadata_url}   (log {cluster.etcd.log_path})")
        for i, b in cluster.brokers.items():
            click.echo(f"broker {i}  {b.address}   (log {b.log_path})")
        click.echo(f"bootstrap {cluster.bootstrap}")
        kafka = cluster.kafka_addresses
        if kafka:
            click.echo(f"kafka     {','.join(kafka[i] for i in sorted(kafka))}   "
                       "(bootstrap.servers for Kafka clients)")
        click.echo(f"try: ferrymq --server {cluster.bootstrap} topic list   (Ctrl-C stops "
                   "everything)", err=True)
        while True:
            time.sleep(_WATCH_INTERVAL_S)
            dead = [name for name, alive in cluster.running().items() if not alive]
            if dead:
                raise CommandError(f"{', '.join(dead)} exited on its own; stopping the rest "
                                   f"(logs under {base_dir})")
    except KeyboardInterrupt:
        click.echo("stopping the brokers, then etcd ...", err=True)
    finally:
        try:
            cluster.stop()
        except KeyboardInterrupt:  # impatient: a second Ctrl-C kills what is left
            cluster.kill()
