"""`tandem tenants ...`: the operator API for tenants and keys (`/v1/admin/tenants`) from a shell.

Reads `--base-url` / `$TANDEM_BASE_URL` (default http://127.0.0.1:8000/v1) and `--operator-key` /
`$TANDEM_OPERATOR_KEY`. Prints the server's JSON answer; an error answer goes to stderr (OpenAI's
error shape) and exits 1.

    tandem tenants create acme --weight 2 --limit tokens_per_minute=20000
    tandem tenants update acme --limit max_concurrent_requests=8 --limit tokens_per_minute=none
    tandem tenants keys create acme --name prod          # the secret is printed only now
    tandem tenants keys revoke acme key_...
    tandem tenants usage acme --hours 24 --bucket-width 1h --group-by model   # the usage API
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any
from urllib.parse import urlencode


def add_parser(sub: Any) -> None:
    tenants = sub.add_parser("tenants", help="tenants and their API keys (operator API)")
    tenants.set_defaults(run=run)
    tenants.add_argument("--base-url", default=os.environ.get("TANDEM_BASE_URL", "http://127.0.0.1:8000/v1"))
    tenants.add_argument("--operator-key", default=os.environ.get("TANDEM_OPERATOR_KEY"))
    cmds = tenants.add_subparsers(dest="tenants_command", required=True)
    create = cmds.add_parser("create", help="create a tenant")
    create.add_argument("tenant_id")
    for cmd in (create, cmds.add_parser("update", help="change a tenant's limits or weight")):
        if cmd is not create:
            cmd.add_argument("tenant_id")
        cmd.add_argument("--weight", type=float, default=None, help="fair-share weight (> 0)")
        cmd.add_argument(
            "--limit", action="append", default=[], metavar="NAME=VALUE",
            help="a limit (max_concurrent_requests, tokens_per_minute, ...); VALUE 'none' clears it (repeatable)",
        )  # fmt: skip
    cmds.add_parser("list", help="list tenants")
    for name in ("show", "delete"):
        cmds.add_parser(name, help=f"{name} a tenant").add_argument("tenant_id")
    keys = cmds.add_parser("keys", help="a tenant's API keys").add_subparsers(
        dest="keys_command", required=True
    )
    key_create = keys.add_parser("create", help="issue a key (its secret is shown only once)")
    key_create.add_argument("tenant_id")
    key_create.add_argument("--name", default=None)
    key_create.add_argument("--expires-in", type=int, default=None, help="seconds until it expires")
    keys.add_parser("list", help="list a tenant's keys (never their secrets)").add_argument("tenant_id")
    revoke = keys.add_parser("revoke", help="revoke a key")
    revoke.add_argument("tenant_id")
    revoke.add_argument("key_id")
    usage = cmds.add_parser("usage", help="metered usage (GET /v1/organization/usage/completions)")
    usage.add_argument("tenant_id", nargs="?", default=None, help="one tenant (default: every tenant)")
    usage.add_argument("--hours", type=float, default=24.0, help="from this many hours ago until now")
    usage.add_argument("--bucket-width", choices=("1m", "1h", "1d"), default="1d")
    usage.add_argument(
        "--group-by", action="append", default=[], help="project_id, api_key_id, model or batch (repeatable)"
    )


def _limits(pairs: list[str]) -> dict[str, int | None]:
    limits: dict[str, int | None] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise SystemExit(f"--limit {pair!r}: use NAME=VALUE")
        limits[name] = None if value.lower() == "none" else int(value)
    return limits


def request_for(args: argparse.Namespace) -> tuple[str, str, dict[str, object] | None]:
    """(method, path under the base URL, JSON body) for the parsed command (query in the path)."""
    method, path, body = _request_for(args)
    return method, path if path.startswith("/organization/") else "/admin" + path, body


def _usage_path(args: argparse.Namespace) -> str:
    params: list[tuple[str, str | int]] = [
        ("start_time", int(time.time() - args.hours * 3600)),
        ("bucket_width", args.bucket_width),
        ("limit", {"1m": 1440, "1h": 168, "1d": 31}[args.bucket_width]),
    ]
    params += [("group_by", name) for name in args.group_by]
    if args.tenant_id:
        params.append(("project_ids", args.tenant_id))
    return "/organization/usage/completions?" + urlencode(params)


def _request_for(args: argparse.Namespace) -> tuple[str, str, dict[str, object] | None]:
    tenant = getattr(args, "tenant_id", None)
    command = args.tenants_command
    if command == "usage":
        return "GET", _usage_path(args), None
    if command == "create":
        body: dict[str, Any] = {"id": tenant}
        if args.limit:
            body["limits"] = _limits(args.limit)
        if args.weight is not None:
            body["weight"] = args.weight
        return "POST", "/tenants", body
    if command == "update":
        patch: dict[str, Any] = {}
        if args.limit:
            patch["limits"] = _limits(args.limit)
        if args.weight is not None:
            patch["weight"] = args.weight
        return "PATCH", f"/tenants/{tenant}", patch
    if command == "list":
        return "GET", "/tenants", None
    if command == "show":
        return "GET", f"/tenants/{tenant}", None
    if command == "delete":
        return "DELETE", f"/tenants/{tenant}", None
    if args.keys_command == "create":
        key_body: dict[str, Any] = {"name": args.name}
        if args.expires_in is not None:
            key_body["expires_at"] = int(time.time()) + args.expires_in
        return "POST", f"/tenants/{tenant}/keys", key_body
    if args.keys_command == "list":
        return "GET", f"/tenants/{tenant}/keys", None
    return "DELETE", f"/tenants/{tenant}/keys/{args.key_id}", None


def run(args: argparse.Namespace) -> int:
    import httpx

    if not args.operator_key:
        print("an operator key is needed: --operator-key or $TANDEM_OPERATOR_KEY", file=sys.stderr)
        return 2
    method, path, body = request_for(args)
    reply = httpx.request(
        method, args.base_url.rstrip("/") + path, json=body,
        headers={"Authorization": f"Bearer {args.operator_key}"}, timeout=30,
    )  # fmt: skip
    text = json.dumps(reply.json(), indent=2) if reply.content else ""
    if reply.status_code >= 400:
        print(text, file=sys.stderr)
        return 1
    print(text)
    return 0
