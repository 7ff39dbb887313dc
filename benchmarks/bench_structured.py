"""Structured outputs and tool calls on the real Qwen2.5-Coder pair, beside llama.cpp's ``llama-server``
on the same GGUF, through the official ``openai`` client.

* **JSON schemas**: 52 schemas written here (:func:`schemas`), of varied shape: nested objects, arrays
  with bounds, enums, patterns, ``anyOf``, ``$ref``, numbers with bounds, optional keys, and
  *key-heavy* ones (ten or more required keys, whose names the grammar forces).  Per mode: how many
  outputs finished, how many of those validate (``jsonschema``), tokens/s and acceptance.
* **Function calling**: BFCL's ``simple_python``, ``multiple`` and ``parallel`` cases (the data and
  the AST checker come from the ``bfcl-eval`` wheel on PyPI, unpacked without its dependencies):
  accuracy by BFCL's checker, and the rate of responses whose calls parse.

Modes (greedy throughout, one request at a time; tokens/s is decode speed, (tokens - 1) / (end - first
delta), so the prompt's prefill does not count):

* ``ours spec off`` / ``ours spec on``: our server with the default preset, speculation off / on per
  request (for tools, with ``tool_choice`` ``auto`` and ``required``);
* ``ours spec on, no forced``: a second server with ``--grammar-forced 0`` (no forced-token drafts);
* ``ours free spec on``: the JSON prompts without ``response_format`` (other outputs: what users see);
* ``ours any-text grammar spec on``: the same, under a grammar that allows every text, so the outputs
  are the free ones and the difference is the cost of the grammar machinery alone;
* ``llama``: ``llama-server --jinja`` on the target GGUF (``bench_peer.py`` builds it).

Both our servers run with ``--no-prefix-cache``, and llama-server's requests send ``cache_prompt:
false``, since every mode sends the same prompts.

    .venv/bin/python benchmarks/bench_structured.py                       # everything (about 40 min on 2 cores)
    .venv/bin/python benchmarks/bench_structured.py --schemas 12 --bfcl 4 --no-llama   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import types
import zipfile
from collections import defaultdict
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_peer import DEFAULT_DRAFT, DEFAULT_TARGET, Server, build_llama_server, gguf_path  # noqa: E402
from benchmarks.bench_serving import free_port  # noqa: E402
from benchmarks.harness import machine, print_table, write_json  # noqa: E402

BFCL_VERSION = "2026.3.23"
CATEGORIES = ("simple_python", "multiple", "parallel")
SYSTEM = "You are a helpful assistant."
ANY_TEXT = r"[\s\S]*"  # a grammar that allows every text: the free outputs again, through the mask machinery


# ------------------------------------------------------------------------------------------ schemas
def _obj(props: dict, required: Optional[list] = None, **extra) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
KEY_HEAVY_TOPICS = {
    "server configuration": ["hostname", "port_number", "max_connections", "enable_tls", "certificate_path",
                             "log_level", "worker_threads", "request_timeout_seconds", "admin_email",
                             "maintenance_mode", "region_identifier", "health_check_path"],
    "employee record": ["employee_id", "first_name", "last_name", "department_name", "job_title",
                        "start_date", "manager_employee_id", "office_location", "is_full_time",
                        "annual_salary", "emergency_contact_name", "emergency_contact_phone"],
    "flight booking": ["booking_reference", "passenger_full_name", "departure_airport_code",
                       "arrival_airport_code", "departure_date", "seat_number", "cabin_class",
                       "checked_bags_count", "meal_preference", "frequent_flyer_number", "is_refundable",
                       "total_price_usd"],
    "recipe card": ["recipe_name", "cuisine_type", "preparation_minutes", "cooking_minutes", "servings_count",
                    "difficulty_level", "main_ingredient", "is_vegetarian", "calories_per_serving",
                    "author_name", "oven_temperature_celsius", "storage_instructions"],
    "github repository": ["repository_name", "owner_login", "primary_language", "star_count", "fork_count",
                          "open_issue_count", "default_branch_name", "license_identifier", "is_archived",
                          "created_at_date", "homepage_url", "description_text"],
    "weather report": ["station_identifier", "observation_time", "temperature_celsius", "relative_humidity_percent",
                       "wind_speed_kmh", "wind_direction_degrees", "pressure_hpa", "visibility_km",
                       "precipitation_mm", "cloud_cover_percent", "is_daylight", "weather_summary"],
    "library book loan": ["loan_identifier", "book_title", "book_author", "isbn_number", "borrower_name",
                          "borrower_card_number", "checkout_date", "due_date", "renewal_count", "is_overdue",
                          "late_fee_amount", "branch_name"],
    "car listing": ["listing_identifier", "vehicle_make", "vehicle_model", "model_year", "mileage_km",
                    "fuel_type", "transmission_type", "exterior_color", "asking_price", "seller_name",
                    "has_accident_history", "listing_city"],
    "hotel reservation": ["reservation_number", "guest_name", "hotel_name", "check_in_date", "check_out_date",
                          "room_type", "number_of_guests", "breakfast_included", "nightly_rate",
                          "loyalty_member_id", "special_requests", "is_prepaid"],
    "sensor reading": ["device_serial_number", "firmware_version", "battery_level_percent", "reading_timestamp",
                       "measured_value", "measurement_unit", "calibration_offset", "signal_strength_dbm",
                       "is_within_threshold", "location_latitude", "location_longitude", "alert_message"],
    "course enrollment": ["course_code", "course_title", "instructor_name", "semester_name", "credit_hours",
                          "student_identifier", "student_full_name", "enrollment_status", "is_auditing",
                          "final_grade_letter", "classroom_building", "meeting_days"],
    "package shipment": ["tracking_number", "carrier_name", "sender_postal_code", "recipient_postal_code",
                         "package_weight_kg", "declared_value_usd", "service_level", "is_signature_required",
                         "estimated_delivery_date", "current_status", "last_scan_location", "insurance_included"],
}


def _typed(key: str) -> dict:
    """A plausible type for a key-heavy schema's key, from its name."""
    if key.startswith(("is_", "has_", "enable_")) or key.endswith(("_included", "_mode", "_required")):
        return B
    if key.endswith(("_count", "_number", "_minutes", "_hours", "_year", "_km", "_kg", "_percent", "_seconds",
                     "_threads", "_connections", "_dbm", "_degrees", "_hpa", "_mm", "servings_count")):
        return {"type": "integer", "minimum": 0, "maximum": 100000}
    if key.endswith(("_price", "_usd", "_amount", "_rate", "_value", "_offset", "_celsius", "_latitude",
                     "_longitude", "_salary")):
        return N
    if key.endswith("_date"):
        return {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}
    return {"type": "string", "maxLength": 40}


