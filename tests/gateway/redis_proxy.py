"""A TCP proxy in front of the test Redis, to make it slow or unreachable on demand.

Commands always reach Redis at once and run there; `delay_s` holds back Redis's answers (a
stalled Redis or network as the client sees it: its call times out although the command ran),
only those to requests containing `slow_for` when it is set; and `down` drops every
connection and refuses new ones (Redis unreachable). The proxy runs on
a thread with its own event loop, so sync and async tests and a gateway on another thread can
all use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from urllib.parse import urlsplit, urlunsplit


class RedisProxy:
    def __init__(self, redis_url: str) -> None:
        parts = urlsplit(redis_url)
        self._redis_url = parts
        self._target = (parts.hostname or "127.0.0.1", parts.port or 6379)
        self.delay_s = 0.0
        self.slow_for: bytes | None = None
        self.down = False
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        """REDIS_URL with the proxy in place of Redis (same database)."""
        parts = self._redis_url
        return urlunsplit(parts._replace(netloc=f"127.0.0.1:{self.port}"))

    def start(self) -> RedisProxy:
        self._thread.start()
        self._ready.wait(5)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shut(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _drop(self) -> None:
        self._drop_all()

    async def _shut(self) -> None:
        if self._server is not None:
            self._server.close()
        self._drop_all()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def go_down(self) -> None:
        """Redis unreachable from now: every connection dropped before this returns."""
        self.down = True
        asyncio.run_coroutine_threadsafe(self._drop(), self._loop).result(5)

    def come_back(self) -> None:
        self.down = False

    def _drop_all(self) -> None:
        for writer in list(self._writers):
            writer.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._serve, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.close()
            return
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        if self.down:  # it went down while this connection was being made: drop it too
            writer.close()
            upstream_writer.close()
            return
        self._writers.update((writer, upstream_writer))
        slow_answer = False

        async def to_redis() -> None:
            nonlocal slow_answer
            while data := await reader.read(65536):
                slow_answer = self.slow_for is None or self.slow_for in data
                upstream_writer.write(data)
                await upstream_writer.drain()

        async def to_client() -> None:
            while data := await upstream_reader.read(65536):
                if self.delay_s and slow_answer:
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()

        pumps = {asyncio.ensure_future(to_redis()), asyncio.ensure_future(to_client())}
        try:
            # Either side closing (or failing) ends the connection on both.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for each in (writer, upstream_writer):
                self._writers.discard(each)
                with contextlib.suppress(Exception):
                    each.close()
