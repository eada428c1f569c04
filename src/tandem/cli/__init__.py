"""The `tandem` command line, a module per command: `generate` (stream one prompt), `serve` (the
API on Ray Serve; its flags and environment become config in `serve_config`), `batch` (submit /
status / results / cancel batch jobs, or run a standalone batch worker) and `tenants` (the
operator API's tenants and keys)."""

from tandem.cli.main import main
from tandem.cli.serve_config import serve_config

__all__ = ["main", "serve_config"]
