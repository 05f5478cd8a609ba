"""Fuzz harness for every decoder (RELIABILITY.md T23a, issue 7). Not part of the test suite.

Each *target* feeds one fuzz input to one family of decoders and lets only the exceptions that
family declares escape; anything else (and a hang or a memory blow-up, which libFuzzer catches)
is a bug. The targets mirror ``tests/property/test_fuzz_decoders.py`` and add the on-disk
decoders of ``ferrymq.storage``:

========== ====================================================================== ===========================
target     decoders                                                               may raise
========== ====================================================================== ===========================
frames     ``FrameDecoder`` (whole, then one byte at a time), ``split_response``  ``ProtocolError``
bodies     ``decode`` of every request/response type in ``messages.REQUESTS``     ``ProtocolError``
records    batch headers, CRCs, records, properties, ``validate_batch``,          ``CorruptRecordError``
           ``marker_of``, ``read_dedup_keys``, ``read_due_times`` (inputs also    (``BrokerError`` limits,
           tried with their CRCs fixed up, to reach the checks behind them)       ``InvalidRequestError``)
properties ``parse_letter``, ``parse_due``, ``parse_tag_expression``,             as documented per function
           ``decode_msg_id``, ``check_user_name``, ``ScramCredential.decode``
scram      ``ScramClient.proof`` / ``server_signature_ok``, ``ScramServer.verify`` ``RemoteProtocolError``
users      the broker's users file, ``parse_users``                               ``ConfigError``
checkpoint ``read_checkpoint`` (recovery point, scheduler watermarks, snapshots)  ``CorruptRecordError``
indexes    ``OffsetIndex.load``, ``TimeIndex.load``, ``TxnIndex.entries``         nothing (None: rebuild)
journal    ``Journal.open`` (delivery-state journal replay)                       nothing (torn tail cut)
producers  producer-state snapshots, ``ProducerStateManager.read_snapshot``       nothing (snapshot skipped)
keyindex   ``KeyIndex.open`` and ``lookup`` of a ``.kix`` file, ``scan_keys``     nothing (index rebuilt)
schedule   scheduler bucket files ``decode_entries`` / ``pending_entries``,       nothing
           the watermark checkpoint ``read_watermarks`` / ``read_clock``
log        ``Log.open`` recovery of one or two fuzzed ``.log`` segments, then a   ``CorruptRecordError``
           read of what it kept                                                   (mid-log corruption)
========== ====================================================================== ===========================

Run one target under atheris (``pip install -e '.[fuzz]'``), one libFuzzer process per target::

    python fuzz/fuzz_decoders.py --target records [libFuzzer flags] [corpus_dir ...]
    python fuzz/fuzz_decoders.py --all --seconds 60     # every target in turn (make fuzz)
    python fuzz/fuzz_decoders.py --list

Without a corpus directory the target's seeds are written to ``fuzz/corpus/<target>/`` (kept
between runs) and used. Crash inputs go to ``fuzz/artifacts/``. Reproduce one with
``python fuzz/fuzz_decoders.py --target NAME fuzz/artifacts/<file>``.

Without atheris it falls back to Hypothesis: ``python fuzz/fuzz_decoders.py [--target NAME]
[--examples N]`` (seeds, arbitrary bytes and mutated seeds).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

try:
    import atheris
except ImportError:  # the Hypothesis fallback
    atheris = None

# The libFuzzer child process instruments FerryMQ's bytecode for coverage feedback; it must do so
# before FerryMQ is imported.
_FUZZING = atheris is not None and "--target" in sys.argv and "--hypothesis" not in sys.argv
with atheris.instrument_imports(include=["ferrymq"]) if _FUZZING else contextlib.nullcontext():
    import msgpack

    from ferrymq.broker.auth import parse_users
    from ferrymq.errors import (
        BrokerError,
        ConfigError,
        CorruptRecordError,
        InvalidRequestError,
        OffsetOutOfRangeError,
        ProtocolError,
        RemoteProtocolError,
    )
    from ferrymq.protocol import messages as m
    from ferrymq.protocol import records as r
    from ferrymq.protocol.auth import (
        MECHANISM,
        MIN_ITERATIONS,
        ScramClient,
        ScramCredential,
        ScramServer,
        check_user_name,
        decoy_credential,
    )
    from ferrymq.protocol.dedup import DEDUP_KEY, read_dedup_keys
    from ferrymq.protocol.frames import FrameDecoder, encode_frame, split_response
    from ferrymq.protocol.letters import Letter, letter_properties, parse_letter
    from ferrymq.protocol.markers import encode_marker, marker_of
    from ferrymq.protocol.schedule import DELAY, DELIVER_AT, parse_due, read_due_times
    from ferrymq.protocol.tags import parse_tag_expression
    from ferrymq.storage.checkpoint import read_checkpoint, write_checkpoint
    from ferrymq.storage.files import (
        INDEX_SUFFIX,
        LOG_SUFFIX,
        RECOVERY_POINT_FILE,
        TIMEINDEX_SUFFIX,
        segment_file_name,
    )
    from ferrymq.storage.index import OffsetIndex
    from ferrymq.storage.journal import Journal
    from ferrymq.storage.keyindex import KEY_INDEX_DIR, KeyIndex, scan_keys
    from ferrymq.storage.log import Log, LogConfig
    from ferrymq.storage.producer_state import ProducerStateManager
    from ferrymq.storage.schedule import (
        WATERMARKS_FILE,
        ScheduleStore,
        decode_entries,
        encode_entries,
        pending_entries,
    )
    from ferrymq.storage.timeindex import TimeIndex
    from ferrymq.storage.txnindex import TxnIndex

FUZZ_DIR = Path(__file__).resolve().parent
BODY_TYPES = sorted({*m.REQUESTS.values(), *(c.RESPONSE for c in m.REQUESTS.values())},
                    key=lambda c: c.__name__)
CORRUPT = (ProtocolError, CorruptRecordError)
NOW_MS = 1_763_683_200_000


class _Input:
    """Cuts a fuzz input into fields (a FuzzedDataProvider that also works without atheris)."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out

    def int(self, size: int, *, signed: bool = False) -> int:
        return int.from_bytes(self.take(size).ljust(size, b"\0"), "little", signed=signed)

    def chunk(self) -> bytes:
        """A length-prefixed (u8) field."""
        return self.take(self.int(1))

    def rest(self) -> bytes:
        return self.take(len(self.data))


