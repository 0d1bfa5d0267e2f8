"""tfpar's own host-to-host messages: bound, authenticated, bounded.

tfpar opens two kinds of sockets between hosts (TensorFlow's gRPC server,
on the cluster addresses, is TF's own: see docs/guides/hosts.md,
"Security"): the start-up handshake of `connect_hosts` (on the host's
cluster port, before TF binds it) and the heartbeat port of
`tfpar.host_watch`. Both serve one request per connection:

1. the server sends a fresh random challenge:  `tfpar <nonce>\\n`;
2. the client sends one line: `<sender> <receiver> <word> <arg> <nonce>
   <mac>` with mac = HMAC-SHA256(job secret, server nonce | sender |
   receiver | word | arg | client nonce);
3. the server answers `<state> <arg> <mac>`, the mac over the client's
   nonce, so a client knows the answer is fresh and from a holder of the
   secret.

A message is accepted only with a valid mac (the server's nonce is new for
every connection: a recorded message replays into nothing), from the
address the cluster spec gives its sender, with the sender a host id in
range and the receiver this host, a known word and an integer argument;
lines are at most `MAX_LINE` bytes and must arrive within `READ_TIMEOUT`
seconds. Each connection is served on a thread of its own (at most
`MAX_CONNECTIONS` at once), so an idle or slow connection blocks nobody.

The per-job secret is `TFPAR_JOB_SECRET` (at least 16 characters, the same
on every host): `python -m tfpar.launch` makes a fresh one per job; under a
scheduler, set it in the job's environment (e.g. `export
TFPAR_JOB_SECRET=$(openssl rand -hex 32)` once in the job script, before
`srun`). Without it tfpar warns once and checks everything but the mac.

Example:

>>> server = Server(["localhost:1", "localhost:2"], 0, port=0,
...                 handler=lambda sender, word, arg: ("alive", 0))
>>> request(["localhost:1", "localhost:2"], 1, 0, "ping", 0,
...         port=server.port)
('alive', 0)
>>> server.close()
"""

import errno
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import sys
import threading
import time

SECRET_VARIABLE = "TFPAR_JOB_SECRET"
BIND_VARIABLE = "TFPAR_BIND_ADDRESS"
WORDS = ("join", "ping", "bye", "fail", "preempt", "abort")
MAX_LINE = 256  # bytes: the longest request is ~150
READ_TIMEOUT = 2.0  # seconds for a whole request or answer
MAX_CONNECTIONS = 64  # served at once; more are closed at once
_LOOPBACK_NAMES = ("localhost", "ip6-localhost")
_warned = []


def job_secret():
    """The job secret (bytes) from `TFPAR_JOB_SECRET`, or None (warned once).

    Raises:
        ValueError: the variable is set but shorter than 16 characters.
    """
    value = os.environ.get(SECRET_VARIABLE)
    if value is None:
        if not _warned:
            _warned.append(True)
            sys.stderr.write(
                f"tfpar: {SECRET_VARIABLE} is not set: tfpar's handshake and "
                "heartbeat messages are not authenticated, so any process "
                "that reaches their ports on this host's address can end "
                "the job or hide a host's failure. Set the same random "
                f"{SECRET_VARIABLE} on every host (python -m tfpar.launch "
                "does). TensorFlow's gRPC port is never protected: run on a "
                "trusted, isolated network (docs/guides/hosts.md).\n")
        return None
    if len(value) < 16:
        raise ValueError(
            f"{SECRET_VARIABLE} needs at least 16 characters (e.g. `openssl "
            f"rand -hex 32`). Received: a secret of {len(value)} characters.")
    return value.encode()


def new_secret():
    """A fresh job secret (64 hex characters)."""
    return secrets.token_hex(32)


def _mac(secret, *fields):
    if secret is None:
        return "-"
    text = "|".join(str(f) for f in fields).encode()
    return hmac.new(secret, text, hashlib.sha256).hexdigest()


def _is_loopback_name(name):
    if name.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def bind_address(addresses, host_id):
    """Where this host's tfpar sockets listen: `TFPAR_BIND_ADDRESS` if set,
    else 127.0.0.1 when every address is loopback, else this host's own
    name from `addresses` resolved to its IPv4 address."""
    if BIND_VARIABLE in os.environ:
        return os.environ[BIND_VARIABLE]
    names = [a.rsplit(":", 1)[0] for a in addresses]
    if all(_is_loopback_name(n) for n in names):
        return "127.0.0.1"
    return socket.gethostbyname(names[host_id])


def _peer_ips(addresses):
    """{host id: the IPv4 addresses its name resolves to, or None (any)}."""
    allowed = {}
    for i, address in enumerate(addresses):
        name = address.rsplit(":", 1)[0]
        try:
            allowed[i] = {info[4][0] for info in socket.getaddrinfo(
                name, None, socket.AF_INET)}
        except OSError:
            allowed[i] = None  # unresolvable here: the mac must do
    return allowed


def _from(ip, allowed):
    if allowed is None or ip in allowed:
        return True
    both = [ipaddress.ip_address(a) for a in (ip, *allowed)]
    return all(a.is_loopback for a in both)  # 127.0.0.1 vs 127.0.1.1


