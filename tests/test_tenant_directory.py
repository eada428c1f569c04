"""The live tenant directory (`platform/tenant_directory.py`) on the local object store and on a
real S3 server (SeaweedFS): two directories over one store stand for two ingress replicas."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from pathlib import Path

import pytest

from tandem.deployments.openai.endpoints import ENDPOINTS
from tandem.platform.errors import ConflictError, InvalidRequestError, NotFoundError
from tandem.platform.object_store import FileObjectStore, ObjectStore, S3ObjectStore
from tandem.platform.tenant_directory import (
    DIRECTORY_KEY,
    TenantDirectory,
    parse_tenant_patch,
    parse_tenant_spec,
)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@pytest.fixture
def store(tmp_path: Path) -> FileObjectStore:
    return FileObjectStore(str(tmp_path / "store"))


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def any_store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    """The local store, then a fresh prefix of the session's SeaweedFS bucket."""
    import uuid

    from .conftest import S3_BUCKET

    if request.param == "file":
        return FileObjectStore(str(tmp_path / "store"))
    # These tests check compare-and-swap, not the store's time budget (tests/test_faults.py does):
    # eight concurrent conditional PUTs on a loaded 2-core CI machine can take longer than the
    # real-time path's 3 s read timeout, so this store waits longer.
    settings = dataclasses.replace(request.getfixturevalue("s3_server"), read_timeout_s=30.0)
    return S3ObjectStore(S3_BUCKET, prefix=f"dir-{uuid.uuid4().hex[:8]}", settings=settings)


def test_a_key_issued_on_one_replica_authenticates_on_another_and_revocation_follows(
    any_store: ObjectStore,
) -> None:
    writer, reader = TenantDirectory(any_store), TenantDirectory(any_store)
    writer.create_tenant(
        parse_tenant_spec({"id": "acme", "limits": {"tokens_per_minute": 1000}, "weight": 2})
    )
    key, secret = writer.create_key("acme", name="ci")
    assert secret.startswith("tdm-") and key.prefix == secret[:8]
    assert reader.snapshot.tenant_for_digest(_digest(secret)) is None  # not read yet
    assert reader.refresh().tenant_for_digest(_digest(secret)) == "acme"
    assert reader.snapshot.tenants["acme"].limits.tokens_per_minute == 1000
    assert reader.snapshot.tenants["acme"].weight == 2.0
    # the secret is nowhere in the store, only its digest
    raw = any_store.get(DIRECTORY_KEY).data
    assert secret.encode() not in raw and secret[8:].encode() not in raw
    assert _digest(secret).encode() in raw
    writer.revoke_key("acme", key.id)
    assert reader.refresh().tenant_for_digest(_digest(secret)) is None


def test_listed_keys_never_show_their_secret(any_store: ObjectStore) -> None:
    directory = TenantDirectory(any_store)
    directory.create_tenant(parse_tenant_spec({"id": "acme"}))
    key, secret = directory.create_key("acme")
    listed = [k.api() for k in directory.list_keys("acme")]
    assert [k["id"] for k in listed] == [key.id]
    assert secret not in str(listed) and key.digest not in str(listed)
    assert listed[0]["redacted_value"] == secret[:8] + "..."


def test_limits_and_weight_change_live(any_store: ObjectStore) -> None:
    writer, reader = TenantDirectory(any_store), TenantDirectory(any_store)
    writer.create_tenant(parse_tenant_spec({"id": "acme", "limits": {"max_concurrent_requests": 4}}))
    reader.refresh()
    writer.update_tenant("acme", parse_tenant_patch({"limits": {"tokens_per_minute": 50}, "weight": 3}))
    tenant = reader.refresh().tenants["acme"]
    assert (tenant.limits.max_concurrent_requests, tenant.limits.tokens_per_minute, tenant.weight) == (
        4,
        50,
        3.0,
    )
    writer.update_tenant("acme", parse_tenant_patch({"limits": {"max_concurrent_requests": None}}))
    assert reader.refresh().tenants["acme"].limits.max_concurrent_requests is None