def _fields(*parts: bytes) -> bytes:
    """Inverse of :meth:`_Input.chunk` (to build seeds)."""
    return b"".join(bytes((len(p),)) + p for p in parts)


_scratch: Path | None = None


def scratch() -> Path:
    """A per-process scratch directory (on tmpfs when there is one), removed at exit (libFuzzer
    exits without running atexit: ``--all`` hands its children one and removes it itself)."""
    global _scratch
    if _scratch is None and os.environ.get("FERRYMQ_FUZZ_SCRATCH"):
        _scratch = Path(os.environ["FERRYMQ_FUZZ_SCRATCH"])
    if _scratch is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _scratch = Path(tempfile.mkdtemp(prefix="ferrymq-fuzz-", dir=base))
        import atexit

        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch


def _fresh_dir(name: str) -> Path:
    d = scratch() / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    return d


# --- protocol -----------------------------------------------------------------------------------


def fuzz_frames(data: bytes) -> None:
    """FrameDecoder, whole and one byte at a time: the same frames or a ProtocolError."""
    max_frame = (64, 4096, 1 << 16)[data[0] % 3] if data else 64
    whole: list[Any] | None
    try:
        whole = [(f.api_key, f.correlation_id, bytes(f.payload))
                 for f in FrameDecoder(max_frame).feed(data)]
    except ProtocolError:
        whole = None
    dec = FrameDecoder(max_frame)
    split: list[Any] = []
    try:
        for i in range(len(data)):
            split += [(f.api_key, f.correlation_id, bytes(f.payload))
                      for f in dec.feed(data[i : i + 1])]
            if dec.buffered > max_frame + 12:
                raise AssertionError("decoder buffered more than a frame")
    except ProtocolError:
        pass
    else:
        if whole is not None and whole != split:
            raise AssertionError("chunking changed the decoded frames")
    with contextlib.suppress(ProtocolError):
        split_response(data)


