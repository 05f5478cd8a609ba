"""Request and response types, one pair per API, with their wire encoding.

``from ferrymq.protocol import messages as m`` then ``m.ProduceRequest``: every message type,
alias and enum is re-exported here, whichever module of the package defines it.

Modules:

* :mod:`.schema`: the machinery: :class:`~.schema.Body` and :class:`~.schema.Request`, field
  specs (``INT``, ``STR``, ``lst(...)``, ...), the fast paths for bulk bodies, :class:`ApiKey`,
  and how versions and trailing fields work.
* One module per API family: :mod:`.connection` (HELLO, PING, authentication, WHOAMI),
  :mod:`.cluster` (cluster metadata, replica fetch), :mod:`.topics` (metadata, topic admin,
  find by key, cancel scheduled), :mod:`.produce`,
  :mod:`.fetch` (and LIST_OFFSETS), :mod:`.consumer_groups` (offset-based pull groups and
  their offsets), :mod:`.delivery` (delivery groups: leases, acks, retries, dead letters),
  :mod:`.half_messages` (half messages with check-back), :mod:`.txn` (exactly-once
  transactions), :mod:`.users`.

:data:`REQUESTS` maps each api key to its request type (the broker's dispatch table is built
from it); every :class:`ApiKey` has one (asserted at import).
"""

from __future__ import annotations

from ferrymq.protocol.messages.cluster import (
    BrokerAddress,
    ClusterMetadataRequest,
    ClusterMetadataResponse,
    DrainBrokerRequest,
    DrainBrokerResponse,
    ElectPreferredLeadersRequest,
    ElectPreferredLeadersResponse,
    EpochEndResult,
    EpochEntries,
    OffsetForEpochRequest,
    OffsetForEpochResponse,
    QueueLeadership,
    ReassignQueueRequest,
    ReassignQueueResponse,
    ReplicaFetchEntry,
    ReplicaFetchRequest,
    ReplicaFetchResponse,
    ReplicaFetchResult,
    TopicLeadership,
)
from ferrymq.protocol.messages.connection import (
    AuthFinishRequest,
    AuthFinishResponse,
    AuthStartRequest,
    AuthStartResponse,
    HelloRequest,
    HelloResponse,
    PingRequest,
    WhoAmIRequest,
    WhoAmIResponse,
)
from ferrymq.protocol.messages.consumer_groups import (
    DELIVERY_GROUP_STATE,
    CommitOffsetsRequest,
    CommitOffsetsResponse,
    DeleteGroupRequest,
    DeleteGroupResponse,
    DescribeGroupRequest,
    DescribeGroupResponse,
    FetchOffsetsRequest,
    FetchOffsetsResponse,
    GroupKinds,
    GroupOffset,
    HeartbeatRequest,
    JoinGroupRequest,
    JoinGroupResponse,
    LeaveGroupRequest,
    ListGroupsRequest,
    ListGroupsResponse,
    MemberInfo,
    ResetOffsetsRequest,
    ResetOffsetsResponse,
)
from ferrymq.protocol.messages.delivery import (
    AckEntry,
    AckRequest,
    AckResponse,
    BlockedKey,
    ChangeInvisibleRequest,
    Delivery,
    DeliveryHeartbeatRequest,
    DeliveryHeartbeatResponse,
    DeliveryLeaveRequest,
    DeliveryMember,
    DeliveryQueue,
    DescribeDeliveryRequest,
    DescribeDeliveryResponse,
    DlqAction,
    DlqAdminRequest,
    DlqAdminResponse,
    MessageGroupStatus,
    MessageStatusRequest,
    MessageStatusResponse,
    NackEntry,
    NackRequest,
    Receipt,
    ReceiptResponse,
    ReceiveRequest,
    ReceiveResponse,
    SkipMessageRequest,
)
from ferrymq.protocol.messages.fetch import (
    FetchEntry,
    FetchRequest,
    FetchResponse,
    FetchResult,
    FetchTxnInfo,
    Isolation,
    ListOffsetsRequest,
    ListOffsetsResponse,
    OffsetResult,
    OffsetSpec,
)
from ferrymq.protocol.messages.half_messages import (
    EndHalfRequest,
    EndHalfResponse,
    HalfCheck,
    HalfCheckPollRequest,
    HalfCheckPollResponse,
    HalfState,
    PrepareHalfRequest,
    PrepareHalfResponse,
)
from ferrymq.protocol.messages.produce import (
    Acks,
    Duplicate,
    Durability,
    InitProducerRequest,
    InitProducerResponse,
    ProduceEntry,
    ProduceRequest,
    ProduceResponse,
    ProduceResult,
)
from ferrymq.protocol.messages.schema import (
    BOOL,
    BYTES,
    FLOAT,
    INT,
    MAX_LIST_ITEMS,
    STR,
    STRMAP,
    ApiKey,
    Body,
    Empty,
    Request,
    astuple_shallow,
    lst,
    opt,
    tup,
)
from ferrymq.protocol.messages.topics import (
    INTERNAL_TOPIC_PREFIX,
    MAX_NAME_CHARS,
    CancelScheduledRequest,
    CreateTopicRequest,
    CreateTopicResponse,
    DeleteTopicRequest,
    DescribeTopicRequest,
    DescribeTopicResponse,
    FindByKeyRequest,
    FindByKeyResponse,
    KeyMatch,
    MetadataRequest,
    MetadataResponse,
    QueueInfo,
    TopicMeta,
    is_internal_topic,
)
from ferrymq.protocol.messages.txn import (
    AbortStagedRequest,
    AbortStagedResponse,
    CommitStagedRequest,
    CommitStagedResponse,
    DescribeTxnsRequest,
    DescribeTxnsResponse,
    EndTxnAction,
    EndTxnRequest,
    EndTxnResponse,
    InitTxnRequest,
    InitTxnResponse,
    StagedMember,
    TxnAddQueueRequest,
    TxnAddQueueResponse,
    TxnDescription,
    TxnMarkerResult,
    TxnMarkersRequest,
    TxnMarkersResponse,
    TxnOffsetCommitRequest,
    TxnState,
)
from ferrymq.protocol.messages.users import (
    DeleteUserRequest,
    DeleteUserResponse,
    ListUsersRequest,
    ListUsersResponse,
    UpsertUserRequest,
    UpsertUserResponse,
    UserInfo,
)

