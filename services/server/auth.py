"""Who may call a service: tenants' API keys at the gateway, the cluster's service credential inside.

Both travel as gRPC metadata `authorization: Bearer <secret>`. API keys are kept as SHA-256
hashes only (`tenant:hex` lines in `auth.keys_file` or `auth.keys`), so a leaked key file
lets nobody in; the keys are random 256-bit strings (`specvox keys add`), which a plain hash
protects as well as a slow one. The file is read again when it changes (rotation without a
restart). A call that passes gets its tenant in `TENANT` for the servicers.

Enforcement (`auth.mode`): `auto` enforces keys at the gateway when any are configured and
the service credential inside when one is set; `on` enforces both and fails closed (no key
configured: every call refused); `off` accepts everything.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import hmac
import logging
import os
import re
import secrets
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc

from services.server.interceptors import abort_refused, wrap_handler

log = logging.getLogger(__name__)

# The tenant of the call being served ("" where auth is off or for internal callers).
TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("specvox_tenant", default="")
INTERNAL_TENANT = "_cluster"  # what TENANT holds for a caller with the service credential
HEALTH_PREFIX = "/grpc.health.v1.Health/"
REFLECTION_PREFIXES = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
HASH_HEX = re.compile(r"^[0-9a-f]{64}$")
KEY_PREFIX = "svk_"


@dataclass(frozen=True)
class AuthOptions:
    mode: str = "auto"  # auto | on | off (see the module docstring)
    keys_file: str = ""  # `tenant:sha256-hex` lines; `specvox keys add|list|revoke` writes it
    keys: str = ""  # the same entries, comma-separated, from the settings or SPECVOX_AUTH__KEYS
    service_token: str = ""  # the cluster's shared secret for asr/llm/tts; `specvox up` generates one
    service_token_file: str = ""  # or a file holding it (what `specvox up` writes into its data dir)
    open_health: bool = True  # grpc.health.v1 answers without credentials (load balancers, `up`)
    open_reflection: bool = False  # server reflection answers without credentials
    api_key: str = ""  # the key clients (`specvox client`, bench e2e) present to the gateway

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "on", "off"):
            raise ValueError(f"auth.mode must be auto, on or off, not {self.mode!r}")


class AuthConfigError(ValueError):
    pass


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def parse_entries(lines: Iterable[str], where: str) -> dict[str, str]:
    """`tenant:sha256-hex` lines (blank lines and `#` comments skipped) → {hash: tenant}."""
    out: dict[str, str] = {}
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        tenant, sep, digest = line.rpartition(":")
        digest = digest.removeprefix("sha256-").lower()
        if not sep or not TENANT_NAME.match(tenant) or not HASH_HEX.match(digest):
            raise AuthConfigError(f"{where}:{n}: expected 'tenant:<64 hex digits of sha256(key)>', got {line[:40]!r}")
        out[digest] = tenant
    return out


class KeyRing:
    """The tenants' key hashes, from the settings and the key file; the file re-read when it changes."""

    def __init__(self, options: AuthOptions) -> None:
        self._inline = parse_entries(options.keys.split(","), "auth.keys")
        self._path = Path(options.keys_file) if options.keys_file else None
        self._stamp: tuple[int, int, int] | None = None
        self._from_file: dict[str, str] = {}
        self.reload(strict=True)

    @property
    def configured(self) -> bool:
        return bool(self._inline) or self._path is not None

    def reload(self, strict: bool = False) -> None:
        """Read the file again if it changed; a file that no longer parses keeps the last good keys."""
        if self._path is None:
            return
        try:
            st = self._path.stat()
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp and self._stamp is not None:
            return
        try:
            text = self._path.read_text() if stamp else ""
            entries = parse_entries(text.splitlines(), str(self._path))
        except (OSError, AuthConfigError) as e:
            if strict:
                raise
            log.error("auth: keeping the previous keys: %s", e)
            return
        if self._stamp is not None or stamp is None:
            log.info("auth: %s %s: %d keys", self._path, "read" if stamp else "missing", len(entries))
        self._stamp, self._from_file = stamp, entries

    def tenant(self, key: str) -> str | None:
        self.reload()
        digest = hash_key(key)
        return self._inline.get(digest) or self._from_file.get(digest)

    def __len__(self) -> int:
        return len(self._inline | self._from_file)


def service_token(options: AuthOptions) -> str:
    if options.service_token:
        return options.service_token
    if options.service_token_file:
        return Path(options.service_token_file).read_text().strip()
    return ""


def ensure_service_token(options: AuthOptions, data_dir: Path) -> str:
    """`specvox up`: the configured service credential, else one generated into `data_dir` (0600)
    and kept there, so services started by the same `up` (and restarted ones) share it."""
    if token := service_token(options):
        return token
    path = data_dir / "service_token"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def gateway_enforced(options: AuthOptions) -> bool:
    return options.mode == "on" or (options.mode == "auto" and bool(options.keys or options.keys_file))


def cluster_credential(options: AuthOptions, data_dir: Path) -> tuple[AuthOptions, dict[str, str]]:
    """`specvox up`: where keys are enforced and no service credential is set, one generated into
    `data_dir`; the options that name it, and the environment that passes it to the children."""
    if not gateway_enforced(options) or service_token(options):
        return options, {}
    ensure_service_token(options, data_dir)
    path = str(data_dir / "service_token")
    return replace(options, service_token_file=path), {"SPECVOX_AUTH__SERVICE_TOKEN_FILE": path}