def schemas() -> list[dict]:
    """52 schemas: ``name``, ``schema``, ``task`` (the user's request), ``key_heavy``."""
    out = []
    for topic, keys in KEY_HEAVY_TOPICS.items():
        out.append(dict(name=f"key-heavy {topic}", key_heavy=True, task=f"Invent a realistic {topic}.",
                        schema=_obj({k: _typed(k) for k in keys})))
    people = ["a software engineer in Berlin", "a retired teacher", "a professional chess player",
              "a marine biologist", "a jazz musician", "a startup founder"]
    for p in people:
        out.append(dict(name=f"person {p}", key_heavy=False, task=f"Describe {p}.", schema=_obj({
            "name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": r"^[a-z0-9._]+@[a-z0-9]+\.[a-z]{2,3}$"},
            "skills": {"type": "array", "items": S, "minItems": 1, "maxItems": 4}})))
    for thing in ["a laptop", "a coffee machine", "running shoes", "a board game", "a smartphone", "a desk lamp"]:
        out.append(dict(name=f"product {thing}", key_heavy=False, task=f"Write a shop listing for {thing}.",
                        schema=_obj({"title": S, "price": {"type": "number", "minimum": 0, "maximum": 5000},
                                     "currency": {"enum": ["USD", "EUR", "GBP"]},
                                     "in_stock": B, "tags": {"type": "array", "items": S, "maxItems": 3},
                                     "rating": {"type": "number", "minimum": 1, "maximum": 5}})))
    for city in ["Lisbon", "Osaka", "Toronto", "Nairobi", "Santiago", "Oslo"]:
        out.append(dict(name=f"nested address {city}", key_heavy=False, task=f"Give a company address in {city}.",
                        schema=_obj({"company": S, "address": _obj({
                            "street": S, "city": {"const": city}, "postal_code": S,
                            "country": _obj({"name": S, "iso_code": {"type": "string", "pattern": "^[A-Z]{2}$"}})}),
                            "employees": {"type": "integer", "minimum": 1, "maximum": 100000}})))
    for task in ["a bug report about a crash on startup", "a feature request for dark mode",
                 "a question about pricing", "a complaint about a late delivery"]:
        out.append(dict(name=f"ticket {task}", key_heavy=False, task=f"File {task} as a support ticket.",
                        schema=_obj({"id": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string",
                                                                                           "pattern": "^T-[0-9]{4}$"}]},
                                     "category": {"enum": ["bug", "feature", "question", "complaint"]},
                                     "priority": {"enum": ["low", "medium", "high"]},
                                     "summary": {"type": "string", "maxLength": 80},
                                     "steps": {"type": "array", "items": S, "maxItems": 3}},
                                    required=["id", "category", "priority", "summary"])))
    for shape in ["a triangle", "a rectangle", "a pentagon", "a line with a midpoint"]:
        point = {"$ref": "#/$defs/point"}
        out.append(dict(name=f"ref geometry {shape}", key_heavy=False, task=f"Give coordinates for {shape}.",
                        schema={**_obj({"label": S, "points": {"type": "array", "items": point, "minItems": 2,
                                                               "maxItems": 5}, "center": point}),
                                "$defs": {"point": _obj({"x": N, "y": N})}}))
    for event in ["a team meeting", "a birthday party", "a product launch", "a dentist appointment",
                  "a marathon", "a code review"]:
        out.append(dict(name=f"event {event}", key_heavy=False, task=f"Schedule {event}.", schema=_obj({
            "title": S, "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
            "start_time": {"type": "string", "pattern": r"^\d{2}:\d{2}$"},
            "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 600},
            "attendees": {"type": "array", "items": _obj({"name": S, "required": B}), "maxItems": 4},
            "location": S, "online": B}, required=["title", "date", "start_time", "duration_minutes"])))
    for lang in ["Python", "Rust", "Go", "TypeScript", "Java", "C++"]:
        out.append(dict(name=f"snippet {lang}", key_heavy=False, task=f"Describe a {lang} function that parses "
                        "a CSV line.", schema=_obj({"language": {"const": lang}, "function_name": S,
                                                    "parameters": {"type": "array", "items": _obj({"name": S,
                                                                                                   "type": S})},
                                                    "returns": S, "complexity": {"enum": ["O(1)", "O(n)",
                                                                                          "O(n log n)"]}})))
    for topic in ["the solar system", "photosynthesis"]:
        out.append(dict(name=f"quiz {topic}", key_heavy=False, task=f"Write two quiz questions about {topic}.",
                        schema=_obj({"topic": S, "questions": {"type": "array", "minItems": 2, "maxItems": 2,
                                                               "items": _obj({"question": S, "choices": {
                                                                   "type": "array", "items": S, "minItems": 3,
                                                                   "maxItems": 3},
                                                                   "answer_index": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 2}})}})))
    return out