__all__ = [
    "DELIVERY_GROUP_STATE",
    "REQUESTS",
    # schema
    "ApiKey", "BOOL", "BYTES", "Body", "Empty", "FLOAT", "INT", "MAX_LIST_ITEMS", "Request", "STR",
    "STRMAP", "astuple_shallow", "lst", "opt", "tup",
    # cluster
    "BrokerAddress", "ClusterMetadataRequest", "ClusterMetadataResponse",
    "DrainBrokerRequest", "DrainBrokerResponse", "ElectPreferredLeadersRequest",
    "ReassignQueueRequest", "ReassignQueueResponse",
    "ElectPreferredLeadersResponse", "EpochEndResult",
    "EpochEntries", "OffsetForEpochRequest", "OffsetForEpochResponse", "QueueLeadership",
    "ReplicaFetchEntry", "ReplicaFetchRequest", "ReplicaFetchResponse", "ReplicaFetchResult",
    "TopicLeadership",
    # connection
    "AuthFinishRequest", "AuthFinishResponse", "AuthStartRequest", "AuthStartResponse",
    "HelloRequest", "HelloResponse", "PingRequest", "WhoAmIRequest", "WhoAmIResponse",
    # topics
    "CancelScheduledRequest", "CreateTopicRequest", "CreateTopicResponse", "DeleteTopicRequest",
    "DescribeTopicRequest", "DescribeTopicResponse", "FindByKeyRequest", "FindByKeyResponse",
    "INTERNAL_TOPIC_PREFIX", "KeyMatch", "MAX_NAME_CHARS", "MetadataRequest", "MetadataResponse",
    "QueueInfo", "TopicMeta", "is_internal_topic",
    # produce
    "Acks", "Duplicate", "Durability", "InitProducerRequest", "InitProducerResponse", "ProduceEntry",
    "ProduceRequest", "ProduceResponse", "ProduceResult",
    # fetch
    "FetchEntry", "FetchRequest", "FetchResponse", "FetchResult", "FetchTxnInfo", "Isolation",
    "ListOffsetsRequest", "ListOffsetsResponse", "OffsetResult", "OffsetSpec",
    # consumer groups
    "CommitOffsetsRequest", "CommitOffsetsResponse", "DeleteGroupRequest", "DeleteGroupResponse",
    "GroupKinds", "DescribeGroupRequest", "DescribeGroupResponse", "FetchOffsetsRequest",
    "FetchOffsetsResponse",
    "GroupOffset", "HeartbeatRequest", "JoinGroupRequest", "JoinGroupResponse", "LeaveGroupRequest",
    "ListGroupsRequest", "ListGroupsResponse", "MemberInfo", "ResetOffsetsRequest",
    "ResetOffsetsResponse",
    # delivery
    "AckEntry", "AckRequest", "AckResponse", "BlockedKey", "ChangeInvisibleRequest",
    "DeliveryHeartbeatRequest", "DeliveryHeartbeatResponse", "DeliveryLeaveRequest", "Delivery",
    "DeliveryMember", "DeliveryQueue", "DescribeDeliveryRequest", "DescribeDeliveryResponse",
    "DlqAction", "DlqAdminRequest", "DlqAdminResponse", "MessageGroupStatus",
    "MessageStatusRequest", "MessageStatusResponse", "NackEntry", "NackRequest", "Receipt",
    "ReceiptResponse", "ReceiveRequest", "ReceiveResponse", "SkipMessageRequest",
    # half messages
    "EndHalfRequest", "EndHalfResponse", "HalfCheck", "HalfCheckPollRequest",
    "HalfCheckPollResponse", "HalfState", "PrepareHalfRequest", "PrepareHalfResponse",
    # exactly-once transactions
    "AbortStagedRequest", "AbortStagedResponse", "CommitStagedRequest", "CommitStagedResponse",
    "DescribeTxnsRequest", "DescribeTxnsResponse", "EndTxnAction", "EndTxnRequest",
    "EndTxnResponse", "InitTxnRequest", "InitTxnResponse", "StagedMember", "TxnDescription",
    "TxnAddQueueRequest", "TxnAddQueueResponse", "TxnMarkerResult", "TxnMarkersRequest",
    "TxnMarkersResponse", "TxnOffsetCommitRequest", "TxnState",
    # users
    "DeleteUserRequest", "DeleteUserResponse", "ListUsersRequest", "ListUsersResponse",
    "UpsertUserRequest", "UpsertUserResponse", "UserInfo",
]