def bearer(metadata: Iterable[tuple[str, Any]] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            value = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, secret = value.partition(" ")
            return secret.strip() if scheme.lower() == "bearer" else ""
    return ""


class Authenticator:
    """Decides one call: the tenant it runs for, or why it is refused."""

    def __init__(self, check: Callable[[str], str | None], what: str, open_prefixes: tuple[str, ...]) -> None:
        self.check, self.what, self.open_prefixes = check, what, open_prefixes

    def is_open(self, method: str) -> bool:
        return method.startswith(self.open_prefixes)

    def decide(self, method: str, metadata) -> tuple[str | None, str]:
        """(tenant, "") for a call that may go on; (None, reason) for one refused."""
        if self.is_open(method):
            return "", ""
        secret = bearer(metadata)
        if not secret:
            return None, f"missing credentials: send metadata 'authorization: Bearer <{self.what}>'"
        tenant = self.check(secret)
        if tenant is None:
            return None, f"invalid credentials: not a valid {self.what}"
        return tenant, ""


def authenticator(options: AuthOptions, service: str) -> Authenticator | None:
    """The gateway's (API keys) or an internal service's (the service credential); None: auth off."""
    if options.mode == "off":
        return None
    open_prefixes = ((HEALTH_PREFIX,) if options.open_health else ()) + \
        (REFLECTION_PREFIXES if options.open_reflection else ())
    token = service_token(options)

    def internal(secret: str) -> str | None:
        return INTERNAL_TENANT if token and hmac.compare_digest(secret.encode(), token.encode()) else None

    if service == "gateway":  # a tenant's key, or the cluster's own credential (`specvox up`'s health checks)
        ring = KeyRing(options)
        if options.mode == "auto" and not ring.configured:
            return None
        return Authenticator(lambda secret: ring.tenant(secret) or internal(secret), "API key", open_prefixes)
    if not token:
        if options.mode == "on":
            raise AuthConfigError(f"auth.mode=on: the {service} service needs auth.service_token (or _file)")
        return None
    return Authenticator(internal, "service credential", open_prefixes)


def describe(options: AuthOptions, service: str, auth: Authenticator | None) -> str:
    """The line a service logs at start: which mode it runs in."""
    if auth is None:
        return f"{service}: auth OFF (no {'API keys' if service == 'gateway' else 'service credential'} " \
               f"configured, auth.mode={options.mode}): every caller is accepted"
    opened = [n for n, on in (("health", options.open_health), ("reflection", options.open_reflection)) if on]
    return f"{service}: auth ON ({auth.what} required; open without one: {', '.join(opened) or 'nothing'})"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a missing or wrong credential; otherwise the handler runs with TENANT set."""

    def __init__(self, auth: Authenticator) -> None:
        self.auth = auth

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        tenant, reason = self.auth.decide(handler_call_details.method, handler_call_details.invocation_metadata)
        if tenant is None:
            return wrap_handler(handler, functools.partial(_refused, reason))
        if not tenant:
            return handler
        return wrap_handler(handler, functools.partial(_as_tenant, tenant))


@contextlib.asynccontextmanager
async def _refused(reason: str, request, context) -> AsyncIterator[Any]:
    await abort_refused(request, context, grpc.StatusCode.UNAUTHENTICATED, reason)
    yield request  # not reached: the abort raises


@contextlib.asynccontextmanager
async def _as_tenant(tenant: str, request, context) -> AsyncIterator[Any]:
    TENANT.set(tenant)  # in the call's own task: grpc runs each call in one
    yield request


# -- the key file, for `specvox keys` ---------------------------------------------------------

def read_key_file(path: Path) -> list[tuple[str, str]]:
    """(tenant, hash) in file order."""
    if not path.exists():
        return []
    entries = parse_entries(path.read_text().splitlines(), str(path))
    return [(tenant, digest) for digest, tenant in entries.items()]


def write_key_file(path: Path, entries: list[tuple[str, str]]) -> None:
    """Atomically (a rename), so a service re-reading it never sees half a file; mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write("# specvox API keys: tenant:sha256(key). Written by `specvox keys`.\n")
        f.writelines(f"{tenant}:{digest}\n" for tenant, digest in entries)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def add_key(path: Path, tenant: str) -> str:
    """A new key for `tenant`, its hash appended to the file; the key itself is returned once."""
    if not TENANT_NAME.match(tenant):
        raise AuthConfigError(f"tenant {tenant!r}: letters, digits and _.@- only, at most 64")
    key = new_key()
    write_key_file(path, [*read_key_file(path), (tenant, hash_key(key))])
    return key


def revoke(path: Path, what: str) -> int:
    """Drop a tenant's keys (by tenant name) or one key (by a hash prefix of 8+ digits); how many went."""
    entries = read_key_file(path)
    kept = [(t, d) for t, d in entries if t != what and not (len(what) >= 8 and d.startswith(what.lower()))]
    write_key_file(path, kept)
    return len(entries) - len(kept)


def keys_command(action: str, path: str, name: str = "") -> int:
    """`specvox keys add TENANT | list | revoke TENANT-or-HASH-PREFIX` on the key file."""
    if not path:
        print("specvox keys: name the key file with --file or auth.keys_file (SPECVOX_AUTH__KEYS_FILE)")
        return 2
    file = Path(path)
    if action == "add":
        key = add_key(file, name)
        print(f"added a key for {name} to {file} (only its hash is kept; this is the only time it is shown):")
        print(key)
    elif action == "list":
        for tenant, digest in read_key_file(file):
            print(f"{tenant:<24} {digest[:12]}")
    else:
        gone = revoke(file, name)
        print(f"revoked {gone} key{'s' if gone != 1 else ''} matching {name!r} in {file}")
        return 0 if gone else 1
    return 0
