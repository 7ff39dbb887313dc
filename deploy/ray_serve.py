"""Replicas of the engine behind Ray Serve's HTTP proxy, routed by prompt prefix.

    python -m deploy.ray_serve --replicas 2 --cpus-per-replica 1 -- --config default --threads 1

Everything after ``--`` is the server's own flags (``python -m server --help``), given to every
replica.  The proxy serves the same OpenAI API as one server (``/v1/...``, streaming included),
``/health`` and ``/metrics`` (of the replica the request lands on).

Three deployments' worth of pieces, built on Ray Serve rather than a home-made balancer:

* :class:`EngineReplica` holds one engine and the server's FastAPI app, and answers a forwarded
  request by calling that app in-process, streaming its response back through Ray.  Its
  ``check_health`` fails when the engine has died, so Ray replaces the replica.
* :class:`Ingress` (the proxy's route) reads a request's body, turns its prompt into the text the
  router matches prefixes on, and forwards it with a streaming handle.  A replica that dies
  mid-response ends the stream with an OpenAI-style error event (or a 503 before the response
  started): its clients get an error, never a hang.
* :class:`PrefixRouter` (a Ray Serve request router) sends a request to the replica that served the
  longest prefix of its text (a conversation's next turn, a shared system prompt), so the engine's
  prefix cache has it, unless that replica's queue is ``imbalance`` requests longer than the
  shortest.  A match counts when it covers half the prompt or 1024 characters.  Any other request
  goes to the least loaded replica.

Replicas autoscale on ongoing requests (``--min-replicas`` / ``--max-replicas``, target
``--target-ongoing``).
"""


# (no `from __future__ import annotations`: Ray Serve rebuilds the ingress methods from their real annotations)
import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter

from server.errors import APIError
from server.sse import DONE

log = logging.getLogger("deploy.ray_serve")

PREFIX_CHARS = 8192  # how much of a prompt the router matches on
CHUNK_CHARS = 64  # the granularity of a match


@dataclass
class Forwarded:
    """An HTTP request as the ingress hands it to a replica (``prompt``: what the router matches)."""

    method: str
    path: str
    query: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: str = ""


def prompt_text(body: bytes) -> str:
    """The text of a completions or chat request that a later request may share a prefix with: the
    prompt, or the messages as ``role: content`` lines in order (a conversation's next turn extends
    its last one's).  Empty for anything else."""
    try:
        data = json.loads(body) if body else None
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    if isinstance(data.get("messages"), list):
        lines = []
        for m in data["messages"]:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            lines.append(f"{m.get('role', '')}: {content if isinstance(content, str) else ''}\n")
        return "".join(lines)[:PREFIX_CHARS]
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    return prompt[:PREFIX_CHARS] if isinstance(prompt, str) else ""


def chunk_keys(text: str, chunk: int = CHUNK_CHARS) -> list[int]:
    """One key per whole ``chunk`` characters of ``text``: key ``k`` stands for ``text[:(k+1)*chunk]``."""
    keys, h = [], 0
    for start in range(0, len(text) - chunk + 1, chunk):
        h = hash((h, text[start:start + chunk]))
        keys.append(h)
    return keys


