"""The console (`/console`): its session cookie, security headers and the API routes it relies on
(in-process), then the pages in headless Chromium (Debian's `chromium`, driven by Playwright)
against a real HTTP server with the whole platform behind it: tenants and keys in the tenant
directory, adapters, batches with a worker, usage metering, all on one object store.

The browser tests also take the screenshots in `docs/console/` (desktop and phone widths) and run
axe-core's accessibility rules on every page."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tandem import AsyncEngine
from tandem.batch.service import BatchLimits
from tandem.deployments.console_routes import CONTENT_SECURITY_POLICY, SESSION_COOKIE, STATIC_DIR
from tandem.deployments.ingress import create_app
from tandem.deployments.local import local_platform
from tandem.platform.api_keys import parse_operator_keys
from tandem.platform.object_store import FileObjectStore
from tandem.platform.tenancy import TenantRegistry
from tandem.platform.tenant_directory import TenantDirectory
from tandem.platform.usage_log import UsageLog

from .conftest import (
    PLAYGROUND_MESSAGE,
    console_page,
    headless_chromium,
    playground_answer,
    serve_with_worker,
)

REPO = Path(__file__).resolve().parent.parent
OPERATOR_KEY = "sk-console-operator"
SCREENSHOTS = REPO / "docs" / "console"
CONSOLE = {"X-Tandem-Console": "1"}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[AsyncEngine]:
    eng = AsyncEngine.from_options(
        str(tiny_model_dir), kv_cache_memory=8 << 20, served_model_name="tiny", enable_lora=True, max_loras=2
    )
    yield eng
    eng.shutdown()


class Platform:
    """A `tandem serve`-equivalent app on a loopback port: the keys of two tenants, acme and
    globex, issued through the operator API."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        op = {"Authorization": f"Bearer {OPERATOR_KEY}"}
        self.keys: dict[str, str] = {}
        for tenant in ("acme", "globex"):
            assert (
                httpx.post(f"{base_url}/v1/admin/tenants", json={"id": tenant}, headers=op).status_code == 200
            )
            issued = httpx.post(
                f"{base_url}/v1/admin/tenants/{tenant}/keys", json={"name": "bootstrap"}, headers=op
            )
            self.keys[tenant] = issued.json()["key"]

    def client(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.keys[tenant], max_retries=0)