def test_expired_keys_and_deleted_tenants_do_not_authenticate(any_store: ObjectStore) -> None:
    directory = TenantDirectory(any_store)
    directory.create_tenant(parse_tenant_spec({"id": "acme"}))
    soon = int(time.time()) + 60
    _, secret = directory.create_key("acme", expires_at=soon)
    snapshot = directory.refresh()
    assert snapshot.tenant_for_digest(_digest(secret), now=soon - 1) == "acme"
    assert snapshot.tenant_for_digest(_digest(secret), now=soon) is None
    _, other = directory.create_key("acme")
    directory.delete_tenant("acme")
    assert directory.refresh().tenant_for_digest(_digest(other)) is None
    assert directory.refresh().keys == {}  # its keys went with it


def test_bad_input_is_refused_and_nothing_is_written(any_store: ObjectStore) -> None:
    directory = TenantDirectory(any_store)
    directory.create_tenant(parse_tenant_spec({"id": "acme"}))
    before = any_store.get(DIRECTORY_KEY).etag
    with pytest.raises(ConflictError):
        directory.create_tenant(parse_tenant_spec({"id": "acme"}))
    for body, param in [
        ({"id": "a b"}, "id"),
        ({"id": "x", "limits": {"tokens_per_minute": 0}}, "limits.tokens_per_minute"),
        ({"id": "x", "limits": {"per_fortnight": 3}}, "limits.per_fortnight"),
        ({"id": "x", "weight": -1}, "weight"),
        ({"limits": {}}, "id"),
    ]:
        with pytest.raises(InvalidRequestError) as refused:
            parse_tenant_spec(body)
        assert refused.value.param == param, body
    with pytest.raises(InvalidRequestError) as refused:
        directory.update_tenant("acme", parse_tenant_patch({"limits": {"max_tokens": -5}}))
    assert refused.value.param == "limits.max_tokens"
    with pytest.raises(NotFoundError):
        directory.update_tenant("nobody", parse_tenant_patch({"weight": 2}))
    with pytest.raises(NotFoundError):
        directory.create_key("nobody")
    with pytest.raises(NotFoundError):
        directory.revoke_key("acme", "key_missing")
    with pytest.raises(InvalidRequestError):
        directory.create_key("acme", expires_at=int(time.time()) - 1)
    assert any_store.get(DIRECTORY_KEY).etag == before  # every refusal wrote nothing


