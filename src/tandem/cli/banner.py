"""What `tandem serve` prepares and prints for a newcomer: the dev tenant's key, the banner (where,
which keys, a request to try) and the served model's precision and generation defaults."""

from __future__ import annotations

import contextlib

DEV_TENANT, DEV_KEY_NAME = "dev", "tandem serve (this run)"


def dev_tenant_key(object_store: str) -> str:
    """A key of the tenant "dev" in the tenant directory (created if new), so that what `make
    run` prints is a tenant's key like any other (`tandem tenants show dev`, the console's key
    page); the keys earlier runs issued under the same name are revoked."""
    from tandem.platform.errors import ConflictError
    from tandem.platform.store_guard import open_object_store
    from tandem.platform.tenant_directory import TenantDirectory, TenantSpec

    directory = TenantDirectory(open_object_store(object_store))
    with contextlib.suppress(ConflictError):
        directory.create_tenant(TenantSpec(id=DEV_TENANT))
    for old in directory.list_keys(DEV_TENANT):
        if old.name == DEV_KEY_NAME:
            directory.revoke_key(DEV_TENANT, old.id)
    return directory.create_key(DEV_TENANT, name=DEV_KEY_NAME)[1]


def model_line(base: str, served_name: str, key: str | None) -> str:
    """The precision the replicas run and the generation defaults they apply (`/v1/models`)."""
    import httpx

    if key is None:
        return f"[tandem] model {served_name}: GET {base}/v1/models says its precision and defaults"
    try:
        card = httpx.get(
            f"{base}/v1/models/{served_name}", headers={"Authorization": f"Bearer {key}"}, timeout=60
        ).json()
        info = card["tandem"]
    except (httpx.HTTPError, KeyError, ValueError) as exc:
        return f"[tandem] model {served_name}: precision not known ({type(exc).__name__})"
    defaults = ", ".join(f"{k}={v}" for k, v in info["generation_defaults"].items()) or "none (temperature 1)"
    stored = f" (file: {', '.join(info['quant_types'])})" if info.get("quant_types") else ""
    return (
        f"[tandem] model {served_name}: {info['dtype']} compute, {info['weight_dtype']} weights{stored}, KV "
        f"{info['kv_cache_dtype']}; generation defaults: {defaults}\n[tandem] why: {info['precision_reason']}"
    )


def banner(model: str, base: str, dev_key: str | None, dev_operator_key: str | None, timing: str) -> str:
    """What a newcomer needs, after Ray's start-up lines: where, which keys, a request to try."""
    key = dev_key or "$YOUR_KEY"
    lines = [f"serving {model} at {base}/v1 ({timing})"]
    if dev_key:
        lines.append(f"API key of tenant '{DEV_TENANT}' (this run only): {dev_key}")
    if dev_operator_key:
        lines.append(f"operator key (tenants, usage, /metrics): {dev_operator_key}")
        lines.append(f"  TANDEM_OPERATOR_KEY={dev_operator_key} tandem tenants create acme")
    lines.append("try:")
    lines.append(
        f"  curl {base}/v1/chat/completions -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' "
        f"""-d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'"""
    )
    lines.append("stop: Ctrl-C (requests in flight finish first)")
    rule = "=" * 72
    return "\n".join([rule, *(f"[tandem] {line}" for line in lines), rule])
