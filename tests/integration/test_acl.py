"""The ACL matrix: users x resources x operations against a real broker and its users file.

The expected outcome of every cell is written out by hand below (not computed by the code under
test): a denied cell must raise AccessDeniedError and leave the broker's state unchanged, an
allowed cell must succeed.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator

import pytest

import ferrymq
from ferrymq.errors import AccessDeniedError, TopicAlreadyExistsError
from ferrymq.protocol import messages as m
from tests.security_helpers import make_user, write_users

pytestmark = pytest.mark.integration

SECRET = "matrix-secret"
USERS = {
    "root": make_user("root", SECRET, admin=True),
    "prod": make_user("prod", SECRET, produce=("orders*",)),
    "cons": make_user("cons", SECRET, consume=("orders*",), groups=("team-*",)),
    "both": make_user("both", SECRET, produce=("orders",), consume=("orders", "audit"),
                      groups=("team-a",)),
    "none": make_user("none", SECRET),
}
TOPICS = ("orders", "orders.eu", "audit")
GROUPS = ("team-a", "team-b")

# Who may do what, by hand. produce/consume: topic; group: group; admin ops: no resource.
PRODUCE = {("root", t) for t in TOPICS} | {("prod", "orders"), ("prod", "orders.eu"),
                                           ("both", "orders")}
CONSUME = {("root", t) for t in TOPICS} | {("cons", "orders"), ("cons", "orders.eu"),
                                           ("both", "orders"), ("both", "audit")}
GROUP = {("root", g) for g in GROUPS} | {("cons", "team-a"), ("cons", "team-b"),
                                         ("both", "team-a")}
ADMIN = {"root"}


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ferrymq.Broker]:
    d = tmp_path_factory.mktemp("acl")
    users = write_users(d / "users.toml", *USERS.values())
    with ferrymq.Broker(d / "data", users_file=str(users), flush="async",
                        auth_failure_delay_ms=100) as b:
        with ferrymq.AdminClient(b.address, auth=("root", SECRET)) as admin:
            for t in TOPICS:
                admin.create_topic(t, queues=1)
        with ferrymq.Producer(b.address, auth=("root", SECRET)) as p:
            for t in TOPICS:
                p.send(ferrymq.Message(t, b"seed"))
        yield b


def state(address: str) -> tuple[object, ...]:
    with ferrymq.AdminClient(address, auth=("root", SECRET)) as admin:
        topics = sorted(admin.list_topics())
        ends = [(t[0], admin.describe_topic(t[0]).queues[0][2]) for t in topics]
        groups = sorted(admin.list_groups())
        users = admin.list_users()
        offsets = []
        for g in GROUPS:
            try:
                offsets.append((g, admin.describe_group(g).offsets))
            except ferrymq.errors.UnknownGroupError:
                offsets.append((g, None))
    return tuple(topics), tuple(ends), tuple(groups), tuple(offsets), tuple(users)


def run_cell(broker: ferrymq.Broker, allowed: bool, action: Callable[[], object]) -> None:
    before = None if allowed else state(broker.address)
    if allowed:
        action()
        return
    with pytest.raises(AccessDeniedError):
        action()
    assert state(broker.address) == before, "a denied request changed the broker's state"


@pytest.mark.parametrize(("user", "topic"), list(itertools.product(USERS, TOPICS)))
def test_produce(broker: ferrymq.Broker, user: str, topic: str) -> None:
    def action() -> None:
        with ferrymq.Producer(broker.address, auth=(user, SECRET)) as p:
            p.send(ferrymq.Message(topic, f"by {user}".encode()))
    run_cell(broker, (user, topic) in PRODUCE, action)


@pytest.mark.parametrize(("user", "topic", "group"),
                         list(itertools.product(USERS, TOPICS, GROUPS)))
def test_consume_and_commit(broker: ferrymq.Broker, user: str, topic: str, group: str) -> None:
    def action() -> None:
        with ferrymq.PullConsumer(broker.address, group=group, auth=(user, SECRET),
                                  auto_offset_reset="earliest", auto_commit=False) as c:
            c.assign([(topic, 0)])
            c.seek(topic, 0, 0)
            got: list[ferrymq.ReceivedMessage] = []
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                got = c.poll(timeout=0.3)
            assert got, "nothing consumed"
            c.commit()
    run_cell(broker, (user, topic) in CONSUME and (user, group) in GROUP, action)


@pytest.mark.parametrize("user", list(USERS))
@pytest.mark.parametrize("op", ["create_topic", "delete_topic", "reset_offsets", "dlq_purge",
                                "delete_group", "add_user", "remove_user", "list_users"])
def test_admin_operations(broker: ferrymq.Broker, user: str, op: str) -> None:
    def action() -> None:
        with ferrymq.AdminClient(broker.address, auth=(user, SECRET)) as admin:
            if op == "create_topic":
                admin.create_topic(f"tmp-{user}", queues=1)
            elif op == "delete_topic":
                admin.delete_topic(f"tmp-{user}")
            elif op == "reset_offsets":
                admin.reset_offsets("team-a", "orders", to="latest")
            elif op == "dlq_purge":
                with contextlib.suppress(ferrymq.errors.UnknownGroupError):  # authorised
                    admin.dlq_purge("team-a")
            elif op == "delete_group":  # the state check shows a refused one deleted nothing
                with contextlib.suppress(ferrymq.errors.UnknownGroupError):  # authorised
                    admin.delete_group("team-b")
            elif op == "add_user":
                admin.add_user(f"tmp-{user}", SECRET, produce=("orders",), replace=True)
            elif op == "remove_user":
                admin.remove_user(f"tmp-{user}")
            else:
                getattr(admin, op)()
    if (op == "delete_topic" and user in ADMIN) or op == "remove_user":  # something to delete
        with ferrymq.AdminClient(broker.address, auth=("root", SECRET)) as admin, \
                contextlib.suppress(TopicAlreadyExistsError):
            if op == "remove_user":
                admin.add_user(f"tmp-{user}", SECRET, replace=True)
            else:
                admin.create_topic(f"tmp-{user}", queues=1)
    run_cell(broker, user in ADMIN, action)


@pytest.mark.parametrize("user", list(USERS))
def test_listings_leave_out_what_the_user_may_not_see(broker: ferrymq.Broker, user: str) -> None:
    """Every user may list topics and groups; the answers hold what it may describe or use."""
    with ferrymq.AdminClient(broker.address, auth=("root", SECRET)) as admin:
        every_topic = {t[0] for t in admin.list_topics()}
        every_group = {g[0] for g in admin.list_groups()}
    assert set(TOPICS) <= every_topic
    with ferrymq.AdminClient(broker.address, auth=(user, SECRET)) as admin:
        topics = {t[0] for t in admin.list_topics()}
        groups = {g[0] for g in admin.list_groups()}
        cluster = {q.topic for q in admin.cluster_describe().queues}
    if user in ADMIN:
        assert (topics, groups) == (every_topic, every_group)
        return
    may_describe = {t for t in TOPICS if (user, t) in PRODUCE | CONSUME}
    assert topics == cluster == may_describe
    assert groups == {g for g in every_group if (user, g) in GROUP}


@pytest.mark.parametrize(("user", "group"), list(itertools.product(USERS, GROUPS)))
def test_a_dlq_dry_run_needs_only_the_group_right(broker: ferrymq.Broker, user: str,
                                                  group: str) -> None:
    """It changes nothing (the console's dead-letter browsing uses it); doing it needs admin
    (test_admin_operations)."""
    def action() -> None:
        with ferrymq.AdminClient(broker.address, auth=(user, SECRET)) as admin, \
                contextlib.suppress(ferrymq.errors.UnknownGroupError):  # authorised
            admin.dlq_purge(group, dry_run=True)
    run_cell(broker, (user, group) in GROUP, action)


@pytest.mark.parametrize(("user", "topic"), list(itertools.product(USERS, TOPICS)))
def test_describe_topic(broker: ferrymq.Broker, user: str, topic: str) -> None:
    def action() -> None:
        with ferrymq.AdminClient(broker.address, auth=(user, SECRET)) as admin:
            admin.describe_topic(topic)
    run_cell(broker, (user, topic) in PRODUCE | CONSUME, action)


def test_whoami_reports_the_rights() -> None:
    """The table above and the users file agree (the matrix tests the file it claims to)."""
    assert {(u.name, p) for u in USERS.values() for p in u.produce} == {
        ("prod", "orders*"), ("both", "orders")}
    assert all(not u.admin for n, u in USERS.items() if n != "root")


def test_every_api_has_a_rule() -> None:
    from ferrymq.broker.acl import NEEDS
    assert set(NEEDS) == set(m.ApiKey), set(m.ApiKey) - set(NEEDS)