REQUESTS: dict[int, type[Request]] = {
    cls.API_KEY: cls
    for cls in (
        HelloRequest, PingRequest, MetadataRequest, CreateTopicRequest, DeleteTopicRequest,
        DescribeTopicRequest, InitProducerRequest, ProduceRequest, FetchRequest,
        ListOffsetsRequest, CommitOffsetsRequest, FetchOffsetsRequest, JoinGroupRequest,
        HeartbeatRequest, LeaveGroupRequest, ListGroupsRequest, DescribeGroupRequest,
        ResetOffsetsRequest, DeliveryHeartbeatRequest, ReceiveRequest, AckRequest,
        NackRequest, ChangeInvisibleRequest, DeliveryLeaveRequest, DescribeDeliveryRequest,
        MessageStatusRequest, DlqAdminRequest, FindByKeyRequest, CancelScheduledRequest,
        SkipMessageRequest, PrepareHalfRequest, EndHalfRequest,
        HalfCheckPollRequest, InitTxnRequest, EndTxnRequest, TxnOffsetCommitRequest,
        CommitStagedRequest, AbortStagedRequest, DescribeTxnsRequest, TxnAddQueueRequest,
        TxnMarkersRequest,
        AuthStartRequest, AuthFinishRequest, WhoAmIRequest,
        ClusterMetadataRequest, ReplicaFetchRequest, OffsetForEpochRequest,
        ElectPreferredLeadersRequest, DrainBrokerRequest, ReassignQueueRequest,
        UpsertUserRequest, DeleteUserRequest, ListUsersRequest, DeleteGroupRequest,
    )
}
assert set(REQUESTS) == set(ApiKey), "every ApiKey needs a request type"
