"""Our OpenAI app under plain uvicorn, with no Ray: the reference `serve_overhead.py` compares
Ray Serve's topologies with, so what Serve itself adds can be told apart from what any Python HTTP
server and our routes add.

The app is built as a direct-streaming replica builds it (`DirectLLMServer`): an `LLMReplica`
engine in this process, `in_process_openai_server` over it, and `create_app` for the routes. uvicorn writes its access log, as Serve's replica writes one per request.
`GET /bench/stats` answers the engine's `stats()` (step counters for the benchmark).

    python benchmarks/plain_uvicorn_server.py --port 8001 --config '{"engine": {...}, "api_keys": "k=t"}'
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn

from tandem.deployments.app import AppConfig, in_process_openai_server, replica_engine_options
from tandem.deployments.ingress import create_app
from tandem.deployments.replicas import LLMReplica


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True, help="the app config (build_app's argument) as JSON")
    args = parser.parse_args()

    cfg = AppConfig(**json.loads(args.config))
    replica = LLMReplica(replica_engine_options(cfg), None, None, cfg.stream_interval)
    app = create_app(in_process_openai_server(cfg, replica, None))

    @app.get("/bench/stats")
    async def stats() -> dict[str, Any]:
        return replica.engine.stats()

    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
