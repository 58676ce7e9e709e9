"""The one boundary between kubegpu's errors and the kubelet's gRPC calls.

Both kubelet-facing servers use it: the device plugin (`kubegpu.plugin`) and the DRA
kubelet plugin (`kubegpu.dra`). `status_for` maps an exception to a status code and one
escaped line of at most `MAX_DETAILS` characters, never UNKNOWN or a traceback:

    AllocationError     INVALID_ARGUMENT      the request is malformed
    PreconditionError   FAILED_PRECONDITION   valid, but the node cannot serve it now
    ConfigError         FAILED_PRECONDITION   the config in force cannot serve it
    DeviceError         UNAVAILABLE           the GPU backend failed; a retry may work
    anything else       INTERNAL              a bug: logged with its traceback

`Boundary` is the server interceptor that applies it to every RPC, and refuses requests
that cannot be decoded or are larger than any valid one before protobuf decodes them.

`UnixServer` is the one way both put a gRPC server on a unix socket the kubelet dials:
bound at a staged name and renamed into place once it listens, known by the inode it
bound (so a socket deleted or replaced by someone else is noticed), and a server it
replaces retired in the background.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kubegpu.errors import (
    AllocationError,
    ConfigError,
    DeviceError,
    KubegpuError,
    PreconditionError,
)
from kubegpu.supervisor import spawn
from kubegpu.untrusted import escape

_log = logging.getLogger("kubegpu.rpc")

#: Status details longer than this are cut: gRPC refuses metadata over 16 KiB, and the
#: kubelet would then see RESOURCE_EXHAUSTED instead of our reason.
MAX_DETAILS = 1024

#: kubegpu error -> the code the kubelet gets; the first class in the MRO found wins.
STATUS_CODES: Mapping[type[KubegpuError], grpc.StatusCode] = {
    AllocationError: grpc.StatusCode.INVALID_ARGUMENT,
    PreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    ConfigError: grpc.StatusCode.FAILED_PRECONDITION,
    DeviceError: grpc.StatusCode.UNAVAILABLE,
}

#: Maps an exception raised while answering an RPC to its status (`status_for`, bound
#: to the logger of the server using it).
StatusFor = Callable[[Exception, str], tuple[grpc.StatusCode, str]]


#: sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def socket_path_too_long(path: Path, flag: str = "--device-plugin-path") -> str | None:
    """Why a unix socket cannot be bound at `path` for its length (one line naming `flag`,
    which sets its directory), or None."""
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH:
        return None
    return (
        f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes (the unix limit); "
        f"use a shorter {flag}"
    )


def bounded(text: str, limit: int = MAX_DETAILS) -> str:
    """One line of at most about `limit` characters, fit for a gRPC status and a log."""
    return escape(text, limit)


def status_for(exc: Exception, rpc: str, log: logging.Logger = _log) -> tuple[grpc.StatusCode, str]:
    """The status code and one-line details for `exc` raised while answering `rpc`.

    A kubegpu error is the caller's or the node's problem and is logged as a warning; any
    other exception is a bug in kubegpu, logged with its traceback and answered INTERNAL.
    """
    for cls in type(exc).__mro__:
        code = STATUS_CODES.get(cls)
        if code is not None:
            message = bounded(str(exc))
            log.warning("%s refused: %s", rpc, message)
            return code, message
    message = bounded(f"internal error in kubegpu: {type(exc).__name__}: {exc}")
    if isinstance(exc, KubegpuError):
        log.error("%s failed: %s", rpc, message)
    else:
        log.exception("%s failed: %s", rpc, message, exc_info=exc)
    return grpc.StatusCode.INTERNAL, message


def undecodable(reason: str) -> AllocationError:
    """The error of a request whose bytes protobuf cannot decode (INVALID_ARGUMENT)."""
    return AllocationError(f"the request cannot be decoded ({reason}); send valid UTF-8 IDs")


class _Undecodable:
    """Stands for a request refused before the method: bytes that are not a valid message
    (e.g. bad UTF-8), or more bytes than any valid request."""

    def __init__(self, error: AllocationError) -> None:
        self.error = error


class Calls:
    """The unary calls a server is answering, so that a stopping server can wait until its
    clients have gone quiet.

    `grpc.aio`'s `server.stop(grace)` lets the calls already handed to the servicer finish,
    but a call gRPC has accepted and not yet handed over (the server asks for one call at a
    time; eight busy clients keep several waiting) is cancelled, and one still on its way is
    refused: the kubelet sees CANCELLED or UNAVAILABLE for an Allocate it sent while the
    plugin was up. So a plugin that is going first tells the kubelet (ListAndWatch ends),
    keeps accepting, and stops only once nothing has run or started for a while (`quiet`).
    """

    def __init__(self) -> None:
        self.active = 0
        self._changed = asyncio.Event()

    def begin(self) -> None:
        self.active += 1
        self._changed.set()

    def end(self) -> None:
        self.active -= 1
        self._changed.set()

    async def quiet(self, seconds: float) -> None:
        """Return once no call has been running or started for `seconds`."""
        while True:
            self._changed.clear()
            if self.active:
                await self._changed.wait()
                continue
            # asyncio.timeout, not wait_for, which on Python 3.11 can lose a cancellation
            # that arrives as a call begins or ends.
            try:
                async with asyncio.timeout(seconds):
                    await self._changed.wait()
            except TimeoutError:
                return


class Boundary(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """The error boundary of every RPC: undecodable requests and raised errors get a status.

    grpc decodes before our code runs and reports a decode failure as UNKNOWN with a
    traceback in our log; the kubelet should get INVALID_ARGUMENT, which says the request
    was bad. An exception escaping a method would reach the kubelet as UNKNOWN too; here
    it is mapped by `status` (INTERNAL for a bug, with its traceback in our log).
    """

    def __init__(
        self,
        limit: Callable[[], int] | None = None,
        *,
        status: StatusFor = status_for,
        subject: str = "this resource",
        calls: Calls | None = None,
    ) -> None:
        #: The current request size limit in bytes, if any.
        self._limit = limit
        #: Counts the unary calls in progress (for a graceful stop), if given.
        self._calls = calls
        self._status = status
        #: What the limit is about, for the refusal's message.
        self._subject = subject
        # Wrapped handlers per method, built once: this runs before every RPC (Allocate's
        # hot path), and only the servicer's own few methods ever get here with a handler.
        self._guarded: dict[str, Any] = {}

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        method = handler_call_details.method
        guarded = self._guarded.get(method)
        if guarded is None:
            # grpc's stubs type handlers for the sync server; ours are coroutines.
            handler: Any = await continuation(handler_call_details)
            if handler is None:
                return None  # an unknown method: grpc answers UNIMPLEMENTED
            guarded = self._guarded[method] = _guard(
                handler, method, self._limit, self._status, self._subject, self._calls
            )
        return guarded


# The guards let grpc's own exceptions (`grpc.aio.BaseError`) through untouched: they come
# from `context.abort` (the method chose its status: AbortError) or from grpc when a status
# cannot be sent any more (the caller has gone, e.g. a kubelet restarting: abort raises
# what sending failed with), and grpc handles each. Taking one for a bug and aborting again
# logged "internal error" and a second abort's "Abort already called!". So a guard aborts
# at most once, outside the handler that caught the method's error.


def _guard(
    handler: Any,
    method: str,
    limit: Callable[[], int] | None,
    status: StatusFor,
    subject: str,
    calls: Calls | None = None,
) -> Any:
    """`handler` with a request decoder that turns a decode failure (or a request over
    `limit()` bytes) into INVALID_ARGUMENT, and every exception of the method into its
    status."""
    decode = getattr(handler, "request_deserializer", None)
    if decode is None:
        return handler
    rpc = method.rsplit("/", 1)[-1]

    def safe_decode(data: bytes) -> Any:
        most = None if limit is None else limit()
        if most is not None and len(data) > most:
            return _Undecodable(
                AllocationError(
                    f"the request is {len(data)} bytes, more than any valid {rpc} request "
                    f"for {subject} ({most} bytes); send only IDs the plugin advertised"
                )
            )
        try:
            return decode(data)
        except DecodeError as exc:
            return _Undecodable(undecodable(str(exc)))

    async def refuse(request: _Undecodable, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(*status(request.error, rpc))

    if handler.unary_unary is not None:
        unary: Any = handler.unary_unary

        async def guarded_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if calls is not None:
                calls.begin()
            try:
                if isinstance(request, _Undecodable):
                    await refuse(request, context)
                try:
                    return await unary(request, context)
                except grpc.aio.BaseError:
                    raise  # grpc's own: see the note above `_guard`
                except Exception as exc:
                    answer = status(exc, rpc)
                return await context.abort(*answer)
            finally:
                if calls is not None:
                    calls.end()

        return grpc.unary_unary_rpc_method_handler(
            guarded_unary,
            request_deserializer=safe_decode,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        stream: Any = handler.unary_stream

        async def guarded_stream(
            request: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> AsyncIterator[Any]:
            if isinstance(request, _Undecodable):
                await refuse(request, context)
            try:
                async for item in stream(request, context):
                    yield item
            except grpc.aio.BaseError:
                raise  # grpc's own: see the note above `_guard`
            except Exception as exc:
                answer = status(exc, rpc)
            else:
                return
            await context.abort(*answer)

        return grpc.unary_stream_rpc_method_handler(
            guarded_stream,
            request_deserializer=safe_decode,
            response_serializer=handler.response_serializer,
        )
    return handler


#: How long a server being replaced (its socket was deleted, the kubelet restarted) may
#: take to finish the calls it already has: grpc returns as soon as they are done, so an
#: idle server costs nothing, and an answer reaches the kubelet instead of being cut off
#: as CANCELLED. It runs out in the background: the new server listens at once.
RETIRE_GRACE_S = 1.0


class UnixServer:
    """One grpc.aio server (`build` makes it) on the unix socket `path`, served again on a
    fresh socket on demand (`serve`)."""

    def __init__(self, path: Path, build: Callable[[], grpc.aio.Server], name: str) -> None:
        self.path = path
        self._build = build
        self.name = name
        self._server: grpc.aio.Server | None = None
        #: (st_dev, st_ino) of the socket file `_server` listens on.
        self._bound: tuple[int, int] | None = None
        #: Replaced servers finishing their calls.
        self._retiring: set[asyncio.Task[None]] = set()
        #: How many times the socket was served (1 after the first `serve`).
        self.served = 0

    @property
    def serving(self) -> bool:
        """A server runs (whether the kubelet can still reach it: `lost`)."""
        return self._server is not None

    async def serve(self, *, retire_grace: float = RETIRE_GRACE_S) -> None:
        """(Re)start the server on a fresh socket file at `path`.

        A server this one replaces finishes its calls in the background, for at most
        `retire_grace` seconds, so serving again never waits for them.
        """
        # Built before the old one stops: grpc tears its engine down (poller thread, core)
        # when its last server or channel goes, and starting it again costs ~1 ms.
        server = self._build()
        old, self._server, self._bound = self._server, None, None
        if old is not None:
            self._retire(old, retire_grace)
        # grpc unlinks the path a server bound when that server stops, by name: a server
        # bound at the socket's own name and retired in the background would delete the
        # new socket. So each binds a name of its own and is renamed into place once it
        # listens; the kubelet never finds the socket bound but not yet listening either
        # (and its plugin watcher ignores names that start with a dot). The staged name is
        # no longer than a socket name: it fits wherever the socket does.
        staged = self.path.parent / f".kg-{secrets.token_hex(4)}"
        if server.add_insecure_port(f"unix://{staged}") == 0:
            raise OSError(f"cannot listen on {self.path}")
        try:
            # Bound, not yet listening: only root (the kubelet) may connect, whatever the
            # umask. The directory can be wiped meanwhile (a kubelet restart).
            staged.chmod(0o600)
            bound = staged.stat()  # a rename keeps the inode
            await server.start()
            staged.replace(self.path)
        except BaseException:
            await server.stop(None)
            with contextlib.suppress(OSError):
                staged.unlink()
            raise
        self._server, self._bound = server, (bound.st_dev, bound.st_ino)
        self.served += 1

    def lost(self) -> str | None:
        """Why the kubelet can no longer reach this server at `path` (deleted, or the name
        now holds another file), or None while it can or nothing is served."""
        if self._bound is None:
            return None
        try:
            st = self.path.lstat()
        except OSError:
            return "was deleted"
        if (st.st_dev, st.st_ino) == self._bound:
            return None
        if stat.S_ISSOCK(st.st_mode):
            return "was replaced by another socket"
        return "was replaced by a file that is not a socket"

    async def stop(self, grace: float = 1.0) -> None:
        """Stop the server (its calls get `grace` seconds), remove the socket, and wait for
        the servers being retired."""
        server, self._server, self._bound = self._server, None, None
        if server is not None:
            await server.stop(grace)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        if self._retiring:
            # Each failure is logged by the supervisor; stopping goes on regardless.
            await asyncio.gather(*self._retiring, return_exceptions=True)

    def _retire(self, server: grpc.aio.Server, grace: float) -> None:
        task = spawn(f"retire {self.name} server", server.stop(grace))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)


__all__ = [
    "MAX_DETAILS",
    "RETIRE_GRACE_S",
    "STATUS_CODES",
    "Boundary",
    "Calls",
    "StatusFor",
    "UnixServer",
    "bounded",
    "status_for",
    "undecodable",
]
