"""Fuzz harness for the protocol decoders (RELIABILITY.md T23a). Not part of the test suite.

Targets: :class:`FrameDecoder` (whole input, then the same input one byte at a time), every
request/response body decoder, and the record-batch decoders (``iter_batches``,
``iter_raw_records``, ``check_stored_batch``, ``validate_batch``, ``decode_properties``), with
the input also tried with its CRCs fixed up so the structural checks behind them are reached.
Only ``ProtocolError`` and ``CorruptRecordError`` (and, from ``validate_batch``, the other
``BrokerError`` limits) may escape; anything else is a bug.

Run with atheris (``pip install atheris``)::

    python fuzz/fuzz_decoders.py -rss_limit_mb=256 -timeout=1 -max_total_time=60 [corpus_dir]

Without atheris it falls back to Hypothesis (``python fuzz/fuzz_decoders.py [--examples N]``).
"""

from __future__ import annotations

import struct
import sys

from ferrymq.errors import BrokerError, CorruptRecordError, ProtocolError
from ferrymq.protocol import messages as m
from ferrymq.protocol import records as r
from ferrymq.protocol.frames import FrameDecoder, encode_frame

ALLOWED = (ProtocolError, CorruptRecordError)
BODY_TYPES = [*m.REQUESTS.values(), *{c.RESPONSE for c in m.REQUESTS.values()}]


def fuzz_frames(data: bytes) -> None:
    """FrameDecoder, whole and one byte at a time: same frames or a ProtocolError."""
    whole: list[object] | None
    try:
        whole = list(FrameDecoder(1 << 16).feed(data))
    except ProtocolError:
        whole = None
    dec = FrameDecoder(1 << 16)
    split: list[object] = []
    try:
        for i in range(len(data)):
            split += dec.feed(data[i : i + 1])
    except ProtocolError:
        return
    if whole is not None and whole != split:
        raise AssertionError("chunking changed the decoded frames")
    if dec.buffered > (1 << 16):
        raise AssertionError("decoder buffered more than max_frame_bytes")


def fuzz_bodies(data: bytes) -> None:
    for cls in BODY_TYPES:
        try:
            cls.decode(data)
        except ProtocolError:
            pass


def _fix_crcs(data: bytes) -> bytes:
    buf = bytearray(data)
    if len(buf) >= r.HEADER_SIZE:
        struct.pack_into("<I", buf, 24, r.crc32c(memoryview(buf)[28:]))
        r.seal_header_crc(buf, 0)
    return bytes(buf)


def fuzz_records(data: bytes) -> None:
    for buf in (data, _fix_crcs(data)):
        try:
            r.check_stored_batch(buf)
        except ALLOWED:
            pass
        try:
            r.validate_batch(buf, max_message_bytes=256, max_records=1000, check_header_crc=True)
        except (*ALLOWED, BrokerError):
            pass
        try:
            for pos, h in r.iter_batches(buf):
                for rec in r.iter_raw_records(buf, pos, h):
                    r.record_fields(buf, rec[2] - r.RECORD_PREFIX_SIZE)
                    r.decode_properties(buf[rec[5] : rec[6]])
        except ALLOWED:
            pass


def test_one_input(data: bytes) -> None:
    """One fuzz input through every target."""
    fuzz_frames(data)
    fuzz_bodies(data)
    fuzz_records(data)


def seed_corpus() -> list[bytes]:
    """Valid inputs to start from."""
    batch = r.encode_batch([r.RecordInput(b"body", 1, tag=b"t", keys=b"k",
                                          properties=r.encode_properties({"a": "b"})),
                            r.RecordInput(b"", 2)])
    return [
        encode_frame(2, 1, 0, 1, b"\x90"),
        encode_frame(8, 1, 0, 2, m.ProduceRequest(1000, [("t", 0, bytes(batch))]).encode()),
        m.MetadataRequest(["a", "b"], True).encode(),
        m.FetchRequest(1, 1, 1, [("t", 0, 0, 100, "*")]).encode(),
        bytes(batch),
    ]


def main() -> None:
    try:
        import atheris
    except ImportError:
        atheris = None
    if atheris is not None:
        atheris.Setup(sys.argv, test_one_input)
        atheris.Fuzz()
        return
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    examples = 5000
    if "--examples" in sys.argv:
        examples = int(sys.argv[sys.argv.index("--examples") + 1])
    seeds = seed_corpus()
    inputs = st.binary(max_size=2048) | st.builds(
        lambda s, at, junk: s[:at] + junk + s[at + len(junk):],
        st.sampled_from(seeds), st.integers(0, 300), st.binary(max_size=16),
    )

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(inputs)
    def run(data: bytes) -> None:
        test_one_input(data)

    for s in seeds:
        test_one_input(s)
    run()
    print(f"hypothesis fallback: {examples} inputs, no unexpected exception")


if __name__ == "__main__":
    main()