def schema_messages(item: dict) -> list[dict]:
    text = f"{item['task']} Reply with a JSON object that follows this schema:\n{json.dumps(item['schema'])}"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


# ------------------------------------------------------------------------------------------ BFCL
def bfcl_dir(cache: Path) -> Path:
    """The ``bfcl-eval`` wheel, unpacked once without its (heavy, pinned) dependencies."""
    target = cache / f"bfcl-eval-{BFCL_VERSION}"
    if not (target / "bfcl_eval").is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache),
                        f"bfcl-eval=={BFCL_VERSION}"], check=True)
        wheel = next(cache.glob(f"bfcl_eval-{BFCL_VERSION}-*.whl"))
        zipfile.ZipFile(wheel).extractall(target)
    return target


def bfcl_checker(root: Path):
    """BFCL's AST checker; the model registry it reads one flag from is replaced by a stand-in (it would
    import every provider's client library)."""
    sys.path.insert(0, str(root))
    registry = types.ModuleType("bfcl_eval.constants.model_config")
    registry.MODEL_CONFIG_MAPPING = defaultdict(lambda: types.SimpleNamespace(underscore_to_dot=False))
    sys.modules["bfcl_eval.constants.model_config"] = registry
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return lambda functions, output, answer, category: ast_checker(functions, output, answer, Language.PYTHON,
                                                                    category, "mcsd")


