"""What the fuzzer must know that JSON Schema cannot say, and two of its own slips.

1. Constraints between fields of one request: the OpenAPI document states them in
   words (a `description`), but JSON Schema has no keyword for them. A generated
   request that breaks one is dropped before it is sent (`filter_body`). One rule
   depends on the server's data: a `Stockd-Consistency-Token` past the writer's
   position is refused, and on the fuzzed server (SQLite) that is any but 0/0.
2. schemathesis's coverage phase builds boundary values outside the hypothesis
   strategies, so the filter above does not see them, and now and then it labels a
   value "schema-valid" that is not (a header past its `maxLength`). A "schema-valid
   request rejected" failure (ST202) is kept only when the request really is valid:
   `filter_failure` validates it again against the document and the rules of 1.
3. schemathesis 4.32 crashes on a string that starts with "http://" but that
   Python's urlsplit refuses (see the end of this file).

Nothing else is filtered: every single-field constraint is in the document itself,
and every other check's failure stands.
"""

import schemathesis


def _repeats(items, key):
    import json

    seen = set()
    for item in items:
        if not isinstance(item, dict):
            return False
        value = json.dumps(key(item), sort_keys=True)
        if value in seen:
            return True
        seen.add(value)
    return False


def _line_key(line):
    # A line without a warehouse is a line of the default warehouse.
    return (line.get("sku"), line.get("warehouse") or "default")


def _keeps_the_stated_rules(path, body, generating=False):
    """Whether a body keeps the rules its operation's description states in words.

    A body of the wrong shape (a negative case: a list where an object goes, a number
    for a list) is the schema's business, not these rules': it passes. `generating`
    leaves out the rules too narrow to filter drawn bodies on (hypothesis gives up on
    an operation when it filters out most of them): those are judged on a failure.
    """
    try:
        return _rules_hold(path, body, generating)
    except (TypeError, AttributeError, ValueError):
        return True


def _rules_hold(path, body, generating):
    if not isinstance(body, dict):
        return True
    # "each (sku, warehouse) once"
    if path in ("/v1/reservations", "/v1/orders") and isinstance(body.get("lines"), list):
        return not _repeats(body["lines"], _line_key)
    # "each SKU code once"
    if path == "/v1/products" and isinstance(body.get("skus"), list):
        return not _repeats(body["skus"], lambda sku: sku.get("sku"))
    if path == "/v1/admin/shelf":
        return _shelf_rules_hold(body)
    if path == "/v1/admin/campaigns":
        return _campaign_rules_hold(body, generating)
    return True


def _moment(value):
    import datetime

    moment = datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00").replace("z", "+00:00"))
    if moment.tzinfo is None:
        raise ValueError("no offset")
    return moment


def _campaign_rules_hold(body, generating):
    import datetime

    # "buckets … no more than the units"
    # (5.0 is the number 5 to stockd, as to JSON: compare numbers, not Python types)
    buckets, quantity = body.get("buckets"), body.get("quantity")
    numbers = all(
        isinstance(value, (int, float)) and not isinstance(value, bool) for value in (buckets, quantity)
    )
    if numbers and buckets > quantity:
        return False
    # "ends_at: after starts_at, in the future, and at most 366 days ahead" (a minute of
    # slack for the clock at each end). Drawn date-times fall within that year too
    # rarely to filter on it: it only decides whether a refusal was right.
    try:
        starts_at, ends_at = _moment(body.get("starts_at")), _moment(body.get("ends_at"))
    except (TypeError, ValueError):
        return True  # not date-times at all: the schema's business
    now = datetime.datetime.now(datetime.timezone.utc)
    within_a_year = ends_at < now + datetime.timedelta(days=366) - datetime.timedelta(minutes=1)
    return (
        ends_at > starts_at
        and ends_at > now + datetime.timedelta(minutes=1)
        and (generating or within_a_year)
    )


