// Playground: a streamed chat against the tenant's models and adapters (/v1/models), through
// Chat Completions or the Responses API, with a response format and tools, and the same request
// as curl and Python to copy.
import { get, stream } from "../api.js";
import { alertBox, field, h, hide, replace, showError } from "../dom.js";

const PATHS = { chat: "/v1/chat/completions", responses: "/v1/responses" };

/** The Responses API's body for the form: instructions, input, text.format, flat function tools. */
function responsesBody(form) {
  const body = {
    model: form.model.value,
    input: form.message.value,
    stream: true,
    max_output_tokens: Number(form.max_tokens.value) || 128,
    temperature: Number(form.temperature.value),
  };
  if (form.system.value.trim()) body.instructions = form.system.value;
  if (form.format.value === "json_object") body.text = { format: { type: "json_object" } };
  if (form.format.value === "json_schema") {
    body.text = { format: { type: "json_schema", name: "answer", schema: JSON.parse(form.schema.value || "{}") } };
  }
  if (form.tools.value.trim()) {
    body.tools = JSON.parse(form.tools.value).map((tool) => (tool.function ? { type: "function", ...tool.function } : tool));
  }
  return body;
}

function requestBody(form) {
  if (form.api.value === "responses") return responsesBody(form);
  const body = {
    model: form.model.value,
    messages: [],
    stream: true,
    max_tokens: Number(form.max_tokens.value) || 128,
    temperature: Number(form.temperature.value),
  };
  if (form.system.value.trim()) body.messages.push({ role: "system", content: form.system.value });
  body.messages.push({ role: "user", content: form.message.value });
  if (form.format.value === "json_object") body.response_format = { type: "json_object" };
  if (form.format.value === "json_schema") {
    body.response_format = {
      type: "json_schema",
      json_schema: { name: "answer", schema: JSON.parse(form.schema.value || "{}") },
    };
  }
  if (form.tools.value.trim()) body.tools = JSON.parse(form.tools.value);
  return body;
}

function curlOf(path, body) {
  const json = JSON.stringify(body, null, 2).replaceAll("'", "'\\''");
  return `curl ${location.origin}${path} \\\n  -H "Authorization: Bearer $TANDEM_API_KEY" \\\n  -H "Content-Type: application/json" \\\n  -d '${json}'`;
}

/** A JSON value as a Python literal (JSON strings are valid Python strings). */
function py(value) {
  if (value === null || value === undefined) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (Array.isArray(value)) return `[${value.map(py).join(", ")}]`;
  if (typeof value === "object")
    return `{${Object.entries(value)
      .map(([k, v]) => `${JSON.stringify(k)}: ${py(v)}`)
      .join(", ")}}`;
  return JSON.stringify(value);
}

