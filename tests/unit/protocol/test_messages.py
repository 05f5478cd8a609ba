"""Request and response bodies: round trips and schema checks on hostile input."""

from __future__ import annotations

import inspect

import msgpack
import pytest

from ferrymq.errors import RemoteProtocolError
from ferrymq.protocol import messages as m
from ferrymq.protocol.records import RecordInput, encode_batch

BATCH = bytes(encode_batch([RecordInput(b"x", 1, tag=b"t")]))

SAMPLES: list[m.Body] = [
    m.Empty(),
    m.HelloRequest("client-\u00e9", "0.1.0"),
    m.HelloResponse("0.1.0", 0, 8 << 20, 4 << 20, 100_000, "sync", 40 * 86_400_000),
    m.PingRequest(),
    m.MetadataRequest(None, False),
    m.MetadataRequest(["a", "b.c", "\u2603"], True),
    m.MetadataRequest([], True),
    m.MetadataResponse([("orders", 1, 4, 0, 0), ("bad/", -1, 0, 10, 0), ("d", 2, 1, 0, 120_000)]),
    m.MetadataResponse([]),
    m.CreateTopicRequest("orders", 4, {"retention_ms": "1000"}),
    m.CreateTopicRequest("orders", 1, {}),
    m.CreateTopicResponse(3, 4),
    m.DeleteTopicRequest("orders"),
    m.DescribeTopicRequest("orders"),
    m.DescribeTopicResponse("orders", 1, [(0, 0, 10, 1234, 1, -1), (1, 5, 5, 0, 1, 17)], {},
                            3, 1_700_000_000_000),
    m.DescribeTopicResponse("d", 2, [(0, 0, 1, 100, 1, 17)], {"dedup_window_ms": "120000"},
                            0, -1, 120_000, 42),
    m.InitProducerRequest(None),
    m.InitProducerRequest("tx-1"),
    m.InitProducerResponse(2**62, 0),
    m.ProduceRequest(5000, [("orders", 0, BATCH), ("orders", 3, b"")]),
    m.ProduceResponse([("orders", 0, 0, "", 0, 0, 1700000000000, 2, 1, []),
                       ("orders", 9, 8, "unknown queue", -1, -1, -1, 0, -1, []),
                       ("d", 1, 0, "", 7, 8, 1700000000000, 2, 2, [(0, 3, 41), (2, 1, 7)]),
                       ("d", 1, 0, "", -1, -1, -1, 2, 2, [(0, 3, 41)])]),
    m.FetchRequest(500, 1, 1 << 20, [("orders", 0, 0, 1 << 20, "*"), ("o", 1, 7, 10, "a || b")]),
    m.FetchResponse([("orders", 0, 0, "", 10, 0, 1, BATCH), ("o", 1, 11, "oops", -1, -1, -1, b"")]),
    m.FetchResponse([("orders", 0, 0, "", 10, 0, 1, BATCH)], [("orders", 0, 8, [(7, 3)])]),
    m.FetchOffsetsResponse([("orders", 0, 10)], [("orders", 1)]),
    m.ListOffsetsRequest([("orders", 0, -1), ("orders", 1, -2), ("orders", 2, 1700000000000)]),
    m.ListOffsetsResponse([("orders", 0, 0, 42)]),
    m.CommitOffsetsRequest("g", "m-1", -1, [("orders", 0, 10)]),
    m.CommitOffsetsResponse([("orders", 0, 0)]),
    m.FetchOffsetsRequest("g", None),
    m.FetchOffsetsRequest("g", ["orders"]),
    m.FetchOffsetsResponse([("orders", 0, 10)]),
    m.JoinGroupRequest("g", "", "client", ["orders", "audit"], 15_000),
    m.JoinGroupResponse(3, "m-1", [("orders", 0), ("orders", 2)], 2),
    m.HeartbeatRequest("g", "m-1", 3),
    m.LeaveGroupRequest("g", "m-1"),
    m.ListGroupsRequest(),
    m.ListGroupsResponse([("g", "stable", 2)]),
    m.DescribeGroupRequest("g"),
    m.DescribeGroupResponse(
        "g", "stable", 3, [("m-1", "client", "127.0.0.1", [("orders", 0)])],
        [("orders", 0, 10, 12, 2), ("orders", 1, -1, 0, 0)],
    ),
    m.DeleteGroupRequest("g", False),
    m.DeleteGroupResponse(True, True, 3),
    m.ResetOffsetsRequest("g", "orders", -2, False),
    m.ResetOffsetsResponse([("orders", 0, 0)]),
    m.DeliveryHeartbeatRequest("g", "", "c", [("orders", "a || b")], 30_000, None, -1, -2),
    m.DeliveryHeartbeatRequest("g", "m-1", "c", [], 30_000, [100, 200], 3, 1700000000000),
    m.DeliveryHeartbeatRequest("g", "m-2", "c", [], 30_000, None, -1, -2, True),
    m.DeliveryHeartbeatRequest("g", "m-3", "c", [("t", "*")], 2_000, None, -1, -1, False, True,
                               True),
    m.DeliveryHeartbeatResponse("m-1", 2),
    m.DeliveryHeartbeatResponse("m-1", 1, True),
    m.ReceiveRequest("g", "m-1", [("orders", "*")], 32, 1 << 20, 30_000, 500),
    m.ReceiveResponse(30_000, [("orders", 0, 1, 7, 0, 0, 0, BATCH),
                               ("%RETRY%g", 0, 2, 8, 3, 5, 5, b"")]),
    m.AckRequest("g", "m-1", [("orders", 0, 7, [0, 1, 2]), ("orders", 1, 8, [])]),
    m.AckResponse([("orders", 0, 9, 32)]),
    m.AckResponse([]),
    m.NackRequest("g", "m-1", [("orders", 0, 3, 7, -1, "boom \u2603", True)]),
    m.ChangeInvisibleRequest("g", "m-1", [("orders", 0, 3, 7, 60_000)]),
    m.ReceiptResponse([(0, 9), (32, -1)]),
    m.DeliveryLeaveRequest("g", "m-1"),
    m.DescribeDeliveryRequest("g"),
    m.DescribeDeliveryResponse("g", [("m-1", "c", "127.0.0.1:5", 120, 3)],
                               [("orders", 0, 5, 9, 12, 3, 1500)], 1, 0, 2, [10_000], 16),
    m.DescribeDeliveryResponse("g", [], [], 0, 0, 0, [1000], 16, True,
                               [("orders", 1, "k", "0000000100000000000000000005", 2,
                                 1700000000000, -1, "db down")]),
    m.DescribeDeliveryResponse("g", [], [("orders", 0, 5, 9, 12, 3, 1500)], 0, 0, 0, [1000], 16,
                               True, [], [11]),
    m.MessageStatusRequest("0000000100000000000000000005"),
    m.MessageStatusResponse("orders", 0, 5, [("g", "RETRYING", "", -1, 2, 1700000000000, "x",
                                              -1)]),
    m.DlqAdminRequest("g", 1, 0, True),
    m.DlqAdminRequest("g", 2, 0, False, 7),
    m.DlqAdminResponse(0, 10, 10),
    m.DlqAdminResponse(0, 10, 8, [3, 5]),
    m.FindByKeyRequest("orders", "o-1", 32),
    m.CancelScheduledRequest("0000000100000000000000000005"),
    m.SkipMessageRequest("g", "0000000100000000000000000005"),
    m.PrepareHalfRequest("pg", "c1", "orders", 1, b"batch", 6000, 30000, 15),
    m.PrepareHalfResponse("0000000100000000000000000005", 2),
    m.EndHalfRequest("pg", "0000000100000000000000000005", 1, False, ""),
    m.EndHalfResponse("COMMITTED", "0000000200000001000000000007", "orders", 1, 7, 2),
    m.HalfCheckPollRequest("pg", "c1", 1000, 32),
    m.HalfCheckPollResponse([("0000000100000000000000000005", "orders", 1, b"batch", 1)]),
    m.FindByKeyResponse("orders", 1, [(0, 5, "0000000100000000000000000005", 1700000000000,
                                       ["o-1"])], 0),
    m.InitTxnRequest("app-1", 60000, -1, -1),
    m.InitTxnResponse(7, 2, 60000),
    m.EndTxnRequest("app-1", 7, 2, 1, "", -1, 0),
    m.EndTxnResponse(4, 2),
    m.EndTxnResponse(5, 2, 9, 3),
    m.TxnOffsetCommitRequest("app-1", 7, 2, "g", "m-1", 3, [("in", 0, 42)]),
    m.CommitStagedRequest("sink-1", 9, [("sink-1:9:0:0", 7, 0)]),
    m.CommitStagedResponse(4, 9),
    m.AbortStagedRequest("sink-1", 9, []),
    m.AbortStagedResponse(2),
    m.DescribeTxnsRequest("", "sink-1"),
    m.TxnAddQueueRequest(7, 2, "out", 1),
    m.TxnAddQueueResponse(),
    m.TxnMarkersRequest(7, 2, True, "rpw", 41, [("out", 0), ("out", 1)]),
    m.TxnMarkersResponse([("out", 0, 0, ""), ("out", 1, 6, "not the leader")]),
    m.DescribeTxnsResponse([("app-1", 7, 2, 1, 1700000000000, 60000, [("out", 0)], ["g"],
                             "", -1)], [("sink-1", 9, 1700000000000)]),
    m.AuthStartRequest("SCRAM-SHA-256", "alice", b"n" * 24),
    m.AuthStartResponse(b"s" * 16, 4096, b"r" * 24),
    m.AuthFinishRequest(b"p" * 32),
    m.AuthFinishResponse(b"v" * 32, "alice", False),
    m.WhoAmIRequest(),
    m.WhoAmIResponse("alice", False, ["orders*"], ["orders*"], ["billing-*"]),
    m.UpsertUserRequest("carol", b"s" * 16, 4096, b"k" * 32, b"v" * 32, False, ["orders*"],
                        ["orders*"], ["billing-*"], 0, True),
    m.UpsertUserResponse(True),
    m.DeleteUserRequest("carol"),
    m.DeleteUserResponse(2),
    m.ListUsersRequest(),
    m.ListUsersResponse([("carol", False, ["orders*"], [], ["billing-*"], 1000)]),
    m.ClusterMetadataRequest(["orders"]),
    m.ClusterMetadataResponse("prod", 2, [(1, "h1", 9876), (2, "h2", 9876)],
                              [("orders", 0, 7, 2, [(0, 1, 3, [1, 2, 3], [1, 2])])]),
    m.ElectPreferredLeadersRequest(["orders"]),
    m.ElectPreferredLeadersRequest(None),
    m.ElectPreferredLeadersResponse(3),
    m.DrainBrokerRequest(2),
    m.DrainBrokerResponse(5, 1),
    m.ReassignQueueRequest("orders", 3, [4, 2, 3]),
    m.ReassignQueueResponse([4], [1]),
    m.ReplicaFetchRequest(2, 5, 500, 1 << 20, [("orders", 0, 3, 120, 118)]),
    m.ReplicaFetchResponse([("orders", 0, 0, "", 118, 130, 0, b"batches")],
                           [("orders", 0, [(2, 100), (3, 125)])]),
    m.OffsetForEpochRequest(2, [("orders", 0, 4, 3)]),
    m.OffsetForEpochResponse([("orders", 0, 0, 3, 125)]),
]

