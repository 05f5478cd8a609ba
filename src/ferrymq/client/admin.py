"""The asyncio admin client: topics, groups, offsets. The CLI is a thin layer over it."""

from __future__ import annotations

from ferrymq.client._session import Session
from ferrymq.protocol import messages as m
from ferrymq.protocol.messages import OffsetSpec


class AsyncAdminClient:
    """Administrative requests to one broker.

    Args:
        servers: ``"host:port"``.
        request_timeout_s: deadline of each request.
        reconnect_timeout_s: how long to keep trying to reach the broker.
    """

    def __init__(
        self, servers: str | list[str] = "127.0.0.1:9876", *, request_timeout_s: float = 30.0,
        reconnect_timeout_s: float = 10.0,
    ) -> None:
        self._session = Session(servers, client_id="ferrymq-admin",
                                request_timeout_s=request_timeout_s,
                                reconnect_timeout_s=reconnect_timeout_s)

    async def __aenter__(self) -> AsyncAdminClient:
        await self._session.connection()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection."""
        await self._session.close()

    async def hello(self) -> m.HelloResponse:
        """The broker's version and limits."""
        await self._session.connection()
        assert self._session.hello is not None
        return self._session.hello

    async def create_topic(self, name: str, queues: int = 4,
                           config: dict[str, str] | None = None) -> m.CreateTopicResponse:
        """Create a topic (config keys: retention_ms, retention_bytes, segment_bytes,
        segment_ms)."""
        return await self._session.request(m.CreateTopicRequest(name, queues, config or {}),
                                           m.CreateTopicResponse, retry=False)

    async def delete_topic(self, name: str) -> None:
        """Delete a topic and its data."""
        await self._session.request(m.DeleteTopicRequest(name), m.Empty, retry=False)

    async def list_topics(self) -> list[m.TopicMeta]:
        """(name, topic id, queues, error code) of every topic."""
        return (await self._session.request(m.MetadataRequest(None, False),
                                            m.MetadataResponse)).topics

    async def describe_topic(self, name: str) -> m.DescribeTopicResponse:
        """Per-queue offsets and sizes."""
        return await self._session.request(m.DescribeTopicRequest(name), m.DescribeTopicResponse)

    async def list_groups(self) -> list[tuple[str, str, int]]:
        """(group, state, members) of every group."""
        return (await self._session.request(m.ListGroupsRequest(), m.ListGroupsResponse)).groups

    async def describe_group(self, group: str) -> m.DescribeGroupResponse:
        """Members, assignment, committed offsets and lag."""
        return await self._session.request(m.DescribeGroupRequest(group), m.DescribeGroupResponse)

    async def reset_offsets(self, group: str, topic: str, *, to: str | int) -> list[tuple[str, int, int]]:
        """Move a group's offsets on a topic: ``to`` is "earliest", "latest", an offset (int)
        or a timestamp in ms given as ``("time", ms)`` via :meth:`reset_offsets_to_time`."""
        if to == "earliest":
            req = m.ResetOffsetsRequest(group, topic, OffsetSpec.EARLIEST, False)
        elif to == "latest":
            req = m.ResetOffsetsRequest(group, topic, OffsetSpec.LATEST, False)
        else:
            req = m.ResetOffsetsRequest(group, topic, int(to), True)
        return (await self._session.request(req, m.ResetOffsetsResponse, retry=False)).offsets

    async def reset_offsets_to_time(
        self, group: str, topic: str, timestamp_ms: int
    ) -> list[tuple[str, int, int]]:
        """Move a group's offsets on a topic to the first message stored at or after a time."""
        req = m.ResetOffsetsRequest(group, topic, timestamp_ms, False)
        return (await self._session.request(req, m.ResetOffsetsResponse, retry=False)).offsets

    async def list_offsets(self, entries: list[tuple[str, int, int]]) -> list[m.OffsetResult]:
        """Offsets by spec (-1 latest, -2 earliest, or a timestamp in ms)."""
        return (await self._session.request(m.ListOffsetsRequest(entries),
                                            m.ListOffsetsResponse)).results
