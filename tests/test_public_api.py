"""Pin the public API: adding or removing an export must be a deliberate change here.

Names renamed since keep working as deprecated aliases (a DeprecationWarning naming the new
name): the tables below pin each old name to its new one, for every module users import them
from, so an alias is removed only on purpose."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import ferrymq
import ferrymq.errors

FERRYMQ_ALL = [
    "AdminClient",
    "AsyncAdminClient",
    "AsyncHalfMessageProducer",
    "AsyncProducer",
    "AsyncPullConsumer",
    "AsyncPushConsumer",
    "AsyncSimpleConsumer",
    "Broker",
    "ConsumeResult",
    "Durability",
    "FerryMQError",
    "HalfMessageProducer",
    "HalfMessageResult",
    "HalfState",
    "LeasedMessage",
    "Message",
    "Producer",
    "PullConsumer",
    "PushConsumer",
    "ReceivedMessage",
    "SendResult",
    "SimpleConsumer",
    "__version__",
]

ERRORS_ALL = [
    "AccessDeniedError",
    "AuthenticationDisabledError",
    "AuthenticationFailedError",
    "AuthenticationRequiredError",
    "BatchAlreadyCommittedError",
    "BatchTooLargeError",
    "BrokerError",
    "BrokerShuttingDownError",
    "BusyError",
    "ClientError",
    "ClusterStartError",
    "ConcurrentTransactionsError",
    "ConfigError",
    "ConnectionClosedError",
    "CorruptRecordError",
    "DuplicateSequenceError",
    "ErrorCode",
    "FencedLeaderEpochError",
    "FerryMQError",
    "FerryMQTimeoutError",
    "FrameSizeError",
    "FrameTooLargeError",
    "HalfMessageResolvedError",
    "IllegalGenerationError",
    "InternalBrokerError",
    "InvalidConfigError",
    "InvalidOffsetError",
    "InvalidReceiptError",
    "InvalidReplicationFactorError",
    "InvalidRequestError",
    "InvalidTopicNameError",
    "InvalidTxnStateError",
    "InvalidTxnTimeoutError",
    "LeaderEpochOrderError",
    "LeaderNotAvailableError",
    "LocalProtocolError",
    "LogClosedError",
    "MemberConflictError",
    "MessageTooLargeError",
    "MetadataError",
    "MetadataLeaseExpiredError",
    "MetadataUnavailableError",
    "NonEmptyGroupError",
    "NotControllerError",
    "NotEnoughReplicasError",
    "NotCoordinatorError",
    "NotLeaderError",
    "NotScheduledError",
    "OffsetOutOfRangeError",
    "OutOfOrderSequenceError",
    "PolicyViolationError",
    "ProducerFencedError",
    "ProtocolError",
    "RebalanceInProgressError",
    "RemoteProtocolError",
    "RequestTimedOutError",
    "StagedTxnExpiredError",
    "StorageError",
    "StorageFailureError",
    "StorageFullError",
    "TopicAlreadyExistsError",
    "TransactionTimedOutError",
    "TxnUsageError",
    "UnexpectedAppendOffsetError",
    "UnknownApiError",
    "UnknownGroupError",
    "UnknownHalfMessageError",
    "UnknownMemberError",
    "UnknownProducerIdError",
    "UnknownQueueError",
    "UnknownTopicError",
    "UnknownUserError",
    "UnsupportedVersionError",
    "UserAlreadyExistsError",
    "error_for_code",
]


def test_ferrymq_all_is_pinned() -> None:
    assert sorted(ferrymq.__all__) == sorted(FERRYMQ_ALL)
    assert len(set(ferrymq.__all__)) == len(ferrymq.__all__)


@pytest.mark.parametrize("name", FERRYMQ_ALL)
def test_ferrymq_exports_import(name: str) -> None:
    mod = importlib.import_module("ferrymq")
    assert getattr(mod, name) is not None
    exec(f"from ferrymq import {name}", {})


def test_version_is_a_string() -> None:
    assert isinstance(ferrymq.__version__, str)
    assert ferrymq.__version__


def test_errors_all_is_pinned() -> None:
    assert sorted(ferrymq.errors.__all__) == sorted(ERRORS_ALL)
    assert len(set(ferrymq.errors.__all__)) == len(ferrymq.errors.__all__)


@pytest.mark.parametrize("name", ERRORS_ALL)
def test_errors_exports_import(name: str) -> None:
    obj = getattr(ferrymq.errors, name)
    if isinstance(obj, type) and name != "ErrorCode":
        assert issubclass(obj, ferrymq.errors.FerryMQError)


def test_star_import_matches_all() -> None:
    ns: dict[str, object] = {}
    exec("from ferrymq import *", ns)
    assert set(ns) - {"__builtins__"} == set(FERRYMQ_ALL)
    ns = {}
    exec("from ferrymq.errors import *", ns)
    assert set(ns) - {"__builtins__"} == set(ERRORS_ALL)


def test_every_error_code_has_one_exception_class() -> None:
    from ferrymq.errors import BrokerError, ErrorCode, error_for_code

    for code in ErrorCode:
        if code is ErrorCode.NONE:
            continue
        exc = error_for_code(code, "msg")
        assert isinstance(exc, BrokerError)
        assert exc.code == code
        assert type(exc).__name__ in ERRORS_ALL
    assert type(error_for_code(60_000, "x")).__name__ == "InternalBrokerError"


def test_protocol_package_exports() -> None:
    import ferrymq.protocol

    assert ferrymq.protocol.__all__ == ["ErrorCode"]


@pytest.mark.parametrize("module", ["ferrymq", "ferrymq.testing", "ferrymq.admin.cli"])
def test_importing_leaves_the_broker_out(module: str) -> None:
    # a fresh interpreter: this one has imported the broker long ago
    code = (f"import sys, {module}\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('ferrymq.broker.'))\n"
            "assert 'ferrymq.broker.server' not in sys.modules, loaded\n"
            "print(' '.join(loaded))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    allowed = {"ferrymq.broker.auth"} if module == "ferrymq.admin.cli" else set()  # users file
    assert set(out.stdout.split()) <= allowed


def test_lazy_broker_exports_are_the_classes() -> None:
    from ferrymq import Broker
    from ferrymq.broker import BrokerConfig, BrokerServer, load
    from ferrymq.broker.config import BrokerConfig as config_class
    from ferrymq.broker.config import load as load_function
    from ferrymq.broker.embedded import Broker as embedded_class
    from ferrymq.broker.server import BrokerServer as server_class

    assert Broker is ferrymq.Broker is embedded_class
    assert (BrokerConfig, BrokerServer, load) == (config_class, server_class, load_function)
    assert "Broker" in dir(ferrymq)
    with pytest.raises(AttributeError, match="no attribute 'Brokr'"):
        _ = ferrymq.Brokr  # type: ignore[attr-defined]


# --- deprecated names (issue 19: one name per feature) ------------------------------------------

RENAMED_IN_FERRYMQ = {
    "AsyncTransactionProducer": "AsyncHalfMessageProducer",
    "TransactionProducer": "HalfMessageProducer",
    "TransactionResult": "HalfMessageResult",
    "TransactionState": "HalfState",
}
RENAMED_IN_ERRORS = {
    "TransactionResolvedError": "HalfMessageResolvedError",
    "TransactionStateError": "TxnUsageError",
    "UnknownTransactionError": "UnknownHalfMessageError",
}
RENAMED_IN_CLIENT_TRANSACTION = {  # the module is ferrymq.client.half_messages now
    **RENAMED_IN_FERRYMQ,
    "AsyncTransaction": "AsyncHalfMessage",
    "Checker": "Checker",
    "LocalTransaction": "LocalTransaction",
    "Transaction": "HalfMessage",
    "transaction_id": "half_id",
}
RENAMED = [
    *(("ferrymq", old, "ferrymq", new) for old, new in RENAMED_IN_FERRYMQ.items()),
    *(("ferrymq.client", old, "ferrymq.client", new) for old, new in RENAMED_IN_FERRYMQ.items()),
    *(("ferrymq.errors", old, "ferrymq.errors", new) for old, new in RENAMED_IN_ERRORS.items()),
    *(("ferrymq.client.transaction", old, "ferrymq.client.half_messages", new)
      for old, new in RENAMED_IN_CLIENT_TRANSACTION.items()),
]


@pytest.mark.parametrize(("module", "old", "new_module", "new"), RENAMED,
                         ids=[f"{m}.{o}" for m, o, _, _ in RENAMED])
def test_old_names_are_deprecated_aliases(module: str, old: str, new_module: str,
                                          new: str) -> None:
    current = getattr(importlib.import_module(new_module), new)
    with pytest.warns(DeprecationWarning, match=rf"{module}\.{old} is deprecated; use "
                                                 rf"{new_module}\.{new}"):
        assert getattr(importlib.import_module(module), old) is current
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated"):
        exec(f"from {module} import {old} as alias; assert alias is current",
             {"current": current})
    assert old not in getattr(importlib.import_module(module), "__all__", [])


@pytest.mark.parametrize("module", ["ferrymq", "ferrymq.client", "ferrymq.errors",
                                    "ferrymq.client.transaction"])
def test_an_unknown_name_is_still_an_attribute_error(module: str) -> None:
    name = "NoSuchName"
    with pytest.raises(AttributeError, match=name):
        getattr(importlib.import_module(module), name)


def test_old_exception_names_catch_the_new_exceptions() -> None:
    from ferrymq.errors import TxnUsageError, UnknownHalfMessageError

    for old_name, new_error in (("TransactionStateError", TxnUsageError("begin() first")),
                                ("UnknownTransactionError", UnknownHalfMessageError("no id"))):
        with pytest.warns(DeprecationWarning, match=old_name):
            old = getattr(ferrymq.errors, old_name)
        with pytest.raises(old):
            raise new_error


@pytest.mark.parametrize(("old", "new"), [("UNKNOWN_TRANSACTION", "UNKNOWN_HALF_MESSAGE"),
                                          ("TRANSACTION_RESOLVED", "HALF_MESSAGE_RESOLVED")])
def test_old_error_code_names_are_deprecated_aliases(old: str, new: str) -> None:
    from ferrymq.errors import ErrorCode

    with pytest.warns(DeprecationWarning, match=f"ErrorCode.{old} is deprecated"):
        assert getattr(ErrorCode, old) is ErrorCode[new]
    assert old not in ErrorCode.__members__  # not listed, never a second name of the code
    assert ErrorCode[new].name == new


def test_old_half_message_attribute_and_method_names() -> None:
    from ferrymq.client.half_messages import HalfMessage, HalfMessageResult

    result = HalfMessageResult("h-1", "COMMITTED", None)
    with pytest.warns(DeprecationWarning, match="txn_id is deprecated; use half_id"):
        assert result.txn_id == "h-1"
    half = HalfMessage(None, ferrymq.Message("t", b"x"))  # type: ignore[arg-type]
    half.half_id = "h-2"
    with pytest.warns(DeprecationWarning, match="txn_id is deprecated; use half_id"):
        assert half.txn_id == "h-2"
    producer = ferrymq.AsyncHalfMessageProducer("127.0.0.1:1", "g", lambda _m: ferrymq.HalfState.COMMIT)
    msg = ferrymq.Message("t", b"x")  # never started: building the context sends nothing
    with pytest.warns(DeprecationWarning, match=r"transaction\(\) is deprecated; use half_message"):
        old = producer.transaction(msg)
    assert type(old) is type(producer.half_message(msg)) and old.message is msg


OLD_SETTINGS = {
    "txn_check_after_ms": "half_check_after_ms",
    "txn_check_interval_ms": "half_check_interval_ms",
    "txn_max_checks": "half_max_checks",
    "txn_max_pending": "half_max_pending",
}


@pytest.mark.parametrize(("old", "new"), OLD_SETTINGS.items())
def test_old_broker_setting_names_still_configure(old: str, new: str, tmp_path: Path) -> None:
    from ferrymq.broker.config import load

    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated; use {new}"):
        assert getattr(load(overrides={old: 7}), new) == 7
    with pytest.warns(DeprecationWarning, match=f"FERRYMQ_{old.upper()}"):
        assert getattr(load(env={f"FERRYMQ_{old.upper()}": "8"}), new) == 8
    toml = tmp_path / "broker.toml"
    toml.write_text(f"[broker]\n{old} = 9\n")
    with pytest.warns(DeprecationWarning, match=str(toml)):
        assert getattr(load(toml), new) == 9
    with pytest.warns(DeprecationWarning, match=old):
        both = load(env={f"FERRYMQ_{old.upper()}": "8"}, overrides={new: 10})
    assert getattr(both, new) == 10  # flags over the environment, whatever the name