BODY_TYPES = sorted(
    {
        cls for _, cls in inspect.getmembers(m, inspect.isclass)
        if issubclass(cls, m.Body) and cls not in (m.Body, m.Request)
    },
    key=lambda c: c.__name__,
)


def test_every_body_type_has_a_sample() -> None:
    assert {type(s) for s in SAMPLES} == set(BODY_TYPES)


def test_every_request_has_a_response_type_and_key() -> None:
    for key, cls in m.REQUESTS.items():
        assert key == cls.API_KEY
        assert issubclass(cls.RESPONSE, m.Body)
        assert cls.MIN_VERSION <= cls.MAX_VERSION
    assert set(m.REQUESTS) == set(m.ApiKey)


@pytest.mark.parametrize("body", SAMPLES, ids=lambda b: type(b).__name__)
def test_round_trip(body: m.Body) -> None:
    assert type(body).decode(body.encode()) == body


def test_empty_bodies_are_empty_array() -> None:
    assert m.PingRequest().encode() == b"\x90"
    assert m.Empty().encode() == b"\x90"
    assert m.ListGroupsRequest().encode() == b"\x90"


def test_trailing_fields_are_ignored() -> None:
    raw = msgpack.packb(["client", "1.0", "from the future", 42])
    assert m.HelloRequest.decode(raw) == m.HelloRequest("client", "1.0")
    assert m.PingRequest.decode(msgpack.packb([1, 2, 3])) == m.PingRequest()


