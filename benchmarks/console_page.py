"""The console's page weight and first render, in headless Chromium against the app on loopback.

The app (`create_app`) serves the default model in-process with one tenant key. For the sign-in
page and, signed in, the usage and batches pages: the bytes the browser fetched (each resource's
encoded body, and the total), first contentful paint, and the time until the page's content is
drawn (its first table or form), each the median of `--rounds` fresh loads (no cache).

    python benchmarks/console_page.py               # -> benchmarks/results/console_page.json
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import cpu, log, write_result

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.conftest import serve_app  # noqa: E402  (the tests' loopback server helper)

KEY = "sk-console-bench"


def measure(page: Any, path: str, ready: str) -> dict[str, Any]:
    started = time.perf_counter()
    page.goto(path)
    page.locator(ready).first.wait_for()
    content_s = time.perf_counter() - started
    timing = page.evaluate(
        """() => ({
            fcp: (performance.getEntriesByName('first-contentful-paint')[0] || {}).startTime || null,
            dcl: performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd,
            resources: [performance.getEntriesByType('navigation')[0], ...performance.getEntriesByType('resource')]
                .map(r => ({name: new URL(r.name).pathname, bytes: r.encodedBodySize, decoded: r.decodedBodySize}))
        })"""
    )
    static = [r for r in timing["resources"] if r["name"].startswith("/console")]
    return {
        "first_contentful_paint_ms": timing["fcp"],
        "dom_content_loaded_ms": timing["dcl"],
        "content_drawn_ms": content_s * 1000,
        "static_bytes": sum(r["bytes"] for r in static),
        "static_bytes_decoded": sum(r["decoded"] for r in static),
        "resources": timing["resources"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "console_page.json")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    from tandem import AsyncEngine
    from tandem.deployments.engine_clients import LocalEngineClient
    from tandem.deployments.ingress import create_app
    from tandem.deployments.openai.server import OpenAIServer
    from tandem.platform.api_keys import parse_keys
    from tandem.platform.tenancy import TenantRegistry

    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("needs Debian's chromium: apt-get install chromium (make install does)")
    log(f"loading {args.model}")
    engine = AsyncEngine.from_options(args.model, kv_cache_memory=64 << 20)
    server = OpenAIServer(LocalEngineClient(engine), TenantRegistry(parse_keys(f"{KEY}=bench")))
    pages = {"signin": ("/console/signin", "form"), "batches": ("/console/batches", "table"),
             "usage": ("/console/usage", "form, table")}  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in pages}
    with serve_app(create_app(server)) as base_url, sync_playwright() as playwright:
        args_ = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = playwright.chromium.launch(executable_path=chromium, args=args_)
        for round_index in range(args.rounds):
            context = browser.new_context(base_url=base_url, viewport={"width": 1280, "height": 800})
            page = context.new_page()
            runs["signin"].append(measure(page, *pages["signin"]))
            page.get_by_label("API key").fill(KEY)
            page.get_by_role("button", name="Sign in").click()
            page.get_by_role("navigation", name="Console").wait_for()
            for name in ("batches", "usage"):
                runs[name].append(measure(page, *pages[name]))
            context.close()
            log(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                f"{n} {r[-1]['content_drawn_ms']:.0f} ms" for n, r in runs.items()))  # fmt: skip
        browser.close()
    engine.shutdown()
    result: dict[str, Any] = {"benchmark": "console_page", "cpu": cpu(), "rounds": args.rounds, "pages": {}}
    for name, results in runs.items():
        result["pages"][name] = {
            key: statistics.median(values) if (values := [r[key] for r in results if r[key] is not None]) else None
            for key in ("first_contentful_paint_ms", "dom_content_loaded_ms", "content_drawn_ms", "static_bytes",
                        "static_bytes_decoded")
        }  # fmt: skip
        result["pages"][name]["resources"] = results[-1]["resources"]
        log(f"{name}: {result['pages'][name]}")
    write_result(args.out, result)


if __name__ == "__main__":
    main()