class PrefixRouter(RequestRouter):
    """Routes a request to the replica that served the longest prefix of its text (see the module)."""

    def initialize_state(self, imbalance: int = 2, min_share: float = 0.5, min_chars: int = 1024,
                         max_keys: int = 200_000) -> None:
        self.imbalance = imbalance
        # a match counts when it covers min_share of the prompt or min_chars (a long system prompt): a
        # short common opening ("Complete the following function:") is not worth a replica's queue
        self.min_share, self.min_chars = min_share, min_chars
        self.max_keys = max_keys  # per replica, least recently routed dropped first
        self.served: dict[ReplicaID, OrderedDict[int, None]] = {}

    def match(self, replica_id: ReplicaID, keys: list[int]) -> int:
        seen = self.served.get(replica_id, {})
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        return n

    async def choose_replicas(self, candidate_replicas: list, pending_request: Optional[PendingRequest] = None):
        if not candidate_replicas:
            return []
        keys = chunk_keys(_prompt_of(pending_request))
        if not keys:  # nothing to match (short or not a prompt): any replica, Ray takes the least loaded
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        queue = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas}
        free = [r for r in candidate_replicas if queue[r.replica_id] - min(queue.values()) <= self.imbalance]
        best = max(candidate_replicas, key=lambda r: (self.match(r.replica_id, keys), -queue[r.replica_id]))
        matched = self.match(best.replica_id, keys)
        if matched < min(self.min_share * len(keys), self.min_chars / CHUNK_CHARS) or best not in free:
            # a new prompt, or its replica is busy: the least loaded of the others (Ray probes them)
            return [random.sample(free, len(free)), [r for r in candidate_replicas if r not in free]]
        return [[best], [r for r in candidate_replicas if r is not best]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        seen = self.served.setdefault(replica_id, OrderedDict())
        for key in chunk_keys(_prompt_of(pending_request)):
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.max_keys:
            seen.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.served.pop(replica_id, None)  # its replacement starts with an empty cache


def _prompt_of(pending_request: Optional[PendingRequest]) -> str:
    for arg in pending_request.args if pending_request is not None else ():
        prompt = getattr(arg, "prompt", None)  # a Forwarded (by attribute: Ray may hold its own copy of the class)
        if isinstance(prompt, str):
            return prompt
    return ""


class EngineReplica:
    """One engine and the server's app (``server_args``: the server's flags).  ``pin``: run on one
    core of this machine, the replica's rank modulo the cores (Ray's CPUs are a count, not cores)."""

    def __init__(self, server_args: list[str], pin: bool = False) -> None:
        from engine.async_engine import AsyncEngine
        from server.build import build_core
        from server.app import create_app
        from server.settings import load_settings

        context = serve.get_replica_context()
        if pin and context is not None:  # before the engine's threads start: they inherit it
            cores = sorted(os.sched_getaffinity(0))
            rank = getattr(context.rank, "rank", context.rank)
            os.sched_setaffinity(0, {cores[int(rank) % len(cores)]})
        settings = load_settings(server_args, os.environ)
        logging.basicConfig(level=settings.log_level.upper())
        self.engine = AsyncEngine(lambda: build_core(settings), max_queue=settings.max_queue)
        self.app = create_app(settings, self.engine)
        self.grace = settings.shutdown_grace
        self.engine.start()  # what the app's lifespan does; the proxy routes here once this returns
        if not self.engine.wait_ready():
            raise RuntimeError(f"model loading failed: {self.engine.load_error}")
        self.replica = context.replica_id.unique_id if context is not None else "local"

    def check_health(self) -> None:
        """Ray calls this periodically; an engine that died makes Ray replace the replica."""
        from engine.async_engine import EngineState

        if self.engine.state is not EngineState.READY:
            raise RuntimeError(f"engine not ready: {self.engine.unavailable_reason()}")

    async def call(self, request: Forwarded) -> AsyncIterator[Any]:
        """The app's response to ``request``: first ``(status, headers)``, then the body's chunks.
        Closing the generator early (the client went away) disconnects the request in the app,
        which aborts it in the engine."""
        sent, gone, out = False, asyncio.Event(), asyncio.Queue()

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "scheme": "http", "path": request.path, "raw_path": request.path.encode(),
                 "query_string": request.query.encode(), "root_path": "", "headers": request.headers,
                 "client": ("ray-serve", 0), "server": ("replica", 0)}
        task = asyncio.create_task(self.app(scope, receive, out.put))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            while (message := await out.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [(k, v) for k, v in message.get("headers", [])] + [(b"x-mcsd-replica", self.replica.encode())]
                    yield message["status"], headers
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body"):
                        break
        finally:
            gone.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, self.grace)