def fuzz_bodies(data: bytes) -> None:
    """Every request and response body decoder, over bytes and over a memoryview."""
    view = memoryview(data)
    for cls in BODY_TYPES:
        with contextlib.suppress(ProtocolError):
            cls.decode(data)
        with contextlib.suppress(ProtocolError):
            cls.decode(view)


def fix_crcs(data: bytes) -> bytes:
    """``data`` with the CRCs of every batch that iter_batches finds recomputed."""
    buf = bytearray(data)
    for pos, h in r.iter_batches(buf):
        end = pos + r.LENGTH_PREFIX + h.batch_length
        struct.pack_into("<I", buf, pos + 24, r.crc32c(memoryview(buf)[pos + 28 : end]))
        r.seal_header_crc(buf, pos)
    if not any(True for _ in r.iter_batches(buf)) and len(buf) >= r.HEADER_SIZE:
        struct.pack_into("<I", buf, 24, r.crc32c(memoryview(buf)[28:]))
        r.seal_header_crc(buf, 0)
    return bytes(buf)


def _walk_batches(buf: bytes) -> None:
    for pos, h in r.iter_batches(buf):
        for rec in r.iter_raw_records(buf, pos, h):
            r.record_fields(buf, rec[2] - r.RECORD_PREFIX_SIZE)
            r.record_body(buf, rec[2] - r.RECORD_PREFIX_SIZE)
            r.decode_properties(buf[rec[5] : rec[6]])
        r.walk_records(buf, pos, h, 0, lambda ctx, b, p, off: r.record_fields(b, p), None)
        with contextlib.suppress(CorruptRecordError):
            marker_of(buf, pos, h)
        with contextlib.suppress(InvalidRequestError, *CORRUPT):
            read_dedup_keys(buf, pos, h)
        with contextlib.suppress(InvalidRequestError, *CORRUPT):
            read_due_times(buf, pos, h, max_delay_ms=1000, now_ms=0)
        with contextlib.suppress(InvalidRequestError, *CORRUPT):
            read_due_times(buf, pos, h, max_delay_ms=None, now_ms=NOW_MS)


def fuzz_records(data: bytes) -> None:
    """The record-batch decoders and what is stored in batches (markers, dedup keys, due times)."""
    for buf in (data, fix_crcs(data)):
        for fn in (r.decode_header, r.check_stored_batch, r.decode_records, r.decode_properties):
            with contextlib.suppress(*CORRUPT):
                fn(buf)
        with contextlib.suppress(*CORRUPT, BrokerError):
            r.validate_batch(buf, max_message_bytes=256, max_records=1000, check_header_crc=True)
        with contextlib.suppress(*CORRUPT):
            _walk_batches(buf)


def _props(data: bytes) -> dict[str, str]:
    """A property map from a fuzz input: msgpack when it is one, else ``key=value`` lines."""
    with contextlib.suppress(CorruptRecordError):
        return r.decode_properties(data)
    text = data.decode("utf-8", "replace")
    out: dict[str, str] = {}
    for line in text.split("\n"):
        k, _, v = line.partition("=")
        out[k] = v
    return out


def fuzz_properties(data: bytes) -> None:
    """Decoders of property maps and of short texts."""
    props = _props(data)
    with contextlib.suppress(CorruptRecordError):
        parse_letter(props)
    with contextlib.suppress(InvalidRequestError):
        parse_due(props)
    text = data.decode("utf-8", "replace")
    with contextlib.suppress(InvalidRequestError):
        parse_tag_expression(text)
    with contextlib.suppress(ValueError):
        r.decode_msg_id(text)
    with contextlib.suppress(ValueError):
        check_user_name(text)
    with contextlib.suppress(ValueError):
        ScramCredential.decode(text)


_CRED = ScramCredential.derive("secret", b"s" * 16)
_DECOY = decoy_credential("alice", b"k" * 32)