def listen(addresses, host_id, port):
    """A listening socket on this host's bind address (see
    `bind_address`) and `port` (0: any free one)."""
    address = bind_address(addresses, host_id)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address, port))
    except OSError as error:
        if error.errno != errno.EADDRNOTAVAIL:
            listener.close()
            raise
        sys.stderr.write(
            f"tfpar: {addresses[host_id]} ({address}) is not an address of "
            "this machine; tfpar's sockets listen on all interfaces. Set "
            f"{BIND_VARIABLE} to this host's address on the cluster "
            "network.\n")
        listener.bind(("", port))
    listener.listen(MAX_CONNECTIONS)
    listener.settimeout(0.2)
    return listener


def _read_line(connection, deadline):
    """One line of at most MAX_LINE bytes before `deadline`, else None."""
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or len(data) > MAX_LINE:
            return None
        connection.settimeout(left)
        chunk = connection.recv(MAX_LINE + 1 - len(data))
        if not chunk:
            return None
        data += chunk
    line, _, rest = data.partition(b"\n")
    if rest or len(line) > MAX_LINE:
        return None
    try:
        return line.decode("ascii").split(" ")
    except UnicodeDecodeError:
        return None


def _parse_request(fields, n, host_id):
    """(sender, word, arg, nonce, mac) of a well-formed request, else None."""
    if fields is None or len(fields) != 6:
        return None
    sender, receiver, word, arg, nonce, mac = fields
    if not (sender.isdigit() and receiver.isdigit() and arg.isdigit()
            and len(sender) < 6 and len(arg) < 19):
        return None
    sender = int(sender)
    if not 0 <= sender < n or sender == host_id or int(receiver) != host_id:
        return None
    if word not in WORDS:
        return None
    return sender, word, int(arg), nonce, mac


class Server:
    """Serves requests on this host's tfpar port (see the module docstring).

    Args:
        addresses: every host's "host:port".
        host_id: this host's index.
        port: the port (0: a free one; `self.port` says which).
        handler: called as `handler(sender, word, arg)` for each accepted
            request; returns the answer (state word, integer).
    """

    def __init__(self, addresses, host_id, port, handler):
        self.addresses = list(addresses)
        self.host_id = host_id
        self.handler = handler
        self.secret = job_secret()
        self.rejected = 0  # requests refused (tests read it)
        self._allowed = _peer_ips(self.addresses)
        self._listener = listen(self.addresses, host_id, port)
        self.port = self._listener.getsockname()[1]
        self.address = self._listener.getsockname()[0]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True,
                                        name="tfpar-host-server")
        self._thread.start()

    def close(self):
        """Stops serving; the port is free once this returns."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        try:
            self._listener.close()
        except OSError:
            pass

    def _accept(self):
        while not self._stop.is_set():
            try:
                connection, peer = self._listener.accept()
            except OSError:  # timeout, or closed
                continue
            if not self._slots.acquire(blocking=False):
                connection.close()  # flooded: drop, do not queue
                self.rejected += 1
                continue
            threading.Thread(target=self._serve, args=(connection, peer[0]),
                             daemon=True, name="tfpar-host-conn").start()

    def _serve(self, connection, ip):
        try:
            with connection:
                if not self._serve_one(connection, ip):
                    self.rejected += 1
        except (OSError, ValueError):
            self.rejected += 1
        finally:
            self._slots.release()

    def _serve_one(self, connection, ip):
        deadline = time.monotonic() + READ_TIMEOUT
        challenge = secrets.token_hex(16)
        connection.settimeout(READ_TIMEOUT)
        connection.sendall(f"tfpar {challenge}\n".encode())
        request = _parse_request(_read_line(connection, deadline),
                                 len(self.addresses), self.host_id)
        if request is None:
            return False
        sender, word, arg, nonce, mac = request
        want = _mac(self.secret, challenge, sender, self.host_id, word, arg,
                    nonce)
        if not _from(ip, self._allowed[sender]) or not hmac.compare_digest(
                mac.encode(), want.encode()):
            return False
        state, answer = self.handler(sender, word, arg)
        reply = _mac(self.secret, nonce, self.host_id, state, answer)
        connection.sendall(f"{state} {answer} {reply}\n".encode())
        return True


class Refused(Exception):
    """The peer's port refused the connection (no process listens)."""


def request(addresses, sender, receiver, word, arg, port=None,
            timeout=READ_TIMEOUT, secret=None):
    """Sends `word arg` from host `sender` to host `receiver` (at `port`,
    default its cluster port); its answer (state, int), or None when
    unreachable, silent or not authentic.

    Raises:
        Refused: nobody listens on that port.
    """
    secret = job_secret() if secret is None else secret
    name, cluster_port = addresses[receiver].rsplit(":", 1)
    port = int(cluster_port) if port is None else port
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((name, port), timeout=timeout) as sock:
            hello = _read_line(sock, deadline)
            if hello is None or len(hello) != 2 or hello[0] != "tfpar":
                return None
            nonce = secrets.token_hex(16)
            mac = _mac(secret, hello[1], sender, receiver, word, arg, nonce)
            sock.sendall(
                f"{sender} {receiver} {word} {arg} {nonce} {mac}\n".encode())
            answer = _read_line(sock, deadline)
    except ConnectionRefusedError:
        raise Refused(addresses[receiver]) from None
    except OSError:
        return None
    if answer is None or len(answer) != 3 or not answer[1].isdigit():
        return None
    state, value, mac = answer
    if not hmac.compare_digest(
            mac.encode(), _mac(secret, nonce, receiver, state, value).encode()):
        return None
    return state, int(value)