# --- hostile bodies -------------------------------------------------------------------------

BAD_BODIES: list[tuple[type[m.Body], bytes]] = [
    (m.HelloRequest, b""),  # not msgpack
    (m.HelloRequest, b"\xc1"),  # never-used msgpack byte
    (m.HelloRequest, b"\x92\xa1a"),  # truncated
    (m.HelloRequest, msgpack.packb(["a", "b"]) + b"\x00"),  # extra data
    (m.HelloRequest, msgpack.packb({"client_id": "a"})),  # map, not array
    (m.HelloRequest, msgpack.packb("a")),
    (m.HelloRequest, msgpack.packb(["a"])),  # missing field
    (m.PingRequest, msgpack.packb(None)),
    (m.HelloRequest, msgpack.packb([1, "b"])),  # int for str
    (m.HelloRequest, msgpack.packb([b"a", "b"], use_bin_type=True)),  # bin for str
    (m.HelloRequest, b"\x92\xa2\xff\xfe\xa1b"),  # invalid UTF-8 str
    (m.MetadataRequest, msgpack.packb([["a"], 1])),  # int for bool
    (m.MetadataRequest, msgpack.packb([["a", 1], True])),  # wrong list item
    (m.MetadataRequest, msgpack.packb(["a", True])),  # str for list
    (m.MetadataRequest, b"\x92\xdd\x80\x00\x00\x00"),  # list claiming 2**31 items
    (m.MetadataRequest, b"\x92\xdd\xff\xff\xff\xff\xc3"),  # list claiming 2**32-1 items
    (m.MetadataRequest, msgpack.packb([["t"] * (m.MAX_LIST_ITEMS + 1), True])),
    (m.CreateTopicRequest, msgpack.packb(["t", 1, {"a": 1}])),  # map value not str
    (m.CreateTopicRequest, msgpack.packb(["t", 1, {1: "a"}])),
    (m.CreateTopicRequest, msgpack.packb(["t", 1, ["a"]])),
    (m.CreateTopicRequest, b"\x93\xa1t\x01\xdf\x80\x00\x00\x00"),  # map claiming 2**31 pairs
    (m.CreateTopicRequest, b"\x93\xa1t\x01\x81\x90\xa1a"),  # unhashable map key
    (m.CreateTopicRequest, msgpack.packb(["t", True, {}])),  # bool is not an int
    (m.CreateTopicRequest, msgpack.packb(["t", 1.5, {}])),  # float is not an int
    (m.ProduceRequest, msgpack.packb([1000, [["t", 0, "not bytes"]]])),
    (m.ProduceRequest, msgpack.packb([1000, [["t", 0]]])),  # short tuple
    (m.ProduceRequest, msgpack.packb([1000, [("t", 0, b"x")] * 0 + [None]])),
    (m.ProduceRequest, b"\x92\x01\x91\x93\xa1t\x00\xc6\xff\xff\xff\xff"),  # bin claiming 4 GiB
    (m.ProduceRequest, msgpack.packb([1000, [msgpack.ExtType(1, b"x")]])),
    (m.FetchRequest, msgpack.packb([1, 1, 1, [["t", 0, 0, 1, None]]])),
    (m.ProduceResponse, msgpack.packb([[["t", 0, 0, "", 0, 0, 1, 2, 1]]])),  # no duplicates
    (m.ProduceResponse, msgpack.packb([[["t", 0, 0, "", 0, 0, 1, 2, 1, [[0, 1]]]]])),
    (m.ProduceResponse, msgpack.packb([[["t", 0, 0, "", 0, 0, 1, 2, 1, [[0, "1", 2]]]]])),
    (m.MetadataResponse, msgpack.packb([[["t", 1, 4, 0]]])),  # no dedup window
    (m.DescribeGroupResponse, msgpack.packb(["g", "s", 1, [["m", "c", "h", [["t", "0"]]]], []])),
    (m.InitProducerRequest, msgpack.packb([1])),
    (m.HelloRequest, b"\x91" * 100_000),  # deep nesting
    (m.HelloRequest, b"\xd6\xff" + b"\x00" * 4),  # msgpack timestamp ext
]


