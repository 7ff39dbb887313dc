"""``python -m server --model ... --draft-model ...``: start the OpenAI-compatible server.

The HTTP server starts first and the models load on the engine thread, so ``/health`` answers 503
while loading (orchestrators can probe it) instead of the port being closed.  If loading fails the
reason is logged and the process exits with status 1.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from typing import Optional, Sequence

import uvicorn

from engine.async_engine import AsyncEngine
from engine.engine_process import ProcessEngine
from server.app import GracefulServer, create_app
from server.build import build_core
from server.head_timeout import http_protocol
from server.settings import SettingsError, load_settings

log = logging.getLogger("server")


def _exit_if_load_fails(engine: AsyncEngine, server: uvicorn.Server, status: list[int]) -> None:
    if not engine.wait_ready():
        log.error("model loading failed: %s", engine.load_error)
        status[0] = 1
        server.should_exit = True


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        settings = load_settings(argv)
        if not settings.model:
            raise SettingsError("no model given: use --model, MCSD_MODEL or a --config preset")
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.setswitchinterval(settings.gil_switch_interval)
    if settings.engine_process:
        engine = ProcessEngine(functools.partial(build_core, settings), max_queue=settings.max_queue,
                               log_level=settings.log_level)
    else:
        engine = AsyncEngine(lambda: build_core(settings), max_queue=settings.max_queue)
    app = create_app(settings, engine)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=int(settings.shutdown_grace) + 5,
                            http=http_protocol(settings.header_read_timeout))
    server = GracefulServer(config, engine, settings.shutdown_grace)
    status = [0]
    threading.Thread(target=_exit_if_load_fails, args=(engine, server, status), daemon=True).start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its (already finished) graceful shutdown
        pass
    return status[0]


if __name__ == "__main__":
    sys.exit(main())