@pytest.fixture(scope="module")
def platform(engine: AsyncEngine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    store = FileObjectStore(str(tmp_path_factory.mktemp("console-objects")))
    tenants = TenantRegistry(
        {}, operator_keys=parse_operator_keys(OPERATOR_KEY), directory=TenantDirectory(store)
    )
    usage_log = UsageLog(store, commit_interval_s=0.05)
    local = local_platform(
        engine, store, tenants, batch_limits=BatchLimits(shard_size=2, lease_ttl_s=5.0), adapters=True,
        usage_log=usage_log, worker_id="console",
    )  # fmt: skip
    with serve_with_worker(create_app(local.server), local.worker) as base_url:
        yield Platform(base_url)
    usage_log.close()


# -- the session and the routes behind the pages (no browser) ---------------------------------------
def test_the_session_cookie_is_httponly_strict_and_needs_the_console_header(platform: Platform) -> None:
    base, key = platform.base_url, platform.keys["acme"]
    with httpx.Client(base_url=base) as http:
        forged = http.post(
            "/console/session", content=json.dumps({"key": key}), headers={"Content-Type": "text/plain"}
        )
        assert forged.status_code == 403 and SESSION_COOKIE not in forged.cookies  # a cross-site form's post
        http.headers.update(CONSOLE)
        bad = http.post("/console/session", json={"key": "sk-nobody"})
        assert bad.status_code == 401 and SESSION_COOKIE not in bad.cookies
        assert http.post("/console/session", json={}).json()["error"]["param"] == "key"
        signed_in = http.post("/console/session", json={"key": key})
        assert signed_in.status_code == 200 and signed_in.json() == {
            "object": "console.session", "role": "tenant", "tenant": "acme"
        }  # fmt: skip
        cookie = signed_in.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
        assert "Secure" not in cookie  # plain HTTP here; over TLS (or X-Forwarded-Proto: https) it is set
        assert key not in str(signed_in.url) and http.get("/console/session").json()["tenant"] == "acme"
        # The cookie alone authorises nothing: a cross-site form cannot add the console's header.
        assert http.get("/v1/batches", headers={"X-Tandem-Console": "0"}).status_code == 401
        assert http.get("/v1/batches").status_code == 200
        assert http.delete("/console/session").status_code == 200
        assert http.get("/v1/batches").status_code == 401
        assert http.get("/console/session").status_code == 401
    tls = httpx.post(
        f"{base}/console/session", json={"key": key}, headers={"X-Forwarded-Proto": "https", **CONSOLE}
    )
    assert "Secure" in tls.headers["set-cookie"]


def test_pages_carry_a_strict_content_security_policy_and_unknown_paths_are_404(platform: Platform) -> None:
    for path in ("/console", "/console/batches", "/console/assets/console.js", "/console/assets/console.css"):
        response = httpx.get(platform.base_url + path)
        assert response.status_code == 200, path
        assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
        assert (
            response.headers["x-frame-options"] == "DENY"
            and response.headers["x-content-type-options"] == "nosniff"
        )
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe-inline" not in CONTENT_SECURITY_POLICY
    page = httpx.get(platform.base_url + "/console/usage").text
    assert "<script" in page and "<script>" not in page and " style=" not in page  # no inline script or style
    plain = httpx.get(
        f"{platform.base_url}/console/assets/console.js", headers={"Accept-Encoding": "identity"}
    )
    zipped = httpx.get(f"{platform.base_url}/console/assets/console.js", headers={"Accept-Encoding": "gzip"})
    assert "content-encoding" not in plain.headers and zipped.headers["content-encoding"] == "gzip"
    assert zipped.content == plain.content and int(zipped.headers["content-length"]) < len(plain.content) / 2
    for path in (
        "/console/nope",
        "/console/assets/..%2Fconsole_routes.py",
        "/console/assets/SOURCE_DIGEST.x",
    ):
        assert httpx.get(platform.base_url + path).status_code == 404, path


def test_tenants_manage_only_their_own_keys_and_the_fleet_is_for_operators(platform: Platform) -> None:
    base = platform.base_url
    acme = {"Authorization": f"Bearer {platform.keys['acme']}"}
    created = httpx.post(f"{base}/v1/organization/projects/acme/api_keys", json={"name": "ci"}, headers=acme)
    assert created.status_code == 200 and created.json()["key"].startswith("tdm-")
    listed = httpx.get(f"{base}/v1/organization/projects/acme/api_keys", headers=acme).json()["data"]
    assert {"bootstrap", "ci"} <= {k["name"] for k in listed} and all("key" not in k for k in listed)
    assert httpx.get(f"{base}/v1/organization/projects/globex/api_keys", headers=acme).status_code == 403
    key_id = created.json()["id"]
    assert (
        httpx.delete(f"{base}/v1/organization/projects/globex/api_keys/{key_id}", headers=acme).status_code
        == 403
    )
    assert (
        httpx.post(f"{base}/v1/organization/projects/acme/api_keys", json={"nme": 1}, headers=acme).json()[
            "error"
        ]["param"]
        == "nme"
    )
    assert (
        httpx.delete(f"{base}/v1/organization/projects/acme/api_keys/{key_id}", headers=acme).status_code
        == 200
    )
    new_key = {"Authorization": f"Bearer {created.json()['key']}"}
    assert httpx.get(f"{base}/v1/models", headers=new_key).status_code == 401  # revoked at once
    assert httpx.get(f"{base}/v1/admin/fleet", headers=acme).status_code == 403
    fleet = httpx.get(f"{base}/v1/admin/fleet", headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
    assert fleet.status_code == 200 and fleet.json()["model"] == "tiny"
    replica = next(iter(fleet.json()["replicas"].values()))
    assert 0.0 <= replica["kv_occupancy"] <= 1.0 and "num_running" in replica


def _source_digest(console: Path) -> str:
    """`sourceDigest()` of console/build.mjs, recomputed: the sources the bundle was built from."""

    def files(folder: Path) -> list[Path]:
        out: list[Path] = []
        for child in sorted(folder.iterdir(), key=lambda p: p.name):
            out.extend(files(child) if child.is_dir() else [child])
        return out

    digest = hashlib.sha256()
    for path in [*files(console / "src"), console / "index.html", console / "package-lock.json"]:
        digest.update(str(path.relative_to(console)).encode() + b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def test_the_committed_bundle_was_built_from_the_console_sources() -> None:
    built = (STATIC_DIR / "SOURCE_DIGEST").read_text().strip()
    assert built == _source_digest(REPO / "console"), "the console bundle is stale: run `make console`"
    script = (STATIC_DIR / "console.js").read_bytes()
    assert len(script) < 150_000 and b"sourceMappingURL" not in script


# -- the pages in a browser ---------------------------------------------------------------------------
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium() as chromium:
        yield chromium


@pytest.fixture()
def open_page(browser: Any, platform: Platform) -> Iterator[Callable[..., Any]]:
    pages: list[Any] = []

    def open_page(key: str | None = None, viewport: dict[str, int] = DESKTOP) -> Any:
        pages.append(console_page(browser, platform.base_url, key, viewport))
        return pages[-1]

    yield open_page
    for page in pages:
        page.context.close()


def _axe(page: Any) -> list[dict[str, Any]]:
    """axe-core's serious and critical violations on the page as it is."""
    from axe_playwright_python.sync_playwright import Axe

    results = Axe().run(page)
    return [v for v in results.response["violations"] if v["impact"] in ("serious", "critical")]


def _shoot(page: Any, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    width = page.viewport_size["width"]
    page.screenshot(
        path=str(SCREENSHOTS / f"{name}-{'phone' if width < 600 else 'desktop'}.png"), full_page=True
    )


def _batch_file(prompts: list[str]) -> bytes:
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 4, "temperature": 0}}
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    return ("\n".join(json.dumps(line) for line in lines) + "\n").encode()


def test_sign_in_refuses_a_bad_key_and_keeps_the_key_out_of_the_page(
    open_page: Callable[..., Any], platform: Platform
) -> None:
    page = open_page()
    page.goto("/console")
    page.get_by_label("API key").fill("sk-wrong")
    page.get_by_role("button", name="Sign in").click()
    assert (
        "invalid" in page.get_by_role("alert").inner_text().lower()
        or "key" in page.get_by_role("alert").inner_text()
    )
    assert _axe(page) == []
    _shoot(page, "signin")
    page.get_by_label("API key").fill(platform.keys["acme"])
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", name="Usage").wait_for()
    assert page.url.endswith("/console/usage") and platform.keys["acme"] not in page.url
    stored = page.evaluate(
        "() => JSON.stringify(localStorage) + JSON.stringify(sessionStorage) + document.cookie"
    )
    assert platform.keys["acme"] not in stored  # the cookie is HttpOnly: no script sees it
    assert page.errors == []


def test_keys_page_creates_a_key_shown_once_and_revokes_it(
    open_page: Callable[..., Any], platform: Platform
) -> None:
    page = open_page(platform.keys["acme"])
    page.goto("/console/keys")
    page.get_by_label("Name").fill("from-the-console")
    page.get_by_role("button", name="Create key").click()
    secret = page.locator(".key-secret").inner_text()
    assert secret.startswith("tdm-")
    row = page.locator("tr", has_text="from-the-console")
    row.wait_for()
    assert secret not in row.inner_text()  # listed by prefix only
    client = openai.OpenAI(base_url=f"{platform.base_url}/v1", api_key=secret, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    _shoot(page, "keys")
    assert _axe(page) == []
    page.get_by_role("button", name="Revoke from-the-console").click()
    row.wait_for(state="detached")
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    page.reload()
    assert (
        page.locator("tr", has_text="from-the-console").count() == 0
        and page.locator(".key-secret").count() == 0
    )


def test_adapters_page_uploads_a_peft_folder_shows_errors_inline_and_deletes(
    open_page: Callable[..., Any], platform: Platform, peft_adapters: dict[str, Path]
) -> None:
    folder = next(iter(peft_adapters.values()))
    page = open_page(platform.keys["acme"])
    page.goto("/console/adapters")
    page.get_by_label("Name").fill("broken")
    page.get_by_label("adapter_config.json").set_input_files(str(folder / "adapter_config.json"))
    page.get_by_label("adapter_model.safetensors").set_input_files(
        {
            "name": "adapter_model.safetensors",
            "mimeType": "application/octet-stream",
            "buffer": b"not safetensors",
        }
    )
    page.get_by_role("button", name="Upload").click()
    error = page.locator(".alert.error")
    error.wait_for()
    assert "adapter_model" in error.inner_text() or "safetensors" in error.inner_text().lower()
    page.get_by_label("Name").fill("support-bot")
    page.get_by_label("adapter_config.json").set_input_files(str(folder / "adapter_config.json"))
    page.get_by_label("adapter_model.safetensors").set_input_files(str(folder / "adapter_model.safetensors"))
    page.get_by_role("button", name="Upload").click()
    page.locator("tr[data-adapter='support-bot']").wait_for()
    assert "tiny:support-bot" in page.locator("tr[data-adapter='support-bot']").inner_text()
    assert [
        a["id"]
        for a in httpx.get(
            f"{platform.base_url}/v1/adapters", headers={"Authorization": f"Bearer {platform.keys['acme']}"}
        ).json()["data"]
    ] == ["support-bot"]
    _shoot(page, "adapters")
    assert _axe(page) == []
    page.get_by_label("Name").fill("scratch")  # a second one, deleted from the page
    page.get_by_label("adapter_config.json").set_input_files(str(folder / "adapter_config.json"))
    page.get_by_label("adapter_model.safetensors").set_input_files(str(folder / "adapter_model.safetensors"))
    page.get_by_role("button", name="Upload").click()
    page.locator("tr[data-adapter='scratch']").wait_for()
    page.get_by_role("button", name="Delete scratch").click()
    page.locator("tr[data-adapter='scratch']").wait_for(state="detached")
    listed = httpx.get(
        f"{platform.base_url}/v1/adapters", headers={"Authorization": f"Bearer {platform.keys['acme']}"}
    )
    assert [a["id"] for a in listed.json()["data"]] == ["support-bot"]


def test_batches_page_runs_a_batch_to_done_and_downloads_its_output(
    open_page: Callable[..., Any], platform: Platform
) -> None:
    page = open_page(platform.keys["acme"])
    page.goto("/console/batches")
    prompts = [f"Item {i}" for i in range(6)]
    page.get_by_label("Requests (JSONL)").set_input_files(
        {"name": "requests.jsonl", "mimeType": "application/jsonl", "buffer": _batch_file(prompts)}
    )
    page.get_by_role("button", name="Upload and start").click()
    row = page.locator("tr[data-batch-id]").first
    row.wait_for()
    batch_id = row.get_attribute("data-batch-id")
    page.locator(f"tr[data-batch-id='{batch_id}'][data-status='completed']").wait_for(timeout=120_000)
    bar = page.get_by_role("progressbar", name=f"Progress of {batch_id}")
    assert bar.get_attribute("value") == bar.get_attribute("max") == "6"
    assert "6 of 6 lines done (0 failed)" in page.locator(f"tr[data-batch-id='{batch_id}']").inner_text()
    with page.expect_download() as download:
        page.get_by_role("button", name="Download output").first.click()
    lines = [json.loads(line) for line in Path(download.value.path()).read_text().splitlines()]
    assert sorted(line["custom_id"] for line in lines) == [f"line-{i}" for i in range(6)]
    assert all(line["response"]["status_code"] == 200 for line in lines)
    _shoot(page, "batches")
    assert _axe(page) == []


def test_playground_streams_an_answer(open_page: Callable[..., Any], platform: Platform) -> None:
    page = open_page(platform.keys["acme"])
    answer = playground_answer(page, "tiny", 12)
    assert int(answer.get_attribute("data-chunks")) >= 2  # arrived as several streamed chunks
    reference = platform.client("acme").chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PLAYGROUND_MESSAGE}],
        max_tokens=12,
        temperature=0,
    )
    assert answer.inner_text() == reference.choices[0].message.content
    curl = page.get_by_label("The request as curl").inner_text()
    assert '"max_tokens": 12' in curl and "$TANDEM_API_KEY" in curl and platform.keys["acme"] not in curl
    # The Python to copy runs as shown and streams the same answer.
    python = page.get_by_label("The request in Python").inner_text()
    env = {**os.environ, "TANDEM_API_KEY": platform.keys["acme"]}
    ran = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, env=env, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == answer.inner_text()
    _shoot(page, "playground")
    assert _axe(page) == []