def bfcl_cases(root: Path, category: str, limit: int) -> list[dict]:
    data = root / "bfcl_eval" / "data"
    questions = [json.loads(line) for line in (data / f"BFCL_v4_{category}.json").read_text().splitlines()]
    answers = {a["id"]: a["ground_truth"] for a in map(json.loads, (data / "possible_answer" /
                                                                     f"BFCL_v4_{category}.json").read_text().splitlines())}
    return [dict(q, answer=answers[q["id"]], category=category) for q in questions[:limit]]


_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def json_schema(p: dict) -> dict:
    """A BFCL parameter description (types ``dict``, ``float``, ``tuple``, ``any``) as JSON Schema."""
    out = dict(p)
    if isinstance(out.get("type"), str):
        t = _TYPES.get(out["type"], out["type"])
        if t is None:
            del out["type"]
        else:
            out["type"] = t
    if isinstance(out.get("properties"), dict):
        out["properties"] = {k: json_schema(v) for k, v in out["properties"].items() if isinstance(v, dict)}
    if isinstance(out.get("items"), dict):
        out["items"] = json_schema(out["items"])
    return out


def tools_of(case: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": f["name"], "description": f.get("description", ""),
                                              "parameters": json_schema(f["parameters"])}}
            for f in case["function"]]


# ------------------------------------------------------------------------------------------ requests
async def one(client, model: str, messages, extra: dict, max_tokens: int, **kw) -> dict:
    """One streamed greedy request: text, tool calls (reassembled from deltas), tokens, timings, usage."""
    import openai

    def create():
        return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                              stream=True, stream_options={"include_usage": True}, extra_body=extra,
                                              **kw)

    t0 = time.perf_counter()
    first, text, calls, usage, finish = None, "", {}, None, None
    try:
        stream = await create()
    except openai.APIConnectionError:  # a pooled connection the server closed while idle: once more, anew
        t0 = time.perf_counter()
        stream = await create()
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            d = c.delta
            if first is None and (d.content or d.tool_calls):
                first = time.perf_counter()
            text += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = c.finish_reason or finish
    end = time.perf_counter()
    spec = (usage.model_extra or {}).get("speculative") if usage is not None else None
    return dict(text=text, calls=[calls[i] for i in sorted(calls)], finish=finish,
                tokens=usage.completion_tokens if usage else 0, ttft=(first or end) - t0, e2e=end - t0,
                drafted=spec["drafted_tokens"] if spec else 0, accepted=spec["accepted_tokens"] if spec else 0)


def rates(results: list[dict]) -> dict:
    decode = [(r["tokens"] - 1, r["e2e"] - r["ttft"]) for r in results if r["tokens"] > 1 and r["e2e"] > r["ttft"]]
    drafted = sum(r["drafted"] for r in results)
    return dict(tokens=sum(r["tokens"] for r in results),
                decode_tok_s=sum(t for t, _ in decode) / max(sum(s for _, s in decode), 1e-9),
                e2e_s=sum(r["e2e"] for r in results),
                acceptance=sum(r["accepted"] for r in results) / drafted if drafted else None)


def json_row(mode: str, items: list[dict], results: list[dict], constrained: bool = True) -> dict:
    import jsonschema

    finished = valid = 0
    for item, r in zip(items, results):
        if r["finish"] != "stop":
            continue
        finished += 1
        try:
            jsonschema.validate(json.loads(r["text"]), item["schema"])
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return dict(mode=mode, requests=len(results), finished=finished, valid=valid if constrained else None,
                valid_rate=valid / finished if constrained and finished else None, **rates(results))