function pythonOf(body) {
  if (body.input !== undefined) return pythonOfResponses(body);
  const { model, messages, stream: _stream, ...rest } = body;
  const extra = Object.entries(rest)
    .map(([k, v]) => `    ${k}=${py(v)},`)
    .join("\n");
  return [
    "import os",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url="${location.origin}/v1", api_key=os.environ["TANDEM_API_KEY"])`,
    "stream = client.chat.completions.create(",
    `    model=${py(model)},`,
    `    messages=${py(messages)},`,
    "    stream=True,",
    extra,
    ")",
    "for chunk in stream:",
    "    if chunk.choices and chunk.choices[0].delta.content:",
    '        print(chunk.choices[0].delta.content, end="", flush=True)',
  ]
    .filter((line) => line !== "")
    .join("\n");
}

function pythonOfResponses(body) {
  const { stream: _stream, ...rest } = body;
  const args = Object.entries(rest)
    .map(([k, v]) => `    ${k}=${py(v)},`)
    .join("\n");
  return [
    "import os",
    "from openai import OpenAI",
    "",
    `client = OpenAI(base_url="${location.origin}/v1", api_key=os.environ["TANDEM_API_KEY"])`,
    "stream = client.responses.create(",
    args,
    "    stream=True,",
    ")",
    "for event in stream:",
    '    if event.type == "response.output_text.delta":',
    '        print(event.delta, end="", flush=True)',
  ].join("\n");
}

/** What one streamed message adds to the answer: its text, and tool calls by position. */
function chatUpdate(chunk) {
  const delta = chunk.choices && chunk.choices[0] ? chunk.choices[0].delta || {} : {};
  return {
    text: delta.content || "",
    calls: (delta.tool_calls || []).map((call) => ({
      index: call.index,
      name: (call.function && call.function.name) || "",
      arguments: (call.function && call.function.arguments) || "",
    })),
  };
}

function responsesUpdate(event) {
  if (event.type === "response.failed") throw new Error((event.response.error || {}).message || "the response failed");
  if (event.type === "response.output_text.delta") return { text: event.delta, calls: [] };
  if (event.type === "response.output_item.added" && event.item.type === "function_call") {
    return { text: "", calls: [{ index: event.output_index, name: event.item.name, arguments: "" }] };
  }
  if (event.type === "response.function_call_arguments.delta") {
    return { text: "", calls: [{ index: event.output_index, name: "", arguments: event.delta }] };
  }
  return { text: "", calls: [] };
}

export function render(main) {
  const box = alertBox();
  const model = h("select", { name: "model", required: true });
  const api = h(
    "select",
    { name: "api" },
    h("option", { value: "chat" }, "Chat Completions (/v1/chat/completions)"),
    h("option", { value: "responses" }, "Responses (/v1/responses)"),
  );
  const system = h("textarea", { name: "system", rows: 2 });
  const message = h("textarea", { name: "message", rows: 3, required: true }, "Say hello in one short sentence.");
  const format = h(
    "select",
    { name: "format" },
    h("option", { value: "text" }, "text"),
    h("option", { value: "json_object" }, "json_object"),
    h("option", { value: "json_schema" }, "json_schema"),
  );
  const schema = h("textarea", {
    name: "schema",
    rows: 3,
    placeholder: '{"type": "object", "properties": {"answer": {"type": "string"}}}',
  });
  const tools = h("textarea", {
    name: "tools",
    rows: 3,
    placeholder: '[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]',
  });
  const maxTokens = h("input", { type: "number", name: "max_tokens", min: 1, max: 4096, value: 64 });
  const temperature = h("input", { type: "number", name: "temperature", min: 0, max: 2, step: 0.1, value: 0.7 });
  const send = h("button", { type: "submit", class: "primary" }, "Send");
  const stop = h("button", { type: "button", disabled: true }, "Stop");
  const answer = h("pre", { class: "answer", "aria-live": "polite", dataset: { chunks: 0 } });
  const toolCalls = h("pre", { class: "tool-calls", hidden: true });
  const curl = h("pre", { class: "code", tabindex: 0, role: "region", "aria-label": "The request as curl" });
  const python = h("pre", { class: "code", tabindex: 0, role: "region", "aria-label": "The request in Python" });
  const form = h(
    "form",
    { class: "card", "aria-label": "Chat request" },
    field("Model", model, 'Your adapters are listed as "<base>:<adapter>".'),
    field("API", api),
    field("System message", system),
    field("Message", message),
    h(
      "div",
      { class: "row" },
      field("Max tokens", maxTokens),
      field("Temperature", temperature),
      field("Response format", format),
    ),
    field("JSON schema (response format json_schema)", schema),
    field("Tools (a JSON array)", tools),
    box,
    h("div", { class: "row" }, send, stop),
  );
  let controller = null;

  function showCode() {
    try {
      const body = requestBody(form);
      replace(curl, curlOf(PATHS[form.api.value], body));
      replace(python, pythonOf(body));
    } catch {
      // half-typed JSON: the code panes keep the last valid request
    }
  }

  form.addEventListener("input", showCode);
  form.addEventListener("change", showCode);
  stop.addEventListener("click", () => controller && controller.abort());
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    hide(box);
    let body;
    try {
      body = requestBody(form);
    } catch (error) {
      showError(box, {
        message: `not valid JSON: ${error.message}`,
        param: error.message.includes("schema") ? "schema" : "tools",
      });
      return;
    }
    replace(answer);
    answer.dataset.chunks = "0";
    answer.dataset.done = "false";
    toolCalls.hidden = true;
    const calls = [];
    controller = new AbortController();
    send.disabled = true;
    stop.disabled = false;
    try {
      const update = form.api.value === "responses" ? responsesUpdate : chatUpdate;
      await stream(
        PATHS[form.api.value],
        body,
        (message) => {
          const { text, calls: added } = update(message);
          if (text) {
            answer.append(text);
            answer.dataset.chunks = String(Number(answer.dataset.chunks) + 1);
          }
          for (const call of added) {
            const slot = (calls[call.index] ||= { name: "", arguments: "" });
            slot.name += call.name;
            slot.arguments += call.arguments;
            toolCalls.hidden = false;
            replace(
              toolCalls,
              calls
                .filter(Boolean)
                .map((c) => `${c.name}(${c.arguments})`)
                .join("\n"),
            );
          }
        },
        controller.signal,
      );
      answer.dataset.done = "true";
    } catch (error) {
      if (error.name !== "AbortError") showError(box, error);
    } finally {
      send.disabled = false;
      stop.disabled = true;
      controller = null;
    }
  });

  main.append(
    h(
      "div",
      { class: "columns" },
      form,
      h(
        "section",
        { class: "card", "aria-label": "Answer" },
        h("h2", {}, "Answer"),
        answer,
        toolCalls,
        h("h2", {}, "As curl"),
        curl,
        h("h2", {}, "As Python"),
        python,
      ),
    ),
  );
  get("/v1/models")
    .then((models) => {
      replace(
        model,
        models.data.map((m) => h("option", { value: m.id }, m.id)),
      );
      showCode();
    })
    .catch((error) => showError(box, error));
}