def test_playground_streams_through_the_responses_api(
    open_page: Callable[..., Any], platform: Platform
) -> None:
    """The playground's "API" choice: the same greedy answer through `/v1/responses`, and Python
    to copy that streams it with `client.responses.create`."""
    page = open_page(platform.keys["acme"])
    page.goto("/console/playground")
    page.get_by_label("API").select_option("responses")
    answer = playground_answer(page, "tiny", 12, goto=False)
    reference = platform.client("acme").responses.create(
        model="tiny", input=PLAYGROUND_MESSAGE, max_output_tokens=12, temperature=0
    )
    assert answer.inner_text() == reference.output_text
    curl = page.get_by_label("The request as curl").inner_text()
    assert "/v1/responses" in curl and '"max_output_tokens": 12' in curl
    python = page.get_by_label("The request in Python").inner_text()
    env = {**os.environ, "TANDEM_API_KEY": platform.keys["acme"]}
    ran = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True, env=env, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == answer.inner_text()


def test_usage_page_charts_the_tenants_own_tokens_and_exports_csv(
    open_page: Callable[..., Any], platform: Platform
) -> None:
    acme, globex = platform.client("acme"), platform.client("globex")
    acme.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    globex.completions.create(model="tiny", prompt="Hello", max_tokens=7)
    deadline = time.monotonic() + 30
    headers = {"Authorization": f"Bearer {platform.keys['acme']}"}
    while not httpx.get(
        f"{platform.base_url}/v1/organization/usage/completions",
        params={"start_time": 0, "bucket_width": "1d", "limit": 31},
        headers=headers,
    ).json()["data"]:
        assert time.monotonic() < deadline  # committed within the usage log's interval
        time.sleep(0.05)
    page = open_page(platform.keys["acme"])
    page.goto("/console/usage")
    page.locator("table.data tbody tr td", has_text="tiny").first.wait_for()
    assert page.locator(".chart canvas").count() == 1
    with page.expect_download() as download:
        page.get_by_role("button", name="Export CSV").click()
    rows = Path(download.value.path()).read_text().splitlines()
    assert rows[0].startswith("bucket_start_utc,model,kind,requests")
    totals = httpx.get(
        f"{platform.base_url}/v1/organization/usage/completions",
        params={"start_time": int(time.time()) // 86400 * 86400, "bucket_width": "1d", "group_by": "model"}, headers=headers,
    ).json()  # fmt: skip
    expected = sum(r["output_tokens"] for b in totals["data"] for r in b["results"])
    assert sum(int(row.split(",")[6]) for row in rows[1:]) == expected > 0
    _shoot(page, "usage")
    assert _axe(page) == []


def test_a_tenant_sees_none_of_another_tenants_batches_adapters_or_usage(
    open_page: Callable[..., Any], platform: Platform
) -> None:
    acme = platform.client("acme")
    upload = acme.files.create(file=("r.jsonl", io.BytesIO(_batch_file(["x"]))), purpose="batch")
    batch = acme.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    page = open_page(platform.keys["globex"])
    page.goto("/console/batches")
    page.get_by_role("table").wait_for()
    page.locator("tbody tr").first.wait_for()
    assert batch.id not in page.locator("table").inner_text()
    fetched = page.evaluate(
        "async (id) => (await fetch('/v1/batches/' + id, {headers: {'X-Tandem-Console': '1'}})).status",
        batch.id,
    )
    assert fetched == 404  # the API call behind the page, with globex's session
    page.goto("/console/adapters")
    page.locator("tbody tr").first.wait_for()
    assert "support-bot" not in page.locator("table").inner_text()
    page.goto("/console/usage")
    page.locator("table.data tbody tr").first.wait_for()
    usage = page.evaluate(
        "async () => (await fetch('/v1/organization/usage/completions?start_time=0&bucket_width=1d&limit=31&project_ids=acme',"
        " {headers: {'X-Tandem-Console': '1'}})).status"
    )
    assert usage == 403
    assert "acme" not in page.locator("main").inner_text()


def test_operator_pages_refuse_a_tenant_and_show_the_fleet_to_an_operator(
    open_page: Callable[..., Any], platform: Platform
) -> None:
    page = open_page(platform.keys["acme"])
    page.goto("/console/fleet")
    alert = page.get_by_role("alert")
    alert.wait_for()
    assert "operator" in alert.inner_text().lower()
    assert page.locator("tbody tr").count() == 0
    operator = open_page(OPERATOR_KEY)
    operator.get_by_role("heading", name="Fleet").wait_for()
    operator.locator("tbody tr", has_text="local").wait_for()
    assert "colocated" in operator.locator("tbody tr", has_text="local").inner_text()
    assert "No autoscaling history" in operator.locator("figure.chart").inner_text()  # one engine, in-process
    _shoot(operator, "fleet")
    assert _axe(operator) == []
    operator.goto("/console/tenants")
    operator.locator("tbody tr", has_text="globex").wait_for()
    _shoot(operator, "tenants")
    assert _axe(operator) == []


def test_operator_sees_each_tenants_load_refusals_and_queued_batches(
    open_page: Callable[..., Any], platform: Platform
) -> None:
    base, op = platform.base_url, {"Authorization": f"Bearer {OPERATOR_KEY}"}
    # A tenant limited to one request a minute: its second request is a 429, counted by code.
    httpx.post(
        f"{base}/v1/admin/tenants", json={"id": "initech", "limits": {"requests_per_minute": 1}}, headers=op
    )
    key = httpx.post(f"{base}/v1/admin/tenants/initech/keys", json={}, headers=op).json()["key"]
    initech = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    initech.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.RateLimitError):
        initech.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    # A request in flight shows as running for its tenant: polled while its stream is read.
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 500, "stream": True, "ignore_eos": True}
    running_seen = 0
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {platform.keys['globex']}"}) as stream:  # fmt: skip
        for line in stream.iter_lines():
            assert not line.startswith("{"), line  # an error instead of the stream
            load = httpx.get(f"{base}/v1/admin/load", headers=op).json()
            running_seen = max(running_seen, load["tenants"].get("globex", {}).get("running", 0))
            if running_seen:
                break
    assert running_seen == 1
    assert load["tenants"]["initech"]["refused_last_hour"] == {"requests_per_minute_exceeded": 1}
    tenant = {"Authorization": f"Bearer {platform.keys['acme']}"}
    assert httpx.get(f"{base}/v1/admin/load", headers=tenant).status_code == 403
    assert httpx.get(f"{base}/v1/admin/batches", headers=tenant).status_code == 403
    page = open_page(OPERATOR_KEY)
    page.goto("/console/tenants")
    row = page.locator("tbody tr", has_text="initech")
    row.wait_for()
    assert row.locator("td").nth(5).inner_text() == "1"  # its 429s of the last hour
    # The batch queue: a long batch is listed with its tenant until it is cancelled.
    acme = platform.client("acme")
    lines = _batch_file([f"Long item {i}" for i in range(200)]).replace(
        b'"max_tokens": 4', b'"max_tokens": 64'
    )
    upload = acme.files.create(file=("long.jsonl", io.BytesIO(lines)), purpose="batch")
    batch = acme.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    try:
        page.goto("/console/queue")
        page.locator(f"tr[data-batch-id='{batch.id}']").wait_for()
        assert "acme" in page.locator(f"tr[data-batch-id='{batch.id}']").inner_text()
        assert int(page.locator("tr[data-tenant='acme'] td").nth(2).inner_text()) > 0  # lines left
        _shoot(page, "queue")
        assert _axe(page) == []
        # The tenant cancels it from its batches page; lines done keep their results.
        mine = open_page(platform.keys["acme"])
        mine.goto("/console/batches")
        mine.locator(f"tr[data-batch-id='{batch.id}']").get_by_role("button", name="Cancel").click()
        mine.locator(f"tr[data-batch-id='{batch.id}'][data-status='cancelled']").wait_for(timeout=60_000)
        page.locator(f"tr[data-batch-id='{batch.id}']").wait_for(state="detached")  # gone from the queue
    finally:
        if acme.batches.retrieve(batch.id).status not in ("cancelling", "cancelled"):
            acme.batches.cancel(batch.id)


@pytest.mark.parametrize(
    "name", ["signin", "usage", "batches", "adapters", "keys", "playground", "fleet", "tenants", "queue"]
)
def test_every_page_at_phone_width(open_page: Callable[..., Any], platform: Platform, name: str) -> None:
    key = (
        None
        if name == "signin"
        else OPERATOR_KEY
        if name in ("fleet", "tenants", "queue")
        else platform.keys["acme"]
    )
    page = open_page(key, viewport=PHONE)
    page.goto(f"/console/{name}")
    page.locator("main table, main form").first.wait_for()
    page.wait_for_load_state("networkidle")
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"{name} scrolls sideways at phone width"
    _shoot(page, name)
    assert _axe(page) == []
    assert page.errors == []