@pytest.mark.parametrize(("cls", "raw"), BAD_BODIES, ids=lambda x: getattr(x, "__name__", None))
def test_bad_bodies_raise_remote_protocol_error(cls: type[m.Body], raw: bytes) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        cls.decode(raw)
    assert cls.__name__ in str(info.value)


@pytest.mark.parametrize("cls", BODY_TYPES, ids=lambda c: c.__name__)
@pytest.mark.parametrize(
    "raw",
    [b"", b"\x00", b"\xff" * 16, b"\xdd\x7f\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
     b"\xc5\xff\xff" + b"a", b"\xdb\x7f\xff\xff\xff", msgpack.packb([1.5] * 12)],
)
def test_every_type_rejects_garbage(cls: type[m.Body], raw: bytes) -> None:
    if not cls.SCHEMA and raw == msgpack.packb([1.5] * 12):
        assert cls.decode(raw) == cls()
        return
    with pytest.raises(RemoteProtocolError):
        cls.decode(raw)


@pytest.mark.parametrize("body", SAMPLES, ids=lambda b: type(b).__name__)
def test_every_truncation_raises_protocol_error(body: m.Body) -> None:
    raw = body.encode()
    for n in range(len(raw)):
        with pytest.raises(RemoteProtocolError):
            type(body).decode(raw[:n])


