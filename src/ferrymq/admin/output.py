"""Renderers for the ``ferrymq`` CLI: tables (rich) for people, JSON for programs.

Theory of operation
-------------------
:class:`Printer` turns client results into output and nothing else: no requests, no decisions.
It takes the admin client's typed results (:mod:`ferrymq.client.admin`: named fields, never wire
tuples); the JSON shapes and value formats live in :mod:`ferrymq.admin.formats`.
Every method has two renderings: ``--json`` prints one JSON object per command (JSON lines for
the streaming commands ``produce`` and ``consume``); otherwise a table is drawn with rich. When
stdout is not a terminal the tables stay plain (no colours, no box lines, no wrapping) so that
``grep``/``awk`` work on them. Message bodies never pass through rich: a body could contain
text that looks like markup, so consumed messages are written as-is, one line each.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Sequence
from typing import IO, Any

import click
from rich import box
from rich.console import Console
from rich.table import Table

from ferrymq.admin.formats import (
    cluster_to_dict,
    dead_letter_to_dict,
    delivery_to_dict,
    format_duration_ms,
    format_ms,
    format_properties,
    group_to_dict,
    key_search_to_dict,
    message_to_dict,
    one_line,
    send_result_to_dict,
    status_detail,
    status_to_dict,
    topic_to_dict,
)
from ferrymq.client.admin import (
    ClusterDescription,
    DeadLetter,
    DeliveryGroupDescription,
    DrainResult,
    GroupDescription,
    GroupListing,
    KeySearch,
    MessageStatus,
    QueueOffset,
    Reassignment,
    TopicDescription,
    TopicListing,
    UserInfo,
)
from ferrymq.client.message import ReceivedMessage, SendResult
from ferrymq.protocol import messages as m

PLAIN_WIDTH = 10_000
"""Console width when stdout is not a terminal: wide enough that tables never wrap."""


class Printer:
    """Writes command results to stdout, as tables or as JSON.

    Args:
        json_mode: print JSON instead of tables.
        file: where to write (default: stdout).
    """

    def __init__(self, json_mode: bool, file: IO[str] | None = None) -> None:
        self.json_mode = json_mode
        self._file = file if file is not None else sys.stdout
        self._tty = tty = self._file.isatty()
        self._console = Console(
            file=self._file,
            markup=False,
            highlight=False,
            emoji=False,
            width=None if tty else PLAIN_WIDTH,
            no_color=not tty,
        )
        self._box = box.SIMPLE_HEAD if tty else None

    # -- primitives ----------------------------------------------------------------------------

    def json(self, obj: Any) -> None:
        """Print one JSON document on one line."""
        click.echo(json.dumps(obj, ensure_ascii=False), file=self._file)

    def line(self, text: str) -> None:
        """Print one line of plain text (never interpreted as markup)."""
        click.echo(text, file=self._file)

    def table(self, columns: Sequence[str], rows: Iterable[Sequence[object]],
              title: str | None = None) -> None:
        """Print a table; columns of numbers are right-aligned (``-``, "none", counts as a
        number there)."""
        cells = [[str(c) for c in r] for r in rows]
        if title:
            self.line(title)
        t = Table(box=self._box, show_edge=False, pad_edge=False, header_style="bold",
                  show_header=True)
        for i, name in enumerate(columns):
            numbers = [_is_number(r[i]) for r in cells]
            numeric = any(numbers) and all(n or r[i] == "-" for n, r in zip(numbers, cells,
                                                                             strict=True))
            t.add_column(name, justify="right" if numeric else "left", no_wrap=True)
        for r in cells:
            t.add_row(*r)
        if self._tty:
            self._console.print(t)
            return
        with self._console.capture() as captured:
            self._console.print(t)
        for text in captured.get().splitlines():
            self.line(text.rstrip())

    # -- topics --------------------------------------------------------------------------------

    def topic_created(self, name: str, resp: m.CreateTopicResponse) -> None:
        """``topic create``."""
        if self.json_mode:
            self.json({"name": name, "topic_id": resp.topic_id, "queues": resp.queues})
        else:
            self.line(f"created topic {name} (id {resp.topic_id}, {resp.queues} queues)")

    def topic_deleted(self, name: str) -> None:
        """``topic delete``."""
        if self.json_mode:
            self.json({"name": name, "deleted": True})
        else:
            self.line(f"deleted topic {name}")

    def topics(self, topics: Sequence[TopicListing], internal_column: bool = False) -> None:
        """``topic list`` (``internal_column``: with ``--internal``, say which are the broker's
        own; JSON always has ``"internal"``)."""
        if self.json_mode:
            self.json({"topics": [{"name": t.name, "topic_id": t.topic_id, "queues": t.queues,
                                   "internal": m.is_internal_topic(t.name)} for t in topics]})
        elif internal_column:
            self.table(("TOPIC", "ID", "QUEUES", "INTERNAL"),
                       [(t.name, t.topic_id, t.queues,
                         "yes" if m.is_internal_topic(t.name) else "no") for t in topics])
        else:
            self.table(("TOPIC", "ID", "QUEUES"), [(t.name, t.topic_id, t.queues) for t in topics])

    def topic(self, topic: TopicDescription) -> None:
        """``topic describe``."""
        if self.json_mode:
            self.json(topic_to_dict(topic))
            return
        config = ", ".join(f"{k}={v}" for k, v in sorted(topic.config.items())) or "-"
        self.line(f"topic {topic.name} (id {topic.topic_id}, {len(topic.queues)} queues, "
                  f"config: {config})")
        if topic.scheduled_pending:
            self.line(f"scheduled: {topic.scheduled_pending} pending, next due "
                      f"{format_ms(topic.next_due_ms)} UTC")
        if topic.dedup_window_ms:
            self.line(f"dedup: window {topic.dedup_window_ms} ms, {topic.dedup_keys} keys "
                      "remembered")
        self.table(
            ("QUEUE", "FIRST", "LAST", "END", "BYTES", "SEGMENTS", "LAST APPEND (UTC)"),
            [
                (q.queue, q.first_offset, "-" if q.last_offset is None else q.last_offset,
                 q.end_offset, q.size_bytes, q.segments,
                 format_ms(q.last_append_ms if q.last_append_ms > 0 else -1))
                for q in topic.queues
            ],
        )

    # -- the cluster ---------------------------------------------------------------------------

    def preferred_leaders(self, moved: int) -> None:
        """``cluster preferred-leaders``: how many queues' leadership moved."""
        if self.json_mode:
            self.json({"moved": moved})
        else:
            self.line(f"{moved} queue{'' if moved == 1 else 's'} moved to the preferred leader")

    def reassigned(self, topic: str, queue: int, replicas: list[int], started: Reassignment,
                   done: bool) -> None:
        """``cluster reassign``: who joins, who leaves, and whether it finished."""
        if self.json_mode:
            self.json({"topic": topic, "queue": queue, "replicas": replicas,
                       "adding": started.adding, "removing": started.removing, "done": done})
            return
        self.line(f"{topic}/{queue}: replicas {replicas} "
                  + ("(done)" if done else "(started)")
                  + f"; adding {started.adding or 'none'}, removing {started.removing or 'none'}")

    def drained(self, broker_id: int, result: DrainResult) -> None:
        """``cluster drain``: leaderships moved away, and those the broker keeps."""
        if self.json_mode:
            self.json({"broker": broker_id, "moved": result.moved, "left": result.left})
            return
        self.line(f"{result.moved} queue{'' if result.moved == 1 else 's'} moved away from "
                  f"broker {broker_id}")
        if result.left:
            self.line(f"{result.left} queue{'' if result.left == 1 else 's'} still led by broker "
                      f"{broker_id}: no other replica is alive and in sync (stopping it makes "
                      "them unavailable until it is back)")

    def cluster(self, desc: ClusterDescription) -> None:
        """``cluster describe``: brokers, then queues (offline and under-replicated first)."""
        if self.json_mode:
            self.json(cluster_to_dict(desc))
            return
        controller = "none" if desc.controller < 0 else f"broker {desc.controller}"
        name = f"cluster {desc.cluster}" if desc.cluster else "single broker (a cluster of one)"
        self.line(f"{name}, controller: {controller}; {len(desc.queues)} queues, "
                  f"{len(desc.offline)} offline, {len(desc.under_replicated)} under-replicated")
        self.table(("BROKER", "ADDRESS", "ALIVE"),
                   [(b.broker_id, b.address or "-", "yes" if b.alive else "no")
                    for b in desc.brokers])
        self.table(
            ("TOPIC", "QUEUE", "LEADER", "EPOCH", "REPLICAS", "ISR", "MIN ISR", "STATE"),
            [(q.topic, q.queue, "-" if q.offline else q.leader, q.leader_epoch,
              ",".join(map(str, q.replicas)), ",".join(map(str, q.isr)) or "-", q.min_insync,
              "offline" if q.offline else "under-replicated" if q.under_replicated else "ok")
             for q in desc.queues])

    # -- groups --------------------------------------------------------------------------------

    def groups(self, groups: Sequence[GroupListing]) -> None:
        """``group list``."""
        if self.json_mode:
            self.json({"groups": [{"group": g.group, "state": g.state, "members": g.members}
                                  for g in groups]})
        else:
            self.table(("GROUP", "STATE", "MEMBERS"),
                       [(g.group, g.state, g.members) for g in groups])

    def group(self, group: GroupDescription) -> None:
        """``group describe``."""
        if self.json_mode:
            self.json(group_to_dict(group))
            return
        self.line(f"group {group.group}: state {group.state}, generation {group.generation}, "
                  f"{len(group.members)} members")
        if group.members:
            self.table(
                ("MEMBER", "CLIENT", "HOST", "QUEUES"),
                [(x.member_id, x.client_id, x.host,
                  " ".join(f"{t}/{q}" for t, q in x.queues) or "-") for x in group.members],
            )
        self.table(
            ("TOPIC", "QUEUE", "COMMITTED", "END", "LAG"),
            [(o.topic, o.queue, o.committed if o.committed >= 0 else "-", o.end_offset, o.lag)
             for o in group.offsets],
        )

    def groups_described(self, consumer: GroupDescription | None,
                         delivery: DeliveryGroupDescription | None) -> None:
        """``group describe``: a consumer group, a delivery group, or both of that name.

        JSON: the consumer group's object (with ``"kind": "consumer"``), the delivery group's
        (``"kind": "delivery"``), or ``{"group", "kind": "both", "consumer", "delivery"}``.
        """
        if self.json_mode:
            if consumer is not None and delivery is not None:
                self.json({"group": consumer.group, "kind": "both",
                           "consumer": {**group_to_dict(consumer), "kind": "consumer"},
                           "delivery": delivery_to_dict(delivery)})
            elif consumer is not None:
                self.json({**group_to_dict(consumer), "kind": "consumer"})
            elif delivery is not None:
                self.json(delivery_to_dict(delivery))
            return
        if consumer is not None:
            self.group(consumer)
        if delivery is not None:
            if consumer is not None:
                self.line("")
            self.delivery_group(delivery)

    def delivery_group(self, group: DeliveryGroupDescription) -> None:
        """``group describe`` of a delivery group (tables)."""
        self.line(f"delivery group {group.group}: {len(group.members)} members online, "
                  f"lag {group.total_lag}, retry pending {group.retry_pending}, retry in flight "
                  f"{group.retry_in_flight}, DLQ {group.dlq_size}")
        delays = " ".join(format_duration_ms(x) for x in group.retry_delays_ms) or "-"
        if group.orderly:
            self.line(f"orderly: one message per sharding key at a time; max_reconsume "
                      f"{group.max_reconsume}, then the dead-letter queue")
        else:
            self.line(f"retry policy: max_reconsume {group.max_reconsume}, delays {delays}")
        if group.members:
            self.table(
                ("MEMBER", "CLIENT", "HOST", "LAST HEARTBEAT", "IN FLIGHT"),
                [(x.member_id, x.client_id or "-", x.host or "-",
                  f"{format_duration_ms(x.last_heartbeat_ms_ago)} ago", x.in_flight)
                 for x in group.members],
            )
        else:
            self.line("no member online")
        self.table(
            ("TOPIC", "QUEUE", "ACKED BELOW", "NEXT", "END", "IN FLIGHT", "LAG", "OLDEST"),
            [(q.topic, q.queue, q.acked_below, q.next_offset, q.end_offset, q.in_flight, lag,
              "-" if q.oldest_age_ms < 0 else format_duration_ms(q.oldest_age_ms))
             for q, lag in zip(group.queues, group.queue_lags(), strict=True)],
        )
        if group.blocked:
            self.line("blocked keys (retried in place; `ferrymq group skip GROUP MSG_ID` "
                      "dead-letters one):")
            self.table(
                ("TOPIC", "QUEUE", "KEY", "MESSAGE", "ATTEMPTS", "SINCE", "NEXT", "REASON"),
                [(b.topic, b.queue, b.key or "-", b.msg_id, b.attempts, format_ms(b.since_ms),
                  "delivered" if b.next_attempt_ms < 0 else format_ms(b.next_attempt_ms),
                  one_line(b.reason or "-"))
                 for b in group.blocked],
            )

    def group_deleted(self, group: str, resp: m.DeleteGroupResponse) -> None:
        """``group delete``: which kinds of group went, and how many dead letters."""
        if self.json_mode:
            self.json({"group": group, "deleted": True, "consumer_group": resp.consumer_group,
                       "delivery_group": resp.delivery_group,
                       "dead_letters": resp.dead_letters})
            return
        what = []
        if resp.consumer_group:
            what.append("consumer group with its committed offsets")
        if resp.delivery_group:
            what.append(f"delivery group with its retry queue and {resp.dead_letters} dead "
                        "letters")
        self.line(f"deleted group {group}: {' and '.join(what)}")

    def offsets_reset(self, group: str, topic: str, offsets: Sequence[QueueOffset]) -> None:
        """``group reset-offset``: the offsets now committed."""
        if self.json_mode:
            self.json({"group": group, "topic": topic,
                       "offsets": [{"topic": o.topic, "queue": o.queue, "offset": o.offset}
                                   for o in offsets]})
        else:
            self.line(f"group {group}: offsets on {topic} now")
            self.table(("TOPIC", "QUEUE", "OFFSET"), [(o.topic, o.queue, o.offset) for o in offsets])

    # -- data ----------------------------------------------------------------------------------

    def sent(self, results: Iterable[SendResult]) -> None:
        """``produce``: one line (or JSON line) per stored message."""
        for res in results:
            if self.json_mode:
                self.json(send_result_to_dict(res))
            else:
                dup = "\tduplicate" if res.duplicate else ""
                self.line(f"{res.msg_id}\tqueue={res.queue}\toffset={res.offset}{dup}")

    def received(self, msgs: Iterable[ReceivedMessage]) -> None:
        """``consume``: ``queue<TAB>offset<TAB>tag<TAB>body`` per message (or JSON lines).

        Newlines and backslashes in the body are escaped so each message stays on one line.
        """
        for msg in msgs:
            if self.json_mode:
                self.json(message_to_dict(msg))
            else:
                body = one_line(msg.body.decode("utf-8", errors="replace"))
                self.line(f"{msg.queue}\t{msg.offset}\t{msg.tags or '-'}\t{body}")

    # -- messages ------------------------------------------------------------------------------

    def message_status(self, msg_id: str, status: MessageStatus) -> None:
        """``message status``: one row per delivery group."""
        if self.json_mode:
            self.json(status_to_dict(msg_id, status))
            return
        if status.offset >= 0:
            self.line(f"message {msg_id}: {status.topic}/{status.queue} offset {status.offset}")
        else:  # a half message not committed (prepared or rolled back): not in the queue
            self.line(f"message {msg_id}: half message for {status.topic}/{status.queue} (not in "
                      "the queue)")
        if not status.statuses:
            self.line(f"no delivery group reads {status.topic}")
            return
        self.table(
            ("GROUP", "STATE", "DETAIL"),
            [(s.group, s.state, one_line(status_detail(s))) for s in status.statuses],
        )

    def cancelled(self, msg_id: str) -> None:
        """``message cancel``."""
        if self.json_mode:
            self.json({"msg_id": msg_id, "cancelled": True})
        else:
            self.line(f"cancelled scheduled message {msg_id}")

    def message(self, msg: ReceivedMessage) -> None:
        """``message show``: the fields, one per line, then the body as it is."""
        if self.json_mode:
            self.json(message_to_dict(msg))
            return
        self._fields([
            ("msg_id", msg.msg_id),
            ("topic", msg.topic),
            ("queue", str(msg.queue)),
            ("offset", str(msg.offset)),
            ("tag", msg.tags or "-"),
            ("keys", " ".join(msg.keys) or "-"),
            ("sharding_key", msg.sharding_key or "-"),
            ("properties", format_properties(msg.properties)),
            ("born", format_ms(msg.born_ms)),
            ("stored", format_ms(msg.stored_ms)),
        ], msg.body)

    def _fields(self, rows: Sequence[tuple[str, str]], body: bytes) -> None:
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            self.line(f"{k + ':':<{width + 1}} {one_line(v)}")
        self.line(f"{'body:':<{width + 1}} ({len(body)} bytes)")
        self.line(body.decode("utf-8", errors="replace"))

    def found_by_key(self, topic: str, key: str, found: KeySearch) -> None:
        """``message find``: newest first; a note on stderr when the search was partial."""
        if self.json_mode:
            self.json(key_search_to_dict(topic, key, found))
        elif found.messages:
            self.table(
                ("MSG ID", "QUEUE", "OFFSET", "STORED (UTC)", "KEYS"),
                [(x.msg_id, x.queue, x.offset, format_ms(x.stored_ms), one_line(" ".join(x.keys)))
                 for x in found.messages],
            )
        else:
            self.line(f"no message of {topic} has key {key!r}")
        if found.unindexed:
            click.echo(f"note: {found.unindexed} of the newest offsets were not searched yet "
                       "(the broker's key index is catching up); try again shortly",
                       file=sys.stderr)

    # -- dead letters --------------------------------------------------------------------------

    def dead_letters(self, group: str, letters: Sequence[DeadLetter]) -> None:
        """``dlq list``."""
        if self.json_mode:
            self.json({"group": group,
                       "dead_letters": [dead_letter_to_dict(d) for d in letters]})
            return
        if not letters:
            self.line(f"no dead letters in group {group}")
            return
        self.table(
            ("DLQ OFFSET", "MSG ID", "TOPIC", "ATTEMPTS", "DEAD AT (UTC)", "REASON"),
            [(d.dlq_offset, d.msg_id or "-", d.topic or "-", d.attempts, format_ms(d.dead_ms),
              one_line(d.reason) or "-")
             for d in letters],
        )

    def dead_letter(self, d: DeadLetter) -> None:
        """``dlq show``."""
        if self.json_mode:
            self.json(dead_letter_to_dict(d))
            return
        self._fields([
            ("msg_id", d.msg_id or "-"),
            ("topic", d.topic or "-"),
            ("queue", str(d.queue)),
            ("offset", str(d.offset)),
            ("group", d.group),
            ("dlq_offset", str(d.dlq_offset)),
            ("dlq_msg_id", d.dlq_msg_id),
            ("attempts", str(d.attempts)),
            ("reason", d.reason or "-"),
            ("dead", format_ms(d.dead_ms)),
            ("tag", d.tag or "-"),
            ("keys", " ".join(d.keys) or "-"),
            ("sharding_key", d.sharding_key or "-"),
            ("properties", format_properties(d.properties)),
            ("born", format_ms(d.born_ms)),
        ], d.body)

    def dlq_done(self, action: str, group: str, count: int, first: int, end: int,
                 dry_run: bool) -> None:
        """``dlq redrive`` / ``dlq purge``: what was (or would be) done."""
        if self.json_mode:
            self.json({"group": group, "action": action, "dry_run": dry_run, "count": count,
                       "first": first, "end": end})
            return
        verb = {"redrive": ("redrove", "would redrive"), "purge": ("purged", "would purge")}
        done, would = verb[action]
        where = (f" (DLQ offset {first})" if end == first + 1 else
                 f" (DLQ offsets {first}..{end - 1})" if end > first else "")
        letters = "dead letter" if count == 1 else "dead letters"
        self.line(f"{would if dry_run else done} {count} {letters} of group {group}{where}")

    # -- users ---------------------------------------------------------------------------------

    def users(self, users: Sequence[UserInfo]) -> None:
        """``user list``: name, admin, patterns, quota (no secrets)."""
        if self.json_mode:
            self.json([{"user": u.name, "admin": u.admin, "produce": list(u.produce),
                        "consume": list(u.consume), "groups": list(u.groups),
                        "produce_bytes_per_s": u.produce_bytes_per_s} for u in users])
            return
        self.table(["USER", "ADMIN", "PRODUCE", "CONSUME", "GROUPS", "QUOTA B/S"],
                   [(u.name, "yes" if u.admin else "no", ",".join(u.produce) or "-",
                     ",".join(u.consume) or "-", ",".join(u.groups) or "-",
                     u.produce_bytes_per_s or "-") for u in users])

    def whoami(self, resp: m.WhoAmIResponse) -> None:
        """``whoami``: the principal and its rights."""
        if self.json_mode:
            self.json({"user": resp.user or None, "admin": resp.admin, "produce": resp.produce,
                       "consume": resp.consume, "groups": resp.groups})
            return
        if not resp.user:
            self.line("anonymous (the broker has authentication off: every right)")
            return
        self.line(f"user:    {resp.user}{'  (admin)' if resp.admin else ''}")
        self.line(f"produce: {', '.join(resp.produce) or '-'}")
        self.line(f"consume: {', '.join(resp.consume) or '-'}")
        self.line(f"groups:  {', '.join(resp.groups) or '-'}")


def _is_number(text: str) -> bool:
    return text.removeprefix("-").isdigit()
