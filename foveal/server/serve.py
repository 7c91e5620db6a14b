"""Running the app under uvicorn, with a shutdown that drains: on SIGTERM/SIGINT the engine stops
admitting (/health says "draining", new requests get 503) and running requests get `drain_timeout`
seconds to finish; at that deadline every one still open gets a proper final event (streamed: an error
event, then [DONE]; whole: a JSON 503) from the EngineLoop. Only then does uvicorn shut down, so it
never has to cut a response off mid-stream. A second signal skips the wait.

uvicorn by itself waits for connections during its own graceful shutdown and then cancels their tasks:
a stream cut so ends with no final chunk, no error event and no [DONE].
"""

from __future__ import annotations

import logging
import threading

import uvicorn

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine_loop, drain_timeout: float):
        super().__init__(config)
        self.engine_loop, self.drain_timeout = engine_loop, drain_timeout
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        if self._drainer is not None or self.should_exit:  # a second signal: stop now
            return super().handle_exit(sig, frame)
        getattr(self, "_captured_signals", []).append(sig)  # uvicorn re-raises it once it has stopped
        log.info("signal %d: draining for up to %g s, then shutting down", sig, self.drain_timeout)
        self._drainer = threading.Thread(target=self._drain, name="foveal-drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        try:
            cut = self.engine_loop.drain(self.drain_timeout)
            if cut:
                log.warning("drain timeout: %d request(s) ended with an error", cut)
        except Exception:
            log.exception("draining failed")
        finally:
            self.should_exit = True


def serve(app, *, drain_timeout: float, **uvicorn_kwargs) -> None:
    """uvicorn.run(app, **uvicorn_kwargs), draining the app's EngineLoop on the first signal."""
    # the requests were ended by the drain: uvicorn needs only to flush their last bytes
    uvicorn_kwargs.setdefault("timeout_graceful_shutdown", 5)
    server = DrainingServer(uvicorn.Config(app, **uvicorn_kwargs), app.state.loop, drain_timeout)
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the SIGINT it stopped on (uvicorn.run swallows it too): no traceback