def test_fields_added_later_default_when_an_older_peer_leaves_them_out() -> None:
    import msgpack

    old = msgpack.packb([500, 1, 1024, [["t", 0, 0, 1024, "*"]]])  # FETCH before isolation
    req = m.FetchRequest.decode(old)
    assert req.isolation == m.Isolation.LEGACY
    resp = m.FetchResponse.decode(msgpack.packb([[["t", 0, 0, "", 1, 0, 1, b""]]]))
    assert resp.txn == []
    assert m.ListOffsetsRequest.decode(msgpack.packb([[["t", 0, -1]]])).isolation == 0
    with pytest.raises(RemoteProtocolError):  # a field without a default is still required
        m.FetchRequest.decode(msgpack.packb([500, 1, 1024]))
    hb = m.DeliveryHeartbeatRequest("g", "", "c", [], 1, None, -1, -1, False, True, True)
    before_ephemeral = msgpack.unpackb(hb.encode())[:-1]  # a client that predates it
    assert not m.DeliveryHeartbeatRequest.decode(msgpack.packb(before_ephemeral)).ephemeral
    answer = msgpack.unpackb(m.DeliveryHeartbeatResponse("m", 1, True).encode())[:-1]
    assert not m.DeliveryHeartbeatResponse.decode(msgpack.packb(answer)).ephemeral
    with_lag = m.DescribeDeliveryResponse("g", [], [], 0, 0, 0, [1000], 16, True, [], [7])
    before_lag = msgpack.unpackb(with_lag.encode())[:-1]  # a broker that predates ``lag``
    assert m.DescribeDeliveryResponse.decode(msgpack.packb(before_lag)).lag == []
    one = m.DlqAdminRequest("g", 2, 0, False, 7)
    before_offset = msgpack.unpackb(one.encode())[:-1]  # a client that predates ``offset``
    assert m.DlqAdminRequest.decode(msgpack.packb(before_offset)).offset == -1
    answer = msgpack.unpackb(m.DlqAdminResponse(3, 4, 1, [3]).encode())[:-1]
    assert m.DlqAdminResponse.decode(msgpack.packb(answer)).done == []


def test_a_request_is_sent_at_the_lowest_version_that_carries_it() -> None:
    """DLQ_ADMIN naming one letter goes at version 2, so that a broker that would ignore the
    field refuses it; every other request (and DLQ_ADMIN without it) at version 1."""
    from ferrymq.protocol.client import ClientConnection
    from ferrymq.protocol.frames import HEADER

    def version(req: m.Request) -> int:
        frame = b"".join(bytes(b) for b in ClientConnection().send(req, None))
        return int(HEADER.unpack_from(frame)[2])

    assert version(m.DlqAdminRequest("g", 2, 0, False)) == 1
    assert version(m.DlqAdminRequest("g", 2, 0, False, 0)) == 2
    assert version(m.PingRequest()) == 1
    assert m.DlqAdminRequest.MAX_VERSION == 2
    assert all(cls.MAX_VERSION == 1 for cls in m.Request.__subclasses__()
               if cls.__name__ != "DlqAdminRequest")  # (slots=True leaves a stale copy too)


FAMILIES = ["connection", "topics", "produce", "fetch", "consumer_groups", "delivery",
            "half_messages", "txn", "users"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_package_reexports_every_message_type(family: str) -> None:
    """``m.X`` works for every class and enum a family module defines (a message type added to
    a family and forgotten in ``messages/__init__.py`` would escape the tests above), and
    every Request is in REQUESTS."""
    import importlib

    module = importlib.import_module(f"ferrymq.protocol.messages.{family}")
    defined = [(name, obj) for name, obj in vars(module).items()
               if inspect.isclass(obj) and obj.__module__ == module.__name__]
    assert defined
    for name, obj in defined:
        assert name in m.__all__
        assert getattr(m, name) is obj
        if issubclass(obj, m.Request):
            assert m.REQUESTS[obj.API_KEY] is obj