def _shelf_rules_hold(body):
    targets = [body.get(name) for name in ("product_ids", "sku_ids", "category", "supplier")]
    # "name the targets"
    if not any(target not in (None, []) for target in targets):
        return False
    # "at most 1,000 product_ids and sku_ids together"
    listed = sum(len(body.get(name) or []) for name in ("product_ids", "sku_ids"))
    if listed > 1000:
        return False
    # "scheduled_at with on_at and off_at, and only with them: a minute in the future,
    # within a year"
    scheduled = body.get("operation") in ("on_at", "off_at")
    at = body.get("scheduled_at")
    if scheduled != (at is not None):
        return False
    # "repeat with on_at and off_at only"
    if body.get("repeat") is not None and not scheduled:
        return False
    if scheduled:
        import datetime

        try:
            moment = datetime.datetime.fromisoformat(str(at).replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            return True  # not a date-time at all: the schema's business
        if moment.tzinfo is None:
            return True
        now = datetime.datetime.now(datetime.timezone.utc)
        minute = moment.replace(second=0, microsecond=0)
        # A minute of slack at each end: the request travels while the clock moves.
        if minute <= now + datetime.timedelta(minutes=1):
            return False
        if minute >= now + datetime.timedelta(days=366) - datetime.timedelta(minutes=1):
            return False
    return True


@schemathesis.hook
def filter_body(context, body):
    operation = context.operation
    if operation is None:
        return True
    return _keeps_the_stated_rules(operation.path, body, generating=True)


@schemathesis.hook
def map_case(context, case):
    """One Idempotency-Key per distinct request, as a real client uses them.

    The fuzzer draws short keys ("0", "a"), so it would send one key with many different
    requests, and stockd refuses all but the first (422 idempotency_key_reused, by
    design: tested in crates/acceptance/tests/idempotency.rs). Suffixing the drawn key
    with a digest of the request keeps a repeated request under its key (a replay) and
    lets every other request reach the logic behind the key check.

    A step of a stateful scenario is a new intent, not a retry: the same `PATCH` sent
    before and after a `DELETE` would otherwise share a key, and the second would
    replay the first answer (200, `Idempotent-Replayed: true`), which the use-after-free
    check reads as the deleted resource still being there. Those steps get a key of
    their own.
    """
    headers = case.headers or {}
    name = next((header for header in headers if header.lower() == "idempotency-key"), None)
    if name is None or not isinstance(headers[name], str):
        return case
    import hashlib
    import json

    request = json.dumps(
        [case.operation.method, case.operation.path, case.path_parameters, case.query, case.body],
        sort_keys=True,
        default=repr,
    )
    phase = getattr(getattr(getattr(case, "meta", None), "phase", None), "name", None)
    if str(phase) == "stateful":
        import uuid

        request += uuid.uuid4().hex
    suffix = hashlib.sha256(request.encode()).hexdigest()[:16]
    key = f"{headers[name][:200]}-{suffix}"
    # Only a key that was valid stays valid: a drawn key that breaks the header's
    # pattern (a negative case) is sent as drawn.
    if all(0x21 <= ord(character) <= 0x7E for character in headers[name]) and headers[name]:
        headers[name] = key
    return case


def _matches(instance, schema, document):
    from jsonschema import Draft202012Validator

    root = dict(schema)
    root["components"] = document.get("components", {})
    validator = Draft202012Validator(root, format_checker=Draft202012Validator.FORMAT_CHECKER)
    return validator.is_valid(instance)


def _request_is_valid(case):
    reason = _why_invalid(case)
    if reason is not None:
        import os
        import sys

        if os.environ.get("STOCKD_SCHEMATHESIS_EXPLAIN"):
            print(f"dropped ST202 of {case.operation.label}: {reason}", file=sys.stderr)
        return False
    return True


def _why_invalid(case):
    operation = case.operation
    document = operation.schema.raw_schema
    definition = operation.definition.raw
    sent = {
        "header": {name.lower(): value for name, value in (case.headers or {}).items()},
        "query": case.query or {},
        "path": case.path_parameters or {},
    }
    for parameter in definition.get("parameters", []):
        place, name = parameter.get("in"), parameter.get("name", "")
        values = sent.get(place, {})
        key = name.lower() if place == "header" else name
        if key not in values:
            if parameter.get("required"):
                return f"required {place} parameter {name} missing"
            continue
        value = values[key]
        schema = parameter.get("schema", {})
        if place in ("header", "query", "path") and isinstance(value, str):
            # Parameters travel as text; an integer parameter is valid as its digits.
            candidates = [value]
            try:
                candidates.append(int(value))
            except ValueError:
                pass
            if not any(_matches(candidate, schema, document) for candidate in candidates):
                return f"{place} parameter {name}={value!r} breaks its schema"
        elif not _matches(value, schema, document):
            return f"{place} parameter {name}={value!r} breaks its schema"
    body = definition.get("requestBody")
    if body is not None and case.body is not None and not isinstance(case.body, bytes):
        schema = body.get("content", {}).get("application/json", {}).get("schema")
        if schema is not None and not _matches(case.body, schema, document):
            return f"body breaks its schema: {str(case.body)[:200]}"
    if not _keeps_the_stated_rules(operation.path, case.body):
        return "body breaks a rule the description states"
    # "A token past the writer's position … is refused": the fuzzed server runs on
    # SQLite, whose every write answers 0/0.
    token = sent["header"].get("stockd-consistency-token")
    if isinstance(token, str) and "/" in token:
        high, _, low = token.partition("/")
        try:
            if int(high, 16) or int(low, 16):
                return f"consistency token {token!r} is past the writer's position 0/0"
        except ValueError:
            pass
    return None


@schemathesis.hook
def filter_failure(context, failure, case, response):
    if getattr(failure, "code", None) != "ST202":
        return True
    return _request_is_valid(case)


# schemathesis 4.32 looks for links in every string of a 2xx JSON answer and crashes on
# one that starts with "http://" but that Python's urlsplit refuses ("http://[", which
# a product title or image URL may be). Such a string is not a link: treat it as none.
def _tolerate_unsplittable_urls():
    from schemathesis.engine import observations

    original = observations._same_origin_path

    def same_origin_path(value, origin):
        try:
            return original(value, origin)
        except ValueError:
            return None

    observations._same_origin_path = same_origin_path


_tolerate_unsplittable_urls()