def fuzz_scram(data: bytes) -> None:
    """Both sides of a SCRAM exchange fed a hostile peer's messages."""
    inp = _Input(data)
    salt, nonce, proof = inp.chunk(), inp.chunk(), inp.chunk()
    iterations = inp.int(8, signed=True)
    if MIN_ITERATIONS < iterations <= 1_000_000:
        iterations = MIN_ITERATIONS  # keep PBKDF2 affordable; the bounds are what is fuzzed
    client = ScramClient("alice", "secret", b"c" * 24)
    with contextlib.suppress(RemoteProtocolError):
        client.proof(salt, iterations, nonce)
    client.server_signature_ok(proof)
    for cred in (_CRED, None):
        with contextlib.suppress(RemoteProtocolError):
            server = ScramServer("alice", cred, nonce, b"s" * 24, _DECOY)
            if server.verify(proof) is not None:
                raise AssertionError("a fuzzed proof was accepted")


def fuzz_users(data: bytes) -> None:
    """The broker's users file (TOML) parser."""
    with contextlib.suppress(ConfigError):
        parse_users(data.decode("utf-8", "replace"))


# --- storage ------------------------------------------------------------------------------------


def fuzz_checkpoint(data: bytes) -> None:
    """A checkpoint file: its payload or CorruptRecordError."""
    path = scratch() / "state.checkpoint"
    path.write_bytes(data)
    with contextlib.suppress(CorruptRecordError):
        read_checkpoint(path)


