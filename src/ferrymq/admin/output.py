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
        """Print a table; numbers are right-aligned."""
        cells = [[str(c) for c in r] for r in rows]
        if title:
            self.line(title)
        t = Table(box=self._box, show_edge=False, pad_edge=False, header_style="bold",
                  show_header=True)
        for i, name in enumerate(columns):
            numeric = bool(cells) and all(r[i].lstrip("-").isdigit() for r in cells)
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

    def topics(self, topics: Sequence[m.TopicMeta]) -> None:
        """``topic list``."""
        if self.json_mode:
            self.json({"topics": [{"name": n, "topic_id": i, "queues": q}
                                  for n, i, q, _code in topics]})
        else:
            self.table(("TOPIC", "ID", "QUEUES"), [(n, i, q) for n, i, q, _code in topics])

    def topic(self, resp: m.DescribeTopicResponse) -> None:
        """``topic describe``."""
        d = topic_to_dict(resp)
        if self.json_mode:
            self.json(d)
            return
        config = ", ".join(f"{k}={v}" for k, v in sorted(resp.config.items())) or "-"
        self.line(f"topic {resp.name} (id {resp.topic_id}, {len(resp.queues)} queues, "
                  f"config: {config})")
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
                self.line(f"{res.msg_id}\tqueue={res.queue}\toffset={res.offset}")

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