def test_concurrent_operators_lose_no_change(any_store: ObjectStore) -> None:
    """Eight writers (separate directories, as on separate replicas) create tenants and keys at
    once: compare-and-swap keeps every change."""
    errors: list[BaseException] = []

    def operator(index: int) -> None:
        try:
            directory = TenantDirectory(any_store)
            directory.create_tenant(parse_tenant_spec({"id": f"t{index}"}))
            directory.create_key(f"t{index}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=operator, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    snapshot = TenantDirectory(any_store).refresh()
    assert sorted(snapshot.tenants) == sorted(f"t{i}" for i in range(8))
    assert sorted(k.tenant for k in snapshot.keys.values()) == sorted(f"t{i}" for i in range(8))


def test_operator_api_in_process(engine: object, store: FileObjectStore) -> None:
    """The admin routes over a real engine, in-process (the Ray tests in test_fleet.py cover
    several ingress replicas): create a tenant, issue a key, use it with the openai client,
    tighten its limits, revoke it; a tenant key is refused on the admin routes (403)."""
    import openai
    from fastapi.testclient import TestClient

    from tandem.deployments.engine_clients import LocalEngineClient
    from tandem.deployments.ingress import create_app
    from tandem.deployments.openai.server import OpenAIServer
    from tandem.platform.api_keys import parse_keys, parse_operator_keys
    from tandem.platform.tenancy import TenantRegistry

    directory = TenantDirectory(store)
    tenants = TenantRegistry(
        parse_keys("sk-boot=acme"), operator_keys=parse_operator_keys("sk-op"), directory=directory
    )
    server = OpenAIServer(LocalEngineClient(engine), tenants)  # type: ignore[arg-type]
    with TestClient(create_app(server)) as http:
        op = {"Authorization": "Bearer sk-op"}
        assert http.post("/v1/admin/tenants", json={"id": "initech"}, headers=op).status_code == 200
        issued = http.post("/v1/admin/tenants/initech/keys", json={}, headers=op).json()
        api = openai.OpenAI(
            base_url="http://testserver/v1", api_key=issued["key"], http_client=http, max_retries=0
        )
        assert [m.id for m in api.models.list().data] == ["tiny"]  # this replica: at once
        assert http.patch("/v1/admin/tenants/initech", json={"weight": 3}, headers=op).status_code == 200
        api.completions.create(model="tiny", prompt="Hello", max_tokens=2)
        assert engine.engine.scheduler.fair.weights["initech"] == 3.0  # type: ignore[attr-defined]  # carried by the request
        patched = http.patch(
            "/v1/admin/tenants/initech", json={"limits": {"tokens_per_minute": 1}}, headers=op
        )
        assert patched.status_code == 200
        with pytest.raises(openai.RateLimitError):
            api.completions.create(model="tiny", prompt="Hello", max_tokens=2)
        assert http.get("/v1/admin/tenants", headers={"Authorization": "Bearer sk-boot"}).status_code == 403
        assert (
            http.get("/v1/admin/tenants", headers={"Authorization": f"Bearer {issued['key']}"}).status_code
            == 403
        )
        revoked = http.delete(f"/v1/admin/tenants/initech/keys/{issued['id']}", headers=op)
        assert revoked.status_code == 200
        with pytest.raises(openai.AuthenticationError):
            api.models.list()
        body = http.post("/v1/admin/tenants", json={"id": "x", "limits": "lots"}, headers=op)
        assert body.status_code == 400 and body.json()["error"]["param"] == "limits"


def test_tenants_cli_over_the_operator_api(
    engine: object, store: FileObjectStore, capsys: pytest.CaptureFixture[str]
) -> None:
    """`tandem tenants ...` against the app under uvicorn: create a tenant with a limit, issue a
    key (printed once) that then works with the openai client, list, revoke; a duplicate exits 1
    with OpenAI's error shape on stderr."""
    import json

    import openai

    from tandem.cli import main
    from tandem.deployments.engine_clients import LocalEngineClient
    from tandem.deployments.ingress import create_app
    from tandem.deployments.openai.server import OpenAIServer
    from tandem.platform.api_keys import parse_operator_keys
    from tandem.platform.tenancy import TenantRegistry

    from .conftest import serve_app

    tenants = TenantRegistry({}, operator_keys=parse_operator_keys("sk-op"), directory=TenantDirectory(store))
    from tandem.platform.usage_log import UsageLog

    usage_log = UsageLog(store, commit_interval_s=0.0)
    app = create_app(OpenAIServer(LocalEngineClient(engine), tenants, usage_log=usage_log))  # type: ignore[arg-type]
    with serve_app(app) as url:
        base = ["tenants", "--base-url", f"{url}/v1", "--operator-key", "sk-op"]

        def run(*args: str) -> tuple[int, str, str]:
            code = main([*base, *args])
            out, err = capsys.readouterr()
            return code, out, err

        code, out, _ = run("create", "acme", "--weight", "2", "--limit", "tokens_per_minute=100")
        assert code == 0 and json.loads(out)["limits"]["tokens_per_minute"] == 100
        code, out, _ = run("keys", "create", "acme", "--name", "ci", "--expires-in", "3600")
        issued = json.loads(out)
        assert code == 0 and issued["key"].startswith("tdm-") and issued["expires_at"] > time.time()
        api = openai.OpenAI(base_url=f"{url}/v1", api_key=issued["key"], max_retries=0)
        assert [m.id for m in api.models.list().data] == ["tiny"]
        used = api.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage
        assert used is not None
        code, out, _ = run("keys", "list", "acme")
        assert code == 0 and issued["key"] not in out and json.loads(out)["data"][0]["id"] == issued["id"]
        code, out, _ = run("update", "acme", "--limit", "tokens_per_minute=none")
        assert code == 0 and json.loads(out)["limits"]["tokens_per_minute"] is None
        code, _, err = run("create", "acme")
        assert code == 1 and json.loads(err)["error"]["type"] == "invalid_request_error"
        assert run("keys", "revoke", "acme", issued["id"])[0] == 0
        with pytest.raises(openai.AuthenticationError):
            api.models.list()
        code, out, _ = run(
            "usage", "acme", "--hours", "1", "--bucket-width", "1h", "--group-by", "api_key_id"
        )
        results = [r for bucket in json.loads(out)["data"] for r in bucket["results"]]
        assert code == 0 and [(r["api_key_id"], r["output_tokens"]) for r in results] == [
            (issued["id"], used.completion_tokens)
        ]
    usage_log.close()


def test_requests_per_minute_and_max_tokens_limits(engine: object, store: FileObjectStore) -> None:
    """A tenant's requests_per_minute gives 429 `requests_per_minute_exceeded` with Retry-After
    once used up; its max_tokens refuses larger asks (400 naming max_tokens) and caps requests
    that ask for none; another tenant is unaffected."""
    import openai
    from fastapi.testclient import TestClient

    from tandem.deployments.engine_clients import LocalEngineClient
    from tandem.deployments.ingress import create_app
    from tandem.deployments.openai.server import OpenAIServer
    from tandem.platform.api_keys import parse_keys, parse_operator_keys
    from tandem.platform.tenancy import TenantRegistry

    directory = TenantDirectory(store)
    directory.create_tenant(
        parse_tenant_spec({"id": "acme", "limits": {"requests_per_minute": 2, "max_tokens": 3}})
    )
    _, secret = directory.create_key("acme")
    tenants = TenantRegistry(
        parse_keys("sk-other=globex"), operator_keys=parse_operator_keys("sk-op"), directory=directory
    )
    server = OpenAIServer(LocalEngineClient(engine), tenants, max_tokens_default=16)  # type: ignore[arg-type]
    with TestClient(create_app(server)) as http:
        api = openai.OpenAI(base_url="http://testserver/v1", api_key=secret, http_client=http, max_retries=0)
        other = openai.OpenAI(
            base_url="http://testserver/v1", api_key="sk-other", http_client=http, max_retries=0
        )
        with pytest.raises(openai.BadRequestError) as too_many:
            api.completions.create(model="tiny", prompt="Hello", max_tokens=4)
        assert too_many.value.body["param"] == "max_tokens"  # type: ignore[index]
        capped = api.completions.create(model="tiny", prompt="Hello", extra_body={"ignore_eos": True})
        assert capped.usage is not None and capped.usage.completion_tokens == 3  # the tenant's cap, not 16
        api.completions.create(model="tiny", prompt="Hello", max_tokens=1)  # the second this minute
        with pytest.raises(openai.RateLimitError) as refused:
            api.completions.create(model="tiny", prompt="Hello", max_tokens=1)
        assert refused.value.body["code"] == "requests_per_minute_exceeded"  # type: ignore[index]
        assert int(refused.value.response.headers["retry-after"]) >= 1
        for _ in range(3):
            other.completions.create(model="tiny", prompt="Hello", max_tokens=5)


def test_a_tenants_own_adapter_limits_override_the_servers(any_store: ObjectStore) -> None:
    """The directory's max_adapters / max_adapter_bytes for a tenant replace the server-wide
    per-tenant limits for that tenant only (a 400 naming the limit before anything is stored)."""
    from tandem.deployments.adapters import AdapterStore
    from tandem.platform.tenancy import TenantRegistry

    directory = TenantDirectory(any_store)
    directory.create_tenant(parse_tenant_spec({"id": "tiny-plan", "limits": {"max_adapters": 0}}))
    directory.create_tenant(parse_tenant_spec({"id": "byte-plan", "limits": {"max_adapter_bytes": 5}}))
    tenants = TenantRegistry({}, directory=directory)
    adapters = AdapterStore(any_store, "tiny", tenant_limits=tenants.adapter_limits_for)
    for tenant, param in (
        ("tiny-plan", "max_adapters_per_tenant"),
        ("byte-plan", "max_adapter_bytes_per_tenant"),
    ):
        with pytest.raises(InvalidRequestError) as refused:
            adapters.create(tenant, "bot", b"{}", b"0123456789", None, 8)  # type: ignore[arg-type]
        assert refused.value.param == param and refused.value.code == "adapter_limit_reached"
        assert adapters.list(tenant) == []
    with pytest.raises(Exception) as other:  # the server's limits pass; the (empty) adapter is invalid
        adapters.create("default-plan", "bot", b"{}", b"0123456789", None, 8)  # type: ignore[arg-type]
    assert getattr(other.value, "code", None) != "adapter_limit_reached"


def test_batch_tokens_queued_beyond_a_tenants_limit_are_refused(
    engine: object, store: FileObjectStore
) -> None:
    """max_batch_tokens_queued: a batch whose lines' max_tokens, with what the tenant's unfinished
    batches may still generate, pass the limit is a 429 naming the limit, and nothing is created;
    a smaller one, or another tenant's, is accepted."""
    import io
    import json

    import openai
    from fastapi.testclient import TestClient

    from tandem.batch.service import BatchService
    from tandem.deployments.engine_clients import LocalEngineClient
    from tandem.deployments.ingress import create_app
    from tandem.deployments.openai.server import OpenAIServer
    from tandem.platform.api_keys import parse_keys
    from tandem.platform.tenancy import TenantRegistry

    directory = TenantDirectory(store)
    directory.create_tenant(parse_tenant_spec({"id": "acme", "limits": {"max_batch_tokens_queued": 100}}))
    _, secret = directory.create_key("acme")
    tenants = TenantRegistry(parse_keys("sk-other=globex"), directory=directory)
    batches = BatchService(store, {"tiny"}, default_max_tokens=16, endpoints=ENDPOINTS)
    server = OpenAIServer(LocalEngineClient(engine), tenants, batches=batches)  # type: ignore[arg-type]

    def batch_file(api: openai.OpenAI, max_tokens: list[int | None]) -> str:
        lines = [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "tiny", "prompt": "Hi", **({} if m is None else {"max_tokens": m})}}
            for i, m in enumerate(max_tokens)
        ]  # fmt: skip
        data = io.BytesIO("".join(json.dumps(line) + "\n" for line in lines).encode())
        return api.files.create(file=("in.jsonl", data), purpose="batch").id

    with TestClient(create_app(server)) as http:
        api = openai.OpenAI(base_url="http://testserver/v1", api_key=secret, http_client=http, max_retries=0)
        first = api.batches.create(input_file_id=batch_file(api, [40, None]), endpoint="/v1/completions",
                                   completion_window="24h")  # fmt: skip  # 40 + 16 (the default) = 56 queued
        assert first.status == "in_progress"
        with pytest.raises(openai.RateLimitError) as refused:
            api.batches.create(input_file_id=batch_file(api, [30, 20]), endpoint="/v1/completions",
                               completion_window="24h")  # fmt: skip  # 56 + 50 > 100
        assert refused.value.body["code"] == "batch_tokens_queued_exceeded"  # type: ignore[index]
        assert "max_batch_tokens_queued" in refused.value.body["message"]  # type: ignore[index]
        assert refused.value.response.headers.get("retry-after")
        assert len(api.batches.list().data) == 1  # nothing half-created
        api.batches.create(input_file_id=batch_file(api, [30, 14]), endpoint="/v1/completions",
                           completion_window="24h")  # fmt: skip  # 56 + 44 = 100: fits
        other = openai.OpenAI(
            base_url="http://testserver/v1", api_key="sk-other", http_client=http, max_retries=0
        )
        other.batches.create(input_file_id=batch_file(other, [500]), endpoint="/v1/completions",
                             completion_window="24h")  # fmt: skip  # no limit for globex
