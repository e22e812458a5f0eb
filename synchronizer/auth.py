"""Who is calling: one server interceptor authenticates every call of the synchronizer service
(Session, Ingest, Follow, FetchState) and puts the caller's identity where the handlers read it.

A caller is, in this order of preference:
- a client certificate (mTLS) whose URI SANs `learner:<slot>` (or `learner:<prefix>*`) name
  the slots it speaks for (services/tls.py);
- a per-slot bearer token (`--learner-tokens-file`: lines `SLOT SHA256HEX`), compared in
  constant time with the SHA-256 of the token presented as `authorization: Bearer <token>`;
- the job's shared token (`--token`): any slot, but authenticated;
- anonymous, only when none of the above is configured and the replica runs `--insecure`
  (a laptop): any slot, as before identities existed.
Anything else is refused with UNAUTHENTICATED before its handler runs. Health and reflection
are not the synchronizer service and are served to anyone.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import hmac
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services import tls
from services.lifecycle import give_back_free_memory


@dataclass(frozen=True)
class Identity:
    """An authenticated caller: the slots it may speak for (None: any slot)."""

    how: str  # certificate, token, shared-token, anonymous
    patterns: tuple[str, ...] | None

    def allows(self, slot: str) -> bool:
        if self.patterns is None:
            return True
        return any(tls.pattern_allows(p, slot) for p in self.patterns)

    @property
    def only_slot(self) -> str | None:
        """The one slot it speaks for, if it names exactly one (no pattern)."""
        if self.patterns is not None and len(self.patterns) == 1:
            (pattern,) = self.patterns
            if not pattern.endswith("*"):
                return pattern
        return None

    @property
    def name(self) -> str:
        """The name per-caller limits count under."""
        return ",".join(self.patterns) if self.patterns is not None else f"({self.how})"


ANONYMOUS = Identity("anonymous", None)
CALLER: contextvars.ContextVar[Identity] = contextvars.ContextVar("atoll_caller", default=ANONYMOUS)


class AuthError(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


def permission_denied(slot: str) -> AuthError:
    return AuthError(
        grpc.StatusCode.PERMISSION_DENIED,
        f"this caller's credential does not speak for learner slot {slot!r}; use the slot "
        "named by its certificate or token",
    )


def check_slot(slot: str) -> None:
    """Raise PERMISSION_DENIED unless the current caller may speak for `slot`."""
    if not CALLER.get().allows(slot):
        raise permission_denied(slot)


def load_tokens(path: Path) -> dict[str, bytes]:
    """Slot -> SHA-256 digest from a tokens file (`SLOT SHA256HEX` lines, # comments)."""
    out: dict[str, bytes] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            digest = bytes.fromhex(parts[1])
            if len(digest) != 32:
                raise ValueError
        except ValueError:
            raise ValueError(
                f"{path}:{number}: expected 'SLOT SHA256HEX' (64 hex digits)"
            ) from None
        out[parts[0]] = digest
    return out


def token_digest(token: str) -> str:
    """The line's second field for a token (`atoll` never stores the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()


MAX_FOLLOWS = 2  # Follow calls in flight per caller's connection


class Authenticator(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(
        self,
        service: str,
        *,
        mtls: bool,
        tokens: dict[str, bytes] | None,
        shared_token: str | None,
        anonymous: bool,
        max_fetches: int = 2,
        pool_size: int = 0,
    ) -> None:
        self.prefix = f"/{service}/"
        self.mtls, self.tokens, self.anonymous = mtls, tokens or {}, anonymous
        self.shared = hashlib.sha256(shared_token.encode()).digest() if shared_token else None
        # Ingest: per slot, in its handler. A learner follows each replica once (one more
        # while a broken call ends).
        self.limits = {"FetchState": max_fetches, "Follow": MAX_FOLLOWS}
        # A credential of several slots (a pool's certificate, the job's shared token) has
        # its state fetches counted over all its connections too, at its pool's share: one
        # credential's many connections once each ran their own limit. 0: per connection.
        self.pool_fetches = max_fetches * pool_size
        self.in_flight: Counter[tuple[str, str]] = Counter()

    # --- who is it --------------------------------------------------------------------
    def identify(self, metadata: Iterable[tuple[str, Any]], context: Any) -> Identity:
        if self.mtls:
            pem = (context.auth_context() or {}).get("x509_pem_cert") or []
            patterns = tls.learner_patterns(bytes(pem[0])) if pem else ()
            if patterns:
                return Identity("certificate", patterns)
        bearer = next(
            (str(v) for k, v in metadata if k == "authorization" and isinstance(v, str)), ""
        )
        if bearer.startswith("Bearer ") and (self.tokens or self.shared):
            digest = hashlib.sha256(bearer[len("Bearer ") :].encode()).digest()
            slots = [s for s, d in self.tokens.items() if hmac.compare_digest(d, digest)]
            if slots:
                return Identity("token", tuple(slots))
            if self.shared is not None and hmac.compare_digest(self.shared, digest):
                return Identity("shared-token", None)
        if self.anonymous:
            return ANONYMOUS
        raise AuthError(
            grpc.StatusCode.UNAUTHENTICATED,
            "no valid credential: present a learner certificate (URI SAN learner:SLOT) or "
            "'authorization: Bearer TOKEN' with this slot's token (--token)",
        )

    # --- the interceptor ----------------------------------------------------------------
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        details: grpc.HandlerCallDetails,
    ) -> Any:
        handler: Any = await continuation(details)
        method: str = details.method
        if handler is None or not method.startswith(self.prefix):
            return handler
        name = method[len(self.prefix) :]
        metadata = tuple(details.invocation_metadata or ())
        if not self.mtls:
            # Without mTLS a caller is known from its metadata alone: one without a credential
            # is refused before its request is parsed (a parse of megabytes of protobuf left a
            # replica's memory 258 MB larger). Under mTLS a caller needs a certificate of the
            # job's CA to connect at all; it is identified once its handler runs.
            try:
                self.identify(metadata, None)
            except AuthError as err:
                return _refusing(handler, err)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._streaming(handler.stream_stream, name, metadata),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._streaming(handler.unary_stream, name, metadata),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(handler.stream_unary, name, metadata),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary, name, metadata),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    async def _enter(
        self, name: str, metadata: tuple[Any, ...], context: Any
    ) -> tuple[tuple[str, str], ...]:
        try:
            identity = self.identify(metadata, context)
        except AuthError as err:
            await context.abort(err.code, err.details)
            raise
        CALLER.set(identity)
        # Counted per connection: learners sharing one credential (a pool's certificate, the
        # job's token) do not share one limit. State fetches of a credential of one slot are
        # counted per slot, whatever connections they come on (10 connections once ran 20);
        # those of a credential of several, per connection and over the credential's all
        # (its pool's share, with --pool-size).
        slot = identity.only_slot if name == "FetchState" else None
        key = (slot or f"{identity.name} {context.peer()}", name)
        limit = self.limits.get(name)
        if limit is not None and self.in_flight[key] >= limit:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.in_flight[key]} {name} calls of this caller are in flight already "
                f"(at most {limit}); wait for them",
            )
        pool = (identity.name, name) if name == "FetchState" and slot is None else None
        if pool is not None and self.pool_fetches and self.in_flight[pool] >= self.pool_fetches:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.in_flight[pool]} {name} calls of this credential's pool are in flight "
                f"already (at most {self.pool_fetches}: {self.limits['FetchState']} for each of "
                "--pool-size's slots); wait for them",
            )
        keys = (key,) if pool is None else (key, pool)
        self.in_flight.update(keys)
        return keys

    def _leave(self, keys: tuple[tuple[str, str], ...]) -> None:
        """Each (caller, method) pair `_enter` counted the call under, once."""
        for key in keys:
            self.in_flight[key] -= 1
            if self.in_flight[key] <= 0:
                del self.in_flight[key]

    def _streaming(
        self, behavior: Callable[..., AsyncIterator[Any]], name: str, metadata: tuple[Any, ...]
    ) -> Callable[..., AsyncIterator[Any]]:
        async def wrapped(request: Any, context: Any) -> AsyncIterator[Any]:
            keys = await self._enter(name, metadata, context)
            try:
                async for item in behavior(request, context):
                    yield item
            except AuthError as err:
                await context.abort(err.code, err.details)
            finally:
                self._leave(keys)

        return wrapped

    def _unary(
        self, behavior: Callable[..., Awaitable[Any]], name: str, metadata: tuple[Any, ...]
    ) -> Callable[..., Awaitable[Any]]:
        async def wrapped(request: Any, context: Any) -> Any:
            keys = await self._enter(name, metadata, context)
            try:
                return await behavior(request, context)
            except AuthError as err:
                await context.abort(err.code, err.details)
            finally:
                self._leave(keys)

        return wrapped


def _unparsed(data: bytes) -> None:
    """An unauthenticated caller's request: never parsed."""
    return None


TRIM_AFTER_S = 1.0  # quiet time after the last unauthenticated call before memory is returned
_trim: asyncio.TimerHandle | None = None


def _give_back_soon() -> None:
    """Once unauthenticated calls stop for TRIM_AFTER_S, return the memory their bytes took
    on the connection (the allocator keeps freed heap for reuse: a flood of them would
    leave a replica hundreds of MB larger), off the event loop."""
    global _trim
    loop = asyncio.get_running_loop()
    if _trim is not None:
        _trim.cancel()

    def trim() -> None:
        global _trim
        _trim = None
        loop.run_in_executor(None, give_back_free_memory)

    _trim = loop.call_later(TRIM_AFTER_S, trim)


def _refusing(handler: Any, err: AuthError) -> Any:
    """A handler that refuses its call with `err`, its request never read: a handler of
    streaming requests whatever the method's kind, so the server does not even take the
    request's message off the connection (a unary one would be read whole first: held,
    then kept by the allocator for reuse, 230 MB after 520 MiB of them)."""

    async def refuse(request: Any, context: Any) -> Any:
        _give_back_soon()
        await context.abort(err.code, err.details)

    async def refuse_streaming(request: Any, context: Any) -> AsyncIterator[Any]:
        _give_back_soon()
        await context.abort(err.code, err.details)
        yield  # an async generator, as a streaming response's handler is

    out = handler.response_serializer
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_streaming, _unparsed, out)
    return grpc.stream_unary_rpc_method_handler(refuse, _unparsed, out)
