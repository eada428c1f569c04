"""Whether a JSON schema admits a finite value, before a grammar is built from it (no torch).

A schema whose `$ref`s loop with no way out (A -> B -> A), or that requires itself (an object
whose required property is the object again, an array of at least one of itself), admits no
finite JSON value. A grammar built from it either allows nothing (the request "succeeds" with an
empty answer) or lets the model write forever until the parser gives up mid-answer. Such schemas
are refused when the request arrives (a 400 naming the field), in well under a second.

The check is a least fixpoint over the schema's local `$ref` targets: every target starts as
"no finite value", and a target becomes satisfiable once its body is satisfiable given the
targets known to be so; what is still unsatisfiable when nothing changes never will be. The
rules follow JSON Schema: an object needs its required properties (a property not under
`properties` takes `additionalProperties`), an array its first `minItems` items, `allOf` every
branch, `anyOf`/`oneOf` one, `type` lists one of their types; `enum` needs a value; `false` has
none. Anything else (strings, numbers, `not`, conditionals) counts as satisfiable: the check
never refuses a schema JSON Schema says has a value, and leaves the rest to the grammar library.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

_MAX_TARGETS = 10_000  # local $ref targets examined (a schema from one request: far below)


def finite_value_problem(schema: object) -> str | None:
    """Why `schema` admits no finite JSON value, or None when it admits one."""
    try:
        return _problem(schema)
    except RecursionError:
        return "the schema is nested too deeply"


def _problem(schema: object) -> str | None:
    targets = _ref_targets(schema)
    satisfiable = dict.fromkeys(targets, False)
    changed = True
    while changed:
        changed = False
        for pointer, node in targets.items():
            if not satisfiable[pointer] and _satisfiable(node, satisfiable):
                satisfiable[pointer] = changed = True
    if _satisfiable(schema, satisfiable):
        return None
    stuck = [pointer for pointer, ok in satisfiable.items() if not ok]
    if stuck:
        return (
            "the schema admits no finite value: its references "
            + ", ".join(repr(p) for p in stuck[:5])
            + " never end (a $ref cycle, or a required property or item that contains itself); "
            "give the recursion a way out (make it optional, or an anyOf with a non-recursive branch)"
        )
    return "the schema admits no value (a required part of it is `false`, an empty enum, or an empty anyOf)"


def _satisfiable(node: object, satisfiable: dict[str, bool]) -> bool:
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and not satisfiable.get(ref, True):
        return False
    enum = node.get("enum")
    if isinstance(enum, list) and not enum:
        return False
    branches = node.get("allOf")
    if isinstance(branches, list) and not all(_satisfiable(b, satisfiable) for b in branches):
        return False
    for keyword in ("anyOf", "oneOf"):
        branches = node.get(keyword)
        if isinstance(branches, list) and not any(_satisfiable(b, satisfiable) for b in branches):
            return False
    if "const" in node or isinstance(enum, list):
        return True  # a listed value is finite
    kinds = node.get("type")
    if kinds is None:
        return True  # any type: a non-object, non-array value will do
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list):
        return True
    return any(_kind_satisfiable(kind, node, satisfiable) for kind in kinds)


def _kind_satisfiable(kind: object, node: dict[str, object], satisfiable: dict[str, bool]) -> bool:
    if kind == "object":
        properties = node.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        extra = node.get("additionalProperties", True)
        required = node.get("required")
        for name in required if isinstance(required, list) else []:
            if not _satisfiable(properties.get(name, extra), satisfiable):
                return False
        return True
    if kind == "array":
        min_items = node.get("minItems", 0)
        if not isinstance(min_items, int) or min_items <= 0:
            return True
        prefix = node.get("prefixItems")
        prefix = prefix if isinstance(prefix, list) else []
        items = node.get("items", True)
        needed = prefix[:min_items] + ([items] if min_items > len(prefix) else [])
        return all(_satisfiable(item, satisfiable) for item in needed)
    return True


def _ref_targets(schema: object) -> dict[str, object]:
    """Every local `$ref` reachable from the schema (`#`, `#/$defs/A`, ...) -> the node it names
    (unresolvable ones are left out: the grammar library reports them)."""
    targets: dict[str, Any] = {}
    pending: list[Any] = [schema]
    while pending and len(targets) < _MAX_TARGETS:
        node = pending.pop()
        if isinstance(node, list):
            pending.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#") and ref not in targets:
            target = _resolve(schema, ref)
            if target is not None:
                targets[ref] = target
                pending.append(target)
        pending.extend(
            value for key, value in node.items() if key not in ("enum", "const", "default", "examples")
        )
    return targets


def _resolve(schema: object, ref: str) -> object:
    """The node a local JSON pointer (`#/a/b~1c`) names, or None."""
    node = schema
    path = ref[1:]
    if not path:
        return node
    if not path.startswith("/"):
        return None  # an anchor (#name): not resolved here
    for part in path[1:].split("/"):
        key = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node
