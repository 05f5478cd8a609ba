"""Helpers of the security tests: users files, raw sockets speaking frames, test certificates."""

from __future__ import annotations

import secrets
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ferrymq.broker.auth import User, update_users_file
from ferrymq.protocol import messages as m
from ferrymq.protocol.auth import (
    MECHANISM,
    NONCE_BYTES,
    SHA512_MECHANISM,
    ScramClient,
    ScramCredential,
)
from ferrymq.protocol.frames import Frame, FrameDecoder, encode_frame, split_response


def make_user(name: str, secret: str, *, admin: bool = False, produce: tuple[str, ...] = (),
              consume: tuple[str, ...] = (), groups: tuple[str, ...] = (),
              produce_bytes_per_s: int = 0, sha512: bool = True) -> User:
    """A users-file entry with fresh salts, as ``ferrymq user add`` writes it (``sha512``
    False: without the SCRAM-SHA-512 credential, as a file written before it existed)."""
    return User(name, ScramCredential.derive(secret, secrets.token_bytes(16)), admin, produce,
                consume, groups, produce_bytes_per_s,
                ScramCredential.derive(secret, secrets.token_bytes(16),
                                       mechanism=SHA512_MECHANISM) if sha512 else None)


def write_users(path: Path, *users: User) -> Path:
    """Write ``users`` to ``path`` (replacing entries of the same name)."""
    update_users_file(path, {u.name: u for u in users})
    return path


class RawClient:
    """A socket that speaks frames, for requests the real clients would never send."""

    def __init__(self, address: str, timeout: float = 5.0) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.decoder = FrameDecoder(64 << 20)
        self.frames: list[Frame] = []
        self.corr = 0

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def frame(self, req: m.Request) -> bytes:
        """Encode ``req`` as a frame with the next correlation id."""
        self.corr += 1
        return encode_frame(req.API_KEY, 1, 0, self.corr, req.encode())

    def send(self, *reqs: m.Request) -> list[int]:
        """Send requests in one write (pipelined); their correlation ids."""
        data = b"".join(self.frame(r) for r in reqs)
        self.sock.sendall(data)
        return list(range(self.corr - len(reqs) + 1, self.corr + 1))

    def read(self, timeout: float = 5.0) -> Frame | None:
        """The next frame, or None when the broker closed the connection."""
        self.sock.settimeout(timeout)
        while not self.frames:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.frames += self.decoder.feed(data)
        return self.frames.pop(0)

    def call(self, req: m.Request, timeout: float = 5.0) -> tuple[int, bytes]:
        """Send one request and read its answer: (error code, body)."""
        (corr,) = self.send(req)
        f = self.read(timeout)
        assert f is not None, "broker closed the connection"
        assert f.correlation_id == corr, (f.correlation_id, corr)
        code, body = split_response(f.payload)
        return code, bytes(body)

    def closed_within(self, timeout: float) -> bool:
        """True when the broker closes the connection within ``timeout`` seconds (frames
        before the close are kept in :attr:`frames`)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                return True
            except TimeoutError:
                return False
            if not data:
                return True
            self.frames += self.decoder.feed(data)

    def authenticate(self, user: str, secret: str) -> tuple[int, ScramClient]:
        """Run the handshake by hand; (AUTH_FINISH error code, the client state)."""
        scram = ScramClient(user, secret, secrets.token_bytes(NONCE_BYTES))
        code, body = self.call(m.AuthStartRequest(MECHANISM, user, scram.client_nonce))
        assert code == 0, code
        ch = m.AuthStartResponse.decode(body)
        proof = scram.proof(ch.salt, ch.iterations, ch.server_nonce)
        code, body = self.call(m.AuthFinishRequest(proof))
        if code == 0:
            assert scram.server_signature_ok(m.AuthFinishResponse.decode(body).server_signature)
        return code, scram


@dataclass(frozen=True)
class Certs:
    """Files of a throwaway PKI: a CA, a server certificate for 127.0.0.1/localhost, a client
    certificate, and a second CA nobody trusts."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(d: Path) -> Certs:
    """Generate the PKI with the openssl CLI (EC P-256 keys, 1 day)."""
    d.mkdir(parents=True, exist_ok=True)
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "1",
                 "-subj", f"/CN=FerryMQ test {ca}", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                  "extendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, cn in (("server", "localhost"), ("client", "ferrymq-client")):
        _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                 "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile",
                 f"{name}.ext", cwd=d)
    return Certs(d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem",
                 d / "client.key", d / "other-ca.pem")
