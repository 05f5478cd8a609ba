"""Renderers for the ``ferrymq`` CLI: tables (rich) for people, JSON for programs.

Theory of operation
-------------------
:class:`Printer` turns client results into output and nothing else: no requests, no decisions.
Every method has two renderings: ``--json`` prints one JSON object per command (JSON lines for
the streaming commands ``produce`` and ``consume``); otherwise a table is drawn with rich. When
stdout is not a terminal the tables stay plain (no colours, no box lines, no wrapping) so that
``grep``/``awk`` work on them. Message bodies never pass through rich: a body could contain
text that looks like markup, so consumed messages are written as-is, one line each.
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
from collections.abc import Iterable, Sequence
from typing import IO, Any

import click
from rich import box
from rich.console import Console
from rich.table import Table

from ferrymq.client.admin import DeadLetter
from ferrymq.client.message import ReceivedMessage, SendResult
from ferrymq.protocol import messages as m

PLAIN_WIDTH = 10_000
"""Console width when stdout is not a terminal: wide enough that tables never wrap."""


def format_ms(ms: int) -> str:
    """A wall-clock time in ms since the epoch as ISO-8601 UTC (``-`` when unknown)."""
    if ms < 0:
        return "-"
    return _dt.datetime.fromtimestamp(ms / 1000, _dt.UTC).isoformat(timespec="milliseconds")


def _one_line(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def message_to_dict(msg: ReceivedMessage) -> dict[str, Any]:
    """A consumed message as a JSON-ready dict (body decoded as UTF-8 with replacement)."""
    return {
        "topic": msg.topic,
        "queue": msg.queue,
        "offset": msg.offset,
        "msg_id": msg.msg_id,
        "tag": msg.tags,
        "keys": list(msg.keys),
        "sharding_key": msg.sharding_key,
        "properties": msg.properties,
        "born_ms": msg.born_ms,
        "stored_ms": msg.stored_ms,
        "body": msg.body.decode("utf-8", errors="replace"),
    }


def send_result_to_dict(res: SendResult) -> dict[str, Any]:
    """A send result as a JSON-ready dict."""
    return {
        "msg_id": res.msg_id,
        "topic": res.topic,
        "queue": res.queue,
        "offset": res.offset,
        "durability": res.durability.value if res.durability is not None else None,
        "duplicate": res.duplicate,
    }


def topic_to_dict(resp: m.DescribeTopicResponse) -> dict[str, Any]:
    """A topic description as a JSON-ready dict; ``last_offset`` is null for an empty queue."""
    return {
        "name": resp.name,
        "topic_id": resp.topic_id,
        "config": resp.config,
        "queues": [
            {
                "queue": q,
                "first_offset": first,
                "last_offset": end - 1 if end > first else None,
                "end_offset": end,
                "bytes": size,
                "segments": segments,
                "last_append_ms": last_ms if last_ms >= 0 else None,
            }
            for q, first, end, size, segments, last_ms in resp.queues
        ],
        "scheduled_pending": resp.scheduled_pending,
        "next_due_ms": resp.next_due_ms if resp.next_due_ms >= 0 else None,
        "dedup_window_ms": resp.dedup_window_ms,
        "dedup_keys": resp.dedup_keys,
    }


def group_to_dict(resp: m.DescribeGroupResponse) -> dict[str, Any]:
    """A group description as a JSON-ready dict; ``committed`` is null when nothing is."""
    return {
        "group": resp.group,
        "state": resp.state,
        "generation": resp.generation,
        "members": [
            {
                "member_id": member_id,
                "client_id": client_id,
                "host": host,
                "queues": [{"topic": t, "queue": q} for t, q in queues],
            }
            for member_id, client_id, host, queues in resp.members
        ],
        "offsets": [
            {
                "topic": t,
                "queue": q,
                "committed": committed if committed >= 0 else None,
                "end_offset": end,
                "lag": lag,
            }
            for t, q, committed, end, lag in resp.offsets
        ],
    }


def format_duration_ms(ms: int) -> str:
    """A duration for people: ``250ms``, ``10s``, ``1.5s``, ``2m``, ``1h30m``, ``2d``."""
    if ms < 0:
        return "-"
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f}".rstrip("0").rstrip(".") + "s"
    units = (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000))
    parts: list[str] = []
    rest = ms
    for name, size in units:
        if rest >= size:
            parts.append(f"{rest // size}{name}")
            rest %= size
        if len(parts) == 2:
            break
    return "".join(parts)


def _opt(value: int) -> int | None:
    return value if value >= 0 else None


def delivery_to_dict(resp: m.DescribeDeliveryResponse) -> dict[str, Any]:
    """A delivery group description as a JSON-ready dict. Per queue ``lag`` is the messages of
    the queue the group has not finished (see :class:`~ferrymq.protocol.messages.
    DescribeDeliveryResponse`; from an older broker: ``end - next + in_flight``); the group's
    ``lag`` adds the retry queue's (pending and in flight). ``oldest_age_ms`` is the age of the
    oldest unfinished message (null when none)."""
    lags = resp.lag if len(resp.lag) == len(resp.queues) else [
        max(0, end - nxt) + in_flight for _t, _q, _f, nxt, end, in_flight, _a in resp.queues]
    return {
        "group": resp.group,
        "kind": "delivery",
        "lag": sum(lags) + resp.retry_pending + resp.retry_in_flight,
        "members": [
            {
                "member_id": mid,
                "client_id": cid,
                "host": host,
                "last_heartbeat_ms_ago": since,
                "in_flight": in_flight,
            }
            for mid, cid, host, since, in_flight in resp.members
        ],
        "queues": [
            {
                "topic": t,
                "queue": q,
                "acked_below": floor,
                "next": nxt,
                "end_offset": end,
                "in_flight": in_flight,
                "lag": lag,
                "oldest_age_ms": _opt(age),
            }
            for (t, q, floor, nxt, end, in_flight, age), lag in zip(resp.queues, lags,
                                                                      strict=True)
        ],
        "retry_pending": resp.retry_pending,
        "retry_in_flight": resp.retry_in_flight,
        "dlq_size": resp.dlq_size,
        "retry_policy": {"max_reconsume": resp.max_reconsume,
                         "retry_delays_ms": list(resp.retry_delays_ms)},
        "orderly": resp.orderly,
        "blocked_keys": [
            {"topic": t, "queue": q, "key": key, "msg_id": msg_id, "attempts": attempts,
             "since_ms": since, "next_attempt_ms": _opt(nxt), "reason": reason or None}
            for t, q, key, msg_id, attempts, since, nxt, reason in resp.blocked
        ],
    }


def status_to_dict(msg_id: str, resp: m.MessageStatusResponse) -> dict[str, Any]:
    """A message status as a JSON-ready dict (unknown times are null; ``offset`` is null for a
    transaction's half message that is not committed: it is not in the queue)."""
    return {
        "msg_id": msg_id,
        "topic": resp.topic,
        "queue": resp.queue,
        "offset": _opt(resp.offset),
        "groups": [
            {
                "group": g,
                "state": state,
                "member": member or None,
                "lease_until_ms": _opt(until),
                "reconsume_times": reconsume,
                "next_attempt_ms": _opt(next_at),
                "reason": reason or None,
                "at_ms": _opt(at),
            }
            for g, state, member, until, reconsume, next_at, reason, at in resp.statuses
        ],
    }


def _status_detail(state: str, member: str, until: int, reconsume: int, next_at: int,
                   reason: str, group: str, at: int) -> str:
    failed = f"failed {reconsume} times" if reconsume != 1 else "failed once"
    if state == "DELIVERED":
        text = f"to {member} until {format_ms(until)}"
        return f"{text} ({failed} before)" if reconsume else text
    if state == "RETRYING":
        return f"{failed}; next attempt at {format_ms(next_at)}; last failure: {reason or '-'}"
    when = f" at {format_ms(at)}" if at >= 0 else ""
    if state == "DEAD":
        return f"in %DLQ%{group}{when}: {reason or '-'}"
    if state == "WAITING":
        return "not delivered yet"
    if state == "PREPARED":  # a transaction's half message
        return f"{reason}; next check-back at {format_ms(next_at)}"
    if state in ("COMMITTED", "ROLLED_BACK"):
        return f"{reason}{when}"
    if state == "CONSUMED":
        return reason or f"acknowledged{when or ' (time no longer kept)'}"
    if state == "FILTERED":
        return reason or "filtered out by the group's tag expression"
    return "-"


def dead_letter_to_dict(d: DeadLetter) -> dict[str, Any]:
    """A dead letter as a JSON-ready dict (body decoded as UTF-8 with replacement)."""
    return {
        "group": d.group,
        "dlq_offset": d.dlq_offset,
        "dlq_msg_id": d.dlq_msg_id,
        "topic": d.topic,
        "queue": d.queue,
        "offset": d.offset,
        "msg_id": d.msg_id,
        "attempts": d.attempts,
        "reason": d.reason,
        "dead_ms": _opt(d.dead_ms),
        "born_ms": d.born_ms,
        "tag": d.tag,
        "keys": list(d.keys),
        "sharding_key": d.sharding_key,
        "properties": d.properties,
        "body": d.body.decode("utf-8", errors="replace"),
    }


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

    def topics(self, topics: Sequence[m.TopicMeta], internal_column: bool = False) -> None:
        """``topic list`` (``internal_column``: with ``--internal``, say which are the broker's
        own; JSON always has ``"internal"``)."""
        if self.json_mode:
            self.json({"topics": [{"name": t[0], "topic_id": t[1], "queues": t[2],
                                   "internal": m.is_internal_topic(t[0])} for t in topics]})
        elif internal_column:
            self.table(("TOPIC", "ID", "QUEUES", "INTERNAL"),
                       [(*t[:3], "yes" if m.is_internal_topic(t[0]) else "no") for t in topics])
        else:
            self.table(("TOPIC", "ID", "QUEUES"), [t[:3] for t in topics])

    def topic(self, resp: m.DescribeTopicResponse) -> None:
        """``topic describe``."""
        d = topic_to_dict(resp)
        if self.json_mode:
            self.json(d)
            return
        config = ", ".join(f"{k}={v}" for k, v in sorted(resp.config.items())) or "-"
        self.line(f"topic {resp.name} (id {resp.topic_id}, {len(resp.queues)} queues, "
                  f"config: {config})")
        if resp.scheduled_pending:
            self.line(f"scheduled: {resp.scheduled_pending} pending, next due "
                      f"{format_ms(resp.next_due_ms)} UTC")
        if resp.dedup_window_ms:
            self.line(f"dedup: window {resp.dedup_window_ms} ms, {resp.dedup_keys} keys "
                      "remembered")
        self.table(
            ("QUEUE", "FIRST", "LAST", "END", "BYTES", "SEGMENTS", "LAST APPEND (UTC)"),
            [
                (q["queue"], q["first_offset"],
                 "-" if q["last_offset"] is None else q["last_offset"], q["end_offset"],
                 q["bytes"], q["segments"], format_ms(q["last_append_ms"] or -1))
                for q in d["queues"]
            ],
        )

    # -- groups --------------------------------------------------------------------------------

    def groups(self, groups: Sequence[tuple[str, str, int]]) -> None:
        """``group list``."""
        if self.json_mode:
            self.json({"groups": [{"group": g, "state": s, "members": n} for g, s, n in groups]})
        else:
            self.table(("GROUP", "STATE", "MEMBERS"), groups)

    def group(self, resp: m.DescribeGroupResponse) -> None:
        """``group describe``."""
        if self.json_mode:
            self.json(group_to_dict(resp))
            return
        self.line(f"group {resp.group}: state {resp.state}, generation {resp.generation}, "
                  f"{len(resp.members)} members")
        if resp.members:
            self.table(
                ("MEMBER", "CLIENT", "HOST", "QUEUES"),
                [(mid, cid, host, " ".join(f"{t}/{q}" for t, q in qs) or "-")
                 for mid, cid, host, qs in resp.members],
            )
        self.table(
            ("TOPIC", "QUEUE", "COMMITTED", "END", "LAG"),
            [(t, q, c if c >= 0 else "-", end, lag) for t, q, c, end, lag in resp.offsets],
        )

    def groups_described(self, consumer: m.DescribeGroupResponse | None,
                         delivery: m.DescribeDeliveryResponse | None) -> None:
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

    def delivery_group(self, resp: m.DescribeDeliveryResponse) -> None:
        """``group describe`` of a delivery group (tables)."""
        d = delivery_to_dict(resp)
        self.line(f"delivery group {resp.group}: {len(resp.members)} members online, "
                  f"lag {d['lag']}, retry pending {resp.retry_pending}, retry in flight "
                  f"{resp.retry_in_flight}, DLQ {resp.dlq_size}")
        delays = " ".join(format_duration_ms(x) for x in resp.retry_delays_ms) or "-"
        if resp.orderly:
            self.line(f"orderly: one message per sharding key at a time; max_reconsume "
                      f"{resp.max_reconsume}, then the dead-letter queue")
        else:
            self.line(f"retry policy: max_reconsume {resp.max_reconsume}, delays {delays}")
        if resp.members:
            self.table(
                ("MEMBER", "CLIENT", "HOST", "LAST HEARTBEAT", "IN FLIGHT"),
                [(mid, cid or "-", host or "-", f"{format_duration_ms(since)} ago", n)
                 for mid, cid, host, since, n in resp.members],
            )
        else:
            self.line("no member online")
        self.table(
            ("TOPIC", "QUEUE", "ACKED BELOW", "NEXT", "END", "IN FLIGHT", "LAG", "OLDEST"),
            [(q["topic"], q["queue"], q["acked_below"], q["next"], q["end_offset"],
              q["in_flight"], q["lag"],
              "-" if q["oldest_age_ms"] is None else format_duration_ms(q["oldest_age_ms"]))
             for q in d["queues"]],
        )
        if resp.blocked:
            self.line("blocked keys (retried in place; `ferrymq group skip GROUP MSG_ID` "
                      "dead-letters one):")
            self.table(
                ("TOPIC", "QUEUE", "KEY", "MESSAGE", "ATTEMPTS", "SINCE", "NEXT", "REASON"),
                [(t, q, key or "-", msg_id, attempts, format_ms(since),
                  "delivered" if nxt < 0 else format_ms(nxt), _one_line(reason or "-"))
                 for t, q, key, msg_id, attempts, since, nxt, reason in resp.blocked],
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

    def offsets_reset(self, group: str, topic: str,
                      offsets: Sequence[tuple[str, int, int]]) -> None:
        """``group reset-offset``: the offsets now committed."""
        if self.json_mode:
            self.json({"group": group, "topic": topic,
                       "offsets": [{"topic": t, "queue": q, "offset": o} for t, q, o in offsets]})
        else:
            self.line(f"group {group}: offsets on {topic} now")
            self.table(("TOPIC", "QUEUE", "OFFSET"), offsets)

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
                body = _one_line(msg.body.decode("utf-8", errors="replace"))
                self.line(f"{msg.queue}\t{msg.offset}\t{msg.tags or '-'}\t{body}")

    # -- messages ------------------------------------------------------------------------------

    def message_status(self, msg_id: str, resp: m.MessageStatusResponse) -> None:
        """``message status``: one row per delivery group."""
        if self.json_mode:
            self.json(status_to_dict(msg_id, resp))
            return
        if resp.offset >= 0:
            self.line(f"message {msg_id}: {resp.topic}/{resp.queue} offset {resp.offset}")
        else:  # a transaction not committed (prepared or rolled back): not in the queue
            self.line(f"message {msg_id}: transaction for {resp.topic}/{resp.queue} (not in the "
                      "queue)")
        if not resp.statuses:
            self.line(f"no delivery group reads {resp.topic}")
            return
        self.table(
            ("GROUP", "STATE", "DETAIL"),
            [(g, state, _one_line(_status_detail(state, member, until, reconsume, next_at,
                                                 reason, g, at)))
             for g, state, member, until, reconsume, next_at, reason, at in resp.statuses],
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
            ("properties", _props(msg.properties)),
            ("born", format_ms(msg.born_ms)),
            ("stored", format_ms(msg.stored_ms)),
        ], msg.body)

    def _fields(self, rows: Sequence[tuple[str, str]], body: bytes) -> None:
        width = max(len(k) for k, _ in rows)
        for k, v in rows:
            self.line(f"{k + ':':<{width + 1}} {_one_line(v)}")
        self.line(f"{'body:':<{width + 1}} ({len(body)} bytes)")
        self.line(body.decode("utf-8", errors="replace"))

    def found_by_key(self, topic: str, key: str, resp: m.FindByKeyResponse) -> None:
        """``message find``: newest first; a note on stderr when the search was partial."""
        if self.json_mode:
            self.json({
                "topic": topic, "key": key, "unindexed": resp.unindexed,
                "messages": [
                    {"queue": q, "offset": o, "msg_id": mid, "stored_ms": stored,
                     "keys": list(keys)}
                    for q, o, mid, stored, keys in resp.messages
                ],
            })
        elif resp.messages:
            self.table(
                ("MSG ID", "QUEUE", "OFFSET", "STORED (UTC)", "KEYS"),
                [(mid, q, o, format_ms(stored), _one_line(" ".join(keys)))
                 for q, o, mid, stored, keys in resp.messages],
            )
        else:
            self.line(f"no message of {topic} has key {key!r}")
        if resp.unindexed:
            click.echo(f"note: {resp.unindexed} of the newest offsets were not searched yet "
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
              _one_line(d.reason) or "-")
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
            ("properties", _props(d.properties)),
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
        where = f" (DLQ offsets {first}..{end - 1})" if end > first else ""
        self.line(f"{would if dry_run else done} {count} dead letters of group {group}{where}")

    # -- users ---------------------------------------------------------------------------------

    def users(self, users: Sequence[tuple[str, bool, Sequence[str], Sequence[str],
                                          Sequence[str], int]]) -> None:
        """``user list``: name, admin, patterns, quota (no secrets)."""
        rows = [(n, a, list(p), list(c), list(g), q) for n, a, p, c, g, q in users]
        if self.json_mode:
            self.json([{"user": n, "admin": a, "produce": p, "consume": c, "groups": g,
                        "produce_bytes_per_s": q} for n, a, p, c, g, q in rows])
            return
        self.table(["USER", "ADMIN", "PRODUCE", "CONSUME", "GROUPS", "QUOTA B/S"],
                   [(n, "yes" if a else "no", ",".join(p) or "-", ",".join(c) or "-",
                     ",".join(g) or "-", q or "-") for n, a, p, c, g, q in rows])

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


def _props(props: dict[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(props.items())) or "-"
