"""The stored responses' routes of OpenAI's Responses API: `GET` and `DELETE
/v1/responses/{id}` and `GET /v1/responses/{id}/input_items`, tenant-scoped (another tenant's
id answers 404 as one never stored). `POST /v1/responses` is in the endpoint table."""

from collections.abc import Callable

from fastapi import APIRouter, Request

from tandem.deployments.openai.response_api import ResponsesAPI
from tandem.deployments.openai.server import OpenAIServer
from tandem.platform.errors import InvalidRequestError


def _page_params(request: Request) -> tuple[int, str, str | None]:
    """`limit` (1-100, default 20), `order` (asc or desc, default desc) and `after`."""
    raw_limit = request.query_params.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise InvalidRequestError("limit must be an integer from 1 to 100", param="limit")
    order = request.query_params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError("order must be 'asc' or 'desc'", param="order")
    return int(raw_limit), order, request.query_params.get("after")


def response_router(authenticated: Callable[[Request], tuple[OpenAIServer, str]]) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict[str, object]:
        server, tenant = authenticated(request)
        return await ResponsesAPI(server).get(tenant, response_id)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, object]:
        server, tenant = authenticated(request)
        return await ResponsesAPI(server).delete(tenant, response_id)

    @router.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request) -> dict[str, object]:
        server, tenant = authenticated(request)
        limit, order, after = _page_params(request)
        return await ResponsesAPI(server).input_items(
            tenant, response_id, limit=limit, order=order, after=after
        )

    return router