def fuzz_indexes(data: bytes) -> None:
    """Offset, time and aborted-transaction index files: loaded (and then usable) or refused."""
    inp = _Input(data)
    base = inp.int(4)
    size = inp.int(4)
    max_rel = inp.int(4)
    body = inp.rest()
    d = scratch()
    path = d / "index"
    path.write_bytes(body)
    oi = OffsetIndex.load(path, base, size_bytes=size, max_relative_offset=max_rel)
    if oi is not None:
        oi.lookup(base + max_rel // 2)
        if oi.to_bytes() != body:
            raise AssertionError("offset index does not round-trip")
    ti = TimeIndex.load(path, base, max_relative_offset=max_rel)
    if ti is not None:
        ti.lookup_before(size)
        if ti.to_bytes() != body:
            raise AssertionError("time index does not round-trip")
    entries = TxnIndex(path, base, present=True).entries()
    if any(e.first_offset > e.marker_offset or e.marker_offset < base for e in entries):
        raise AssertionError("impossible aborted-transaction entry kept")


def fuzz_journal(data: bytes) -> None:
    """Journal replay: the valid records, the torn tail cut, never an exception."""
    path = scratch() / "state.journal"
    path.write_bytes(data)
    j, _records = Journal.open(path)
    try:
        if j.size + j.dropped_bytes != len(data) or path.stat().st_size != j.size:
            raise AssertionError("journal replay lost track of its size")
    finally:
        j.close()


def fuzz_producers(data: bytes) -> None:
    """Producer-state snapshots: the payload as a checkpoint, and the raw bytes as the file."""
    d = _fresh_dir("producers")
    raw = data[1:]
    path = d / segment_file_name(5, ".snapshot")
    if data[:1] == b"\x01":
        path.write_bytes(raw)
    else:
        write_checkpoint(path, raw)
    offset, _producers = ProducerStateManager(d, producer_id_expiry_ms=1000).read_snapshot(10)
    if offset not in (5, -1):
        raise AssertionError(f"snapshot offset {offset}")


_keyindex_log: Log | None = None


def _keyed_log() -> Log:
    """A small log with keyed records (the key index's anchors point into it)."""
    global _keyindex_log
    if _keyindex_log is None:
        d = scratch() / "keyed-log"
        log, _ = Log.open(d, LogConfig(), clean_shutdown=False, now_ms=NOW_MS)
        for i in range(6):
            batch = r.encode_batch([r.RecordInput(b"b", 0, keys=f"k{i}\0k{i + 1}".encode()),
                                    r.RecordInput(b"c", 1, keys=b"x")], attributes=r.ATTR_HAS_KEYS)
            log.append(batch, now_ms=NOW_MS + i)
        _keyindex_log = log
    return _keyindex_log


def fuzz_keyindex(data: bytes) -> None:
    """A ``.kix`` file: opened (damage cut, stale anchors dropped) and looked up; and scan_keys
    over arbitrary log bytes. Never an exception."""
    log = _keyed_log()
    qdir = scratch() / "keyindex-queue"
    kdir = qdir / KEY_INDEX_DIR
    if kdir.exists():
        shutil.rmtree(kdir)
    kdir.mkdir(parents=True)
    (kdir / segment_file_name(0, ".kix")).write_bytes(data)
    index, report = KeyIndex.open(qdir, log, file_bytes=1 << 16)
    for key in (b"k1", b"x", b"nope"):
        for offsets in index.lookup(key):
            if offsets != sorted(offsets, reverse=True):
                raise AssertionError("lookup offsets not newest first")
    if report.next_offset > log.end_offset:
        raise AssertionError("key index claims offsets the log does not have")
    for start in (0, 3):
        scan_keys(data, start)
        scan_keys(fix_crcs(data), start)


_schedule: ScheduleStore | None = None


def fuzz_schedule(data: bytes) -> None:
    """Scheduler bucket files and its watermark checkpoint. Never an exception."""
    global _schedule
    scan = decode_entries(data)
    if scan.torn_bytes + len(scan.entries) * 32 + scan.corrupt * 32 != len(data):
        raise AssertionError("bucket scan does not account for every byte")
    pending_entries(scan.entries)
    if _schedule is None:
        _schedule = ScheduleStore(scratch() / "schedule")
    write_checkpoint(_schedule.directory / WATERMARKS_FILE, data)
    _schedule.read_watermarks()
    _schedule.read_clock()


def fuzz_log(data: bytes) -> None:
    """Log recovery (``Log.open``) of fuzzed segment files, then a read of what it kept.

    Input: a flags byte, then (bit 2) a u16 split position and a u16 base offset: the log bytes
    are cut there into two segments, the second one based at that offset; (bit 3) u16-length-
    prefixed ``.index`` and ``.timeindex`` files, written for every segment; (bit 4) a u8-length-
    prefixed recovery-point checkpoint payload; then the log bytes. Bit 0: clean shutdown; bit 1:
    fix the batch CRCs of the log bytes first. The input says everything: nothing is kept from
    the previous one.
    """
    inp = _Input(data)
    flags = inp.int(1)
    split = inp.int(2) if flags & 4 else 0
    second_base = inp.int(2) if flags & 4 else 0
    index = inp.take(inp.int(2)) if flags & 8 else None
    timeindex = inp.take(inp.int(2)) if flags & 8 else None
    recovery_point = inp.chunk() if flags & 16 else None
    body = inp.rest()
    if flags & 2:
        body = fix_crcs(body)
    d = _fresh_dir("log")
    files = {0: body}
    if flags & 4 and second_base > 0:
        files = {0: body[:split], second_base: body[split:]}
    for base, content in files.items():
        (d / segment_file_name(base, LOG_SUFFIX)).write_bytes(content)
        if index is not None and timeindex is not None:
            (d / segment_file_name(base, INDEX_SUFFIX)).write_bytes(index)
            (d / segment_file_name(base, TIMEINDEX_SUFFIX)).write_bytes(timeindex)
    if recovery_point is not None:
        write_checkpoint(d / RECOVERY_POINT_FILE, recovery_point)
    try:
        log, report = Log.open(d, LogConfig(index_interval_bytes=64), clean_shutdown=bool(flags & 1),
                               now_ms=NOW_MS)
    except CorruptRecordError:
        return
    # After an unclean start everything kept was checked: it must read back whole. A clean
    # start trusts the files (their damage is not looked for), so reads may meet it.
    allowed: tuple[type[Exception], ...] = (CorruptRecordError,) if flags & 1 else ()
    try:
        pos = log.start_offset
        while pos < log.end_offset:
            chunk = log.read(pos, 1 << 16)
            batches = list(r.iter_batches(chunk))
            nxt = batches[-1][1].last_offset + 1 if batches else pos
            if nxt <= pos:
                if allowed:
                    break
                raise AssertionError(f"no progress reading at offset {pos} below the end {log.end_offset}")
            pos = nxt
    except (OffsetOutOfRangeError, *allowed):
        pass
    finally:
        log.close()
    if report.end_offset < report.start_offset:
        raise AssertionError("recovered log ends before it starts")


TARGETS: dict[str, Callable[[bytes], None]] = {
    "frames": fuzz_frames,
    "bodies": fuzz_bodies,
    "records": fuzz_records,
    "properties": fuzz_properties,
    "scram": fuzz_scram,
    "users": fuzz_users,
    "checkpoint": fuzz_checkpoint,
    "indexes": fuzz_indexes,
    "journal": fuzz_journal,
    "producers": fuzz_producers,
    "keyindex": fuzz_keyindex,
    "schedule": fuzz_schedule,
    "log": fuzz_log,
}


# --- seeds --------------------------------------------------------------------------------------


def _batches() -> list[bytes]:
    props = r.encode_properties({"a": "b"})
    plain = r.encode_batch([r.RecordInput(b"body", 1, tag=b"t", keys=b"k", properties=props),
                            r.RecordInput(b"", 2)], attributes=r.ATTR_HAS_KEYS)
    dedup = r.encode_batch([r.RecordInput(b"d", 0, properties=r.encode_properties({DEDUP_KEY: "k1"}))],
                           attributes=r.ATTR_DEDUP)
    sched = r.encode_batch([r.RecordInput(b"s", 0, properties=r.encode_properties({DELAY: "500"})),
                            r.RecordInput(b"s", 0, properties=r.encode_properties({DELIVER_AT: "9"}))],
                           attributes=r.ATTR_SCHEDULED)
    txn = r.encode_batch([r.RecordInput(b"t", 0)], producer_id=7, producer_epoch=0, base_sequence=0,
                         attributes=r.ATTR_TRANSACTIONAL)
    marker = encode_marker(producer_id=7, producer_epoch=0, commit=False, transactional_id="tx",
                           coordinator_offset=3, timestamp_ms=NOW_MS)
    return [bytes(b) for b in (plain, dedup, sched, txn, marker)]


def _log_files(batches: list[bytes]) -> tuple[bytes, bytes, bytes]:
    """The ``.log``, ``.index`` and ``.timeindex`` files of a log holding ``batches``."""
    d = scratch() / "seed-log"
    shutil.rmtree(d, ignore_errors=True)
    log, _ = Log.open(d, LogConfig(index_interval_bytes=64), clean_shutdown=False, now_ms=NOW_MS)
    for i, b in enumerate(batches):
        log.append(b, now_ms=NOW_MS + i)
    log.close()
    return tuple((d / segment_file_name(0, s)).read_bytes()  # type: ignore[return-value]
                 for s in (LOG_SUFFIX, INDEX_SUFFIX, TIMEINDEX_SUFFIX))


def seed_corpus(target: str) -> list[bytes]:
    """Valid inputs of ``target`` to start from."""
    batches = _batches()
    if target == "frames":
        return [encode_frame(m.ApiKey.PING, 1, 0, 1, b"\x90"),
                encode_frame(m.ApiKey.PRODUCE, 1, 0, 2,
                             m.ProduceRequest(1000, [("t", 0, batches[0])]).encode()),
                encode_frame(m.ApiKey.AUTH_START, 1, 0, 3,
                             m.AuthStartRequest(MECHANISM, "alice", b"n" * 24).encode())
                + encode_frame(m.ApiKey.PING, 1, 2, 4, b"\x90")]
    if target == "bodies":
        return [m.ProduceRequest(1000, [("t", 0, batches[0])]).encode(),
                m.MetadataRequest(["a", "b"], True).encode(),
                m.FetchRequest(1, 1, 1, [("t", 0, 0, 100, "*")]).encode(),
                m.AuthStartRequest(MECHANISM, "alice", b"n" * 24).encode(),
                m.AuthFinishRequest(b"p" * 32).encode()]
    if target == "records":
        return [*batches, b"".join(batches)]
    if target == "properties":
        letter = letter_properties({"u": "v"}, Letter("t", 1, 2, "0" * 28, 3, 4, "why", 5))
        return [r.encode_properties(letter), r.encode_properties({DELAY: "100"}),
                f"{DELIVER_AT}=123\nx=y".encode(), b"a || b || c", b"0000000100020000000000000003",
                _CRED.encode().encode()]
    if target == "scram":
        return [_fields(b"s" * 16, b"n" * 24, b"p" * 32) + MIN_ITERATIONS.to_bytes(8, "little")]
    if target == "users":
        return [(f'[users.alice]\nscram = "{_CRED.encode()}"\nadmin = false\nproduce = ["t*"]\n'
                 'consume = ["t*"]\ngroups = ["g"]\nproduce_bytes_per_s = 1000\n').encode()]
    if target == "checkpoint":
        path = scratch() / "seed.checkpoint"
        write_checkpoint(path, struct.pack("<qq", 42, NOW_MS))
        return [path.read_bytes()]
    if target == "indexes":
        oi = OffsetIndex(scratch() / "seed.index", 100)
        ti = TimeIndex(scratch() / "seed.timeindex", 100)
        for i in range(1, 5):
            oi.append(100 + 10 * i, 4096 * i)
            ti.maybe_append(NOW_MS + i, 100 + 10 * i)
        head = struct.pack("<III", 100, 1 << 20, 1000)
        return [head + oi.to_bytes(), head + ti.to_bytes(),
                head + struct.pack("<qqq", 7, 100, 120) * 2]
    if target == "journal":
        path = scratch() / "seed.journal"
        path.unlink(missing_ok=True)
        j, _ = Journal.open(path)
        j.append(["ack", "g", 1, [1, 2, 3]])
        j.append({"snapshot": b"x", "n": 1.5})
        j.close()
        return [path.read_bytes()]
    if target == "producers":
        doc = {"version": 2, "producers": [[7, 0, NOW_MS, -1, [[0, 1, 0, 1, NOW_MS]]],
                                           [8, 1, NOW_MS, 5, []]]}
        v1 = {"version": 1, "producers": [[7, 0, NOW_MS, [[0, 1, 0, 1, NOW_MS]]]]}
        return [b"\0" + msgpack.packb(doc), b"\0" + msgpack.packb(v1)]
    if target == "keyindex":
        log = _keyed_log()
        qdir = scratch() / "seed-keyindex"
        shutil.rmtree(qdir, ignore_errors=True)
        index, _ = KeyIndex.open(qdir, log)
        index.index(log, 6, 1 << 20)
        index.index(log, log.end_offset, 1 << 20)
        return [p.read_bytes() for p in sorted((qdir / KEY_INDEX_DIR).glob("*.kix"))]
    if target == "schedule":
        entries = encode_entries([(0, NOW_MS, 1, 0, 5, 0), (0, NOW_MS, 1, 0, 6, -3),
                                  (1, NOW_MS, 1, 0, 5, 0), (2, NOW_MS + 9, 2, 1, 7, 1 << 33)])
        marks = msgpack.packb({"version": 1, "watermarks": [[1, 0, 10], [2, 1, 3]],
                               "clock": [5, NOW_MS, -2, 2]})
        return [entries, marks]
    if target == "log":
        whole, index, timeindex = _log_files(batches)
        indexes = struct.pack("<H", len(index)) + index + struct.pack("<H", len(timeindex)) + timeindex
        return [b"\0" + whole, b"\1" + whole, b"\x04" + struct.pack("<HH", 200, 2) + whole,
                b"\x09" + indexes + whole,
                b"\x10" + _fields(struct.pack("<qq", 3, NOW_MS)) + whole]
    raise KeyError(target)


# --- running ------------------------------------------------------------------------------------


def _option(name: str, default: str | None = None) -> str | None:
    if name in sys.argv:
        i = sys.argv.index(name)
        value = sys.argv[i + 1]
        del sys.argv[i : i + 2]
        return value
    return default


def run_atheris(target: str) -> None:
    """Run one target under libFuzzer (the remaining argv are libFuzzer's)."""
    assert atheris is not None
    fn = TARGETS[target]
    args = list(sys.argv)
    if not any(not a.startswith("-") for a in args[1:]):  # no corpus dir or input given
        corpus = FUZZ_DIR / "corpus" / target
        corpus.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(seed_corpus(target)):
            (corpus / f"seed-{i}").write_bytes(seed)
        args.append(str(corpus))
    if not any(a.startswith("-artifact_prefix=") for a in args):
        (FUZZ_DIR / "artifacts").mkdir(exist_ok=True)
        args.insert(1, f"-artifact_prefix={FUZZ_DIR / 'artifacts'}/{target}-")
    atheris.Setup(args, fn)
    atheris.Fuzz()


def run_hypothesis(targets: list[str], examples: int) -> None:
    """Seeds, arbitrary bytes and mutated seeds through each target (no atheris needed)."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    for name in targets:
        fn = TARGETS[name]
        seeds = seed_corpus(name)
        inputs = st.binary(max_size=2048) | st.builds(
            lambda s, at, junk: s[:at] + junk + s[at + len(junk) :],
            st.sampled_from(seeds), st.integers(0, 600), st.binary(max_size=16),
        ) | st.builds(lambda s, at: s[:at], st.sampled_from(seeds), st.integers(0, 600))

        for s in seeds:
            fn(s)
        settings(max_examples=examples, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))(given(inputs)(fn))()
        print(f"hypothesis fallback: {name}: {examples} inputs, no unexpected exception", flush=True)


_STAT = re.compile(r"stat::(number_of_executed_units|average_exec_per_sec):\s*(\d+)")
_STATUS = re.compile(r"^#(\d+)\s", re.MULTILINE)


def run_all(targets: list[str], seconds: int, extra: list[str]) -> int:
    """Every target in its own libFuzzer process, one after the other; a summary at the end."""
    out_dir = FUZZ_DIR / "out"
    out_dir.mkdir(exist_ok=True)
    rows: list[tuple[str, str, str, str, str]] = []
    failed = 0
    for name in targets:
        log_path = out_dir / f"{name}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--target", name,
               f"-max_total_time={seconds}", "-rss_limit_mb=512", "-timeout=2",
               "-print_final_stats=1", *extra]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        started = time.monotonic()
        tmp = tempfile.mkdtemp(prefix="ferrymq-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        try:
            with open(log_path, "wb") as log:
                rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "FERRYMQ_FUZZ_SCRATCH": tmp})
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        wall = time.monotonic() - started
        text = log_path.read_text(errors="replace")
        stats = dict(_STAT.findall(text))
        status = _STATUS.findall(text)
        runs = int(stats.get("number_of_executed_units", status[-1] if status else 0))
        rate = int(stats.get("average_exec_per_sec", runs / max(wall, 1e-9)))
        if rc:
            failed += 1
            print(text[-4000:], flush=True)
        rows.append((name, str(runs), str(rate), f"{wall:.0f}",
                     "ok" if rc == 0 else f"FAILED (exit {rc}, see {log_path})"))
    print(f"\n{'target':<12} {'runs':>10} {'exec/s':>8} {'wall s':>7}  result")
    for row in rows:
        print(f"{row[0]:<12} {row[1]:>10} {row[2]:>8} {row[3]:>7}  {row[4]}")
    return 1 if failed else 0


def main() -> None:
    logging.disable(logging.CRITICAL)  # recovery's warnings about the damage it was fed
    if "--list" in sys.argv:
        print("\n".join(TARGETS))
        return
    target = _option("--target")
    if target is not None and target not in TARGETS:
        sys.exit(f"unknown target {target!r}; one of: {', '.join(TARGETS)}")
    if "--all" in sys.argv:
        sys.argv.remove("--all")
        seconds = int(_option("--seconds", "60") or 60)
        if atheris is None:
            sys.exit("atheris is not installed: pip install -e '.[fuzz]'")
        sys.exit(run_all(list(TARGETS), seconds, sys.argv[1:]))
    if atheris is not None and target is not None and "--hypothesis" not in sys.argv:
        run_atheris(target)
        return
    with contextlib.suppress(ValueError):
        sys.argv.remove("--hypothesis")
    examples = int(_option("--examples", "2000") or 2000)
    run_hypothesis([target] if target else list(TARGETS), examples)


if __name__ == "__main__":
    main()