def calls_of(r: dict) -> Optional[list[dict]]:
    """The response's calls as BFCL's checker reads them (None if any does not parse)."""
    try:
        return [{c["name"]: json.loads(c["arguments"] or "{}")} for c in r["calls"]]
    except ValueError:
        return None


def bfcl_row(mode: str, cases: list[dict], results: list[dict], check) -> dict:
    parsed = correct = 0
    per: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for case, r in zip(cases, results):
        calls = calls_of(r)
        ok = False
        if calls:
            parsed += 1
            try:
                ok = bool(check(case["function"], calls, case["answer"], case["category"])["valid"])
            except Exception:  # noqa: BLE001 - a malformed call the checker cannot read is wrong
                ok = False
        correct += ok
        per[case["category"]][0] += ok
        per[case["category"]][1] += 1
    return dict(mode=mode, cases=len(cases), parsed=parsed, parse_rate=parsed / len(cases),
                accuracy=correct / len(cases), **{f"acc_{k}": v[0] / v[1] for k, v in per.items()},
                **rates(results))


async def run_mode(client, model, prompts: list, extra: dict, max_tokens: int, label: str, **kw) -> list[dict]:
    out = []
    for i, p in enumerate(prompts):
        messages, more = p if isinstance(p, tuple) else (p, {})
        out.append(await one(client, model, messages, extra, max_tokens, **kw, **more))
        if (i + 1) % 10 == 0:
            print(f"  {label}: {i + 1}/{len(prompts)}", flush=True)
    return out


# ------------------------------------------------------------------------------------------ main
def our_server(name: str, args, flags: list[str]) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--config", "default", "--threads", str(args.threads),
           "--model", args.target, "--draft-model", args.draft, "--served-model-name", "model",
           "--no-prefix-cache", *flags, "--host", "127.0.0.1", "--port", str(port)]
    return Server(name, cmd, port, dict(os.environ, PYTHONPATH=str(ROOT)))


