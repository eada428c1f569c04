// The console is a client of the API: every call below is a public `/v1` route (or the console's
// session route), authorised by the session cookie, which the server honours only together with
// the `X-Tandem-Console` header (see src/tandem/deployments/console_routes.py).

export class ApiError extends Error {
  constructor(status, message, param, code) {
    super(message);
    this.status = status;
    this.param = param;
    this.code = code;
  }
}

const HEADERS = { "X-Tandem-Console": "1" };

async function errorOf(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON: the status says enough
  }
  const error = body && body.error ? body.error : {};
  return new ApiError(response.status, error.message || `${response.status} ${response.statusText}`, error.param, error.code);
}

/** fetch with the console's header; JSON bodies as objects, FormData as is. */
export async function call(method, path, body, { raw = false } = {}) {
  const init = { method, headers: { ...HEADERS }, credentials: "same-origin" };
  if (body instanceof FormData) init.body = body;
  else if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  if (!response.ok) throw await errorOf(response);
  if (raw) return response;
  return response.json();
}

export const get = (path) => call("GET", path);
export const post = (path, body) => call("POST", path, body);
export const del = (path) => call("DELETE", path);

/** Query string from an object; arrays repeat the parameter. */
export function query(params) {
  const search = new URLSearchParams();
  for (const [name, value] of Object.entries(params)) {
    if (value === undefined || value === null) continue;
    for (const item of Array.isArray(value) ? value : [value]) search.append(name, String(item));
  }
  return search.toString();
}

/** Server-sent events of a streamed completion: calls onEvent(parsed chunk) per `data:` line. */
export async function stream(path, body, onEvent, signal) {
  const response = await fetch(path, {
    method: "POST",
    headers: { ...HEADERS, "Content-Type": "application/json", Accept: "text/event-stream" },
    credentials: "same-origin",
    body: JSON.stringify(body),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(response.status, chunk.error.message, chunk.error.param, chunk.error.code);
        onEvent(chunk);
      }
    }
  }
}