async def _rest(stream, event_stream: bool) -> AsyncIterator[bytes]:
    try:
        async for chunk in stream:
            yield chunk
    except Exception as exc:  # noqa: BLE001 - the status is sent; report in-band, as the server does
        log.warning("replica failed mid-response: %s", exc)
        if event_stream:
            error = APIError(500, "The replica serving this stream failed; retry the request.", code="replica_failed")
            yield f"data: {error.to_response().model_dump_json()}\n\n{DONE}".encode()


ingress_app = FastAPI(title="mcsd-server on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(ingress_app)
class Ingress:
    """The proxy's one route: every request goes to an engine replica through a streaming handle."""

    def __init__(self, engine) -> None:
        self.engine = engine.options(stream=True)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "OPTIONS"])
    async def forward(self, request: Request, path: str):
        body = await request.body()
        forwarded = Forwarded(request.method, request.url.path, request.url.query, list(request.scope["headers"]),
                              body, prompt_text(body))
        stream = self.engine.call.remote(forwarded)
        try:
            status, headers = await stream.__anext__()
        except Exception as exc:  # noqa: BLE001 - the replica failed before answering
            log.warning("replica failed before answering %s: %s", request.url.path, exc)
            return APIError(503, "The replica serving this request failed; retry it.",
                            code="replica_failed").to_json_response()
        kept = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k.lower() != b"content-length"}
        event_stream = kept.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_rest(stream, event_stream), status_code=status, headers=kept)


def build_app(server_args: list[str], replicas: int = 2, cpus_per_replica: float = 1.0,
              min_replicas: Optional[int] = None, max_replicas: Optional[int] = None,
              target_ongoing: float = 4.0, max_ongoing: int = 16, imbalance: int = 2, pin: bool = False):
    """The Serve application: the ingress in front of the engine replicas."""
    options: dict[str, Any] = dict(
        ray_actor_options={"num_cpus": cpus_per_replica}, max_ongoing_requests=max_ongoing,
        health_check_period_s=5, health_check_timeout_s=30, graceful_shutdown_timeout_s=15,
        request_router_config=RequestRouterConfig(request_router_class="deploy.ray_serve.PrefixRouter",
                                                  request_router_kwargs={"imbalance": imbalance}))
    if min_replicas is not None or max_replicas is not None:
        low = min_replicas if min_replicas is not None else 1
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=low, initial_replicas=max(low, replicas), max_replicas=max_replicas or max(low, replicas),
            target_ongoing_requests=target_ongoing)
    else:
        options["num_replicas"] = replicas
    engine = serve.deployment(EngineReplica, name="EngineReplica", **options)
    ingress = serve.deployment(Ingress, name="Ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000)
    return ingress.bind(engine.bind(list(server_args), pin))


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m deploy.ray_serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (the initial count when autoscaling)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs each replica holds")
    p.add_argument("--min-replicas", type=int, help="autoscale down to this many (with --max-replicas)")
    p.add_argument("--max-replicas", type=int, help="autoscale up to this many on ongoing requests")
    p.add_argument("--target-ongoing", type=float, default=4.0, help="autoscaling: ongoing requests per replica")
    p.add_argument("--max-ongoing", type=int, default=16, help="requests one replica takes at once (more queue)")
    p.add_argument("--imbalance", type=int, default=2, help="queue difference past which a prefix match yields")
    p.add_argument("--pin-cores", action="store_true", help="each replica on one core (its rank modulo the cores)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(own)
    import ray

    logging.basicConfig(level=logging.INFO)
    ray.init(include_dashboard=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(server_args, args.replicas, args.cpus_per_replica, args.min_replicas, args.max_replicas,
                        args.target_ongoing, args.max_ongoing, args.imbalance, args.pin_cores),
              name="mcsd", route_prefix="/")
    log.info("serving on http://%s:%d (Ctrl-C stops)", args.host, args.port)
    try:
        while True:
            asyncio.run(asyncio.sleep(3600))
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
