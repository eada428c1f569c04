"""The OpenAI protocol: request models (`requests`), response bodies (`responses`), error bodies
(`errors`), the endpoint table every reader shares (`endpoints`: routes, batch validation, batch
execution, the OpenAPI document), the request path (`server`, `scope`, `bodies`, `streaming`),
tenant limits (`limiter`), tool calls and output constraints (`structured_output`), and the ASGI
routes in front of FastAPI (`routes`)."""