async def drive(args, servers: dict[str, Server], items: list[dict], cases: list[dict], check) -> tuple[list, list]:
    import openai

    def client(s: Server):
        return openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", timeout=1800, max_retries=0)

    json_prompts = [(schema_messages(it), {"response_format": {"type": "json_schema", "json_schema": {
        "name": "answer", "schema": it["schema"]}}}) for it in items]
    free_prompts = [schema_messages(it) for it in items]
    tool_prompts = [(c["question"][0], {"tools": tools_of(c)}) for c in cases]
    json_rows, tool_rows, raw = [], [], {}
    ours = client(servers["ours"])
    off, on = {"speculative": {"enabled": False}}, {"speculative": {"enabled": True}}
    anything = [(m, {}) for m in free_prompts]
    plan = [("ours spec off", ours, json_prompts, off, True), ("ours spec on", ours, json_prompts, on, True),
            ("ours free spec on", ours, free_prompts, on, False),
            ("ours any-text grammar spec on", ours, anything, {**on, "structured_outputs": {"regex": ANY_TEXT}}, False)]
    if "ours no forced" in servers:
        plan.append(("ours spec on, no forced", client(servers["ours no forced"]), json_prompts, on, True))
    if "llama" in servers:
        plan.append(("llama", client(servers["llama"]), json_prompts, {"cache_prompt": False}, True))
    for label, c, prompts, extra, constrained in plan:
        raw[label] = await run_mode(c, "model", prompts, extra, args.max_tokens, label)
        json_rows.append(json_row(label, items, raw[label], constrained))
    same = sum(a["text"] == b["text"] for a, b in zip(raw["ours spec off"], raw["ours spec on"]))
    json_rows[1]["same_as_spec_off"] = same
    json_rows[3]["same_as_free"] = sum(a["text"] == b["text"] for a, b in
                                       zip(raw["ours free spec on"], raw["ours any-text grammar spec on"]))
    heavy = [i for i, it in enumerate(items) if it["key_heavy"]]
    for row in json_rows:
        rs = [raw[row["mode"]][i] for i in heavy]
        row["key_heavy_decode_tok_s"] = rates(rs)["decode_tok_s"] if rs else None
    if cases:
        tool_plan = [("ours auto spec off", ours, off, "auto"), ("ours auto spec on", ours, on, "auto"),
                     ("ours required spec off", ours, off, "required"), ("ours required spec on", ours, on, "required")]
        if "llama" in servers:
            tool_plan += [("llama auto", client(servers["llama"]), {"cache_prompt": False}, "auto"),
                          ("llama required", client(servers["llama"]), {"cache_prompt": False}, "required")]
        for label, c, extra, choice in tool_plan:
            raw[label] = await run_mode(c, "model", tool_prompts, extra, args.tool_max_tokens, label,
                                        tool_choice=choice)
            tool_rows.append(bfcl_row(label, cases, raw[label], check))
        for k, mode in ((1, "auto"), (3, "required")):
            tool_rows[k]["same_as_spec_off"] = sum(a["calls"] == b["calls"] and a["text"] == b["text"] for a, b in
                                                   zip(raw[f"ours {mode} spec off"], raw[f"ours {mode} spec on"]))
    return json_rows, tool_rows, raw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--schemas", type=int, default=52, help="how many of the 52 schemas (default all)")
    ap.add_argument("--bfcl", type=int, default=10, help="cases per BFCL category (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--tool-max-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llama", action="store_true", help="leave out llama-server")
    ap.add_argument("--no-forced-server", action="store_true", help="leave out the --grammar-forced 0 server")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("MCSD_CACHE", Path.home() / ".cache/mcsd")) / "data")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    every = schemas()
    assert len(every) >= 50, len(every)
    items = every[: args.schemas]
    root = bfcl_dir(args.cache) if args.bfcl else None
    cases = [c for cat in CATEGORIES for c in bfcl_cases(root, cat, args.bfcl)] if root else []
    check = bfcl_checker(root) if root else None
    servers = {"ours": our_server("ours", args, [])}
    if not args.no_forced_server:
        servers["ours no forced"] = our_server("ours no forced", args, ["--grammar-forced", "0"])
    if not args.no_llama:
        binary = build_llama_server()
        target = Path(args.target) if args.target.endswith(".gguf") else gguf_path(args.target)
        port = free_port()
        servers["llama"] = Server("llama", [str(binary), "-m", str(target), "-t", str(args.threads), "-c", "8192",
                                            "-np", "1", "--jinja", "--host", "127.0.0.1", "--port", str(port)],
                                  port, dict(os.environ, LD_LIBRARY_PATH=str(binary.parent)))
    try:
        for s in servers.values():  # one at a time: each loads on both cores
            s.start()
            s.wait_healthy(1800)
            print(f"{s.name} ready in {s.startup_s:.1f} s", flush=True)
        json_rows, tool_rows, raw = asyncio.run(drive(args, servers, items, cases, check))
    finally:
        for s in servers.values():
            s.stop()
    print(f"\nJSON schemas ({len(items)}, {sum(it['key_heavy'] for it in items)} key-heavy), greedy, one at a time")
    print_table(json_rows, [("mode", "mode", "s"), ("finished", "finished", "d"), ("valid", "valid", "d"),
                            ("decode_tok_s", "decode tok/s", ".1f"), ("key_heavy_decode_tok_s", "key-heavy tok/s", ".1f"),
                            ("acceptance", "acceptance", ".2f"), ("same_as_spec_off", "same as spec off", "d"),
                            ("same_as_free", "same as free", "d")])
    if tool_rows:
        print(f"\nBFCL ({', '.join(CATEGORIES)}; {args.bfcl} each), greedy")
        print_table(tool_rows, [("mode", "mode", "s"), ("parse_rate", "parsed", ".2f"), ("accuracy", "accuracy", ".2f"),
                                *[(f"acc_{c}", c, ".2f") for c in CATEGORIES], ("decode_tok_s", "decode tok/s", ".1f"),
                                ("acceptance", "acceptance", ".2f"), ("same_as_spec_off", "same as spec off", "d")])
    write_json("structured.json", dict(machine=machine(), args={k: str(v) for k, v in vars(args).items()},
                                       json=json_rows, bfcl=tool_rows,
                                       outputs={k: [dict(text=r["text"], calls=r["calls"], finish=r["finish"])
                                                    for r in v] for k, v in raw.items()}), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
