"""Serving benchmark (issue 4, item 8): our own async load generator against the OpenAI-compatible server.

It starts the server itself (``python -m server --config PRESET --port FREE_PORT [server flags]``), waits for
``GET /health`` to answer 200 (the first start fetches model packs and builds the CPU kernels), runs the load, and stops
the server (SIGINT, then SIGKILL after ``--grace`` seconds).  ``--url`` targets a server that is already running.

    .venv/bin/python benchmarks/bench_serving.py                          # Qwen pair, preset `default`
    .venv/bin/python benchmarks/bench_serving.py --concurrency 1,8 --requests-per-level 16 -- --tree 4,2,2
    .venv/bin/python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --modes spec,nospec

Everything after a bare ``--`` is passed to ``python -m server`` unchanged.

Load: for every concurrency level C (``--concurrency``, default 1,2,4,8) and every mode (``--modes``: ``spec``
sends ``"speculative": {"enabled": true}``, ``nospec`` ``{"enabled": false}``, ``fixed``
``{"enabled": true, "adaptive": false, "tree": --fixed-tree}``), a closed loop of C workers
sends ``--requests-per-level`` streaming chat completions (default 2*C).  Request i of a level uses prompt
``i mod len(prompts)`` of the prompts file, taken round-robin over the id prefixes (``HumanEval/...``,
``sharegpt/...``) so that any first k requests mix the prompt kinds; both modes of a level send the same
prompts, so a server this script starts runs with ``--no-prefix-cache`` unless its flags say otherwise
(the second mode would otherwise find every prompt cached, and win on TTFT).  The modes are interleaved
level by level in ABBA order (spec, nospec at C=1; nospec, spec at C=2; ...) so slow drift of the
machine does not favour one mode.  ``--warmup`` requests per mode run first and are
not measured.

Token timing (exact, no tokenizer on the client): requests ask for ``logprobs: true``, so every SSE content
chunk lists the tokens it carries (a speculative step can deliver several in one chunk; tokens whose text is
held back, e.g. a possible stop-string prefix or a partial UTF-8 character, still appear in ``logprobs``).
Each chunk's arrival time is taken when its ``data:`` line is read.  Then

* TTFT = first chunk carrying a token - request start (the empty ``role`` chunk sent on admission is ignored);
* inter-token latency is per token: a chunk after the first that carries k tokens, arriving dt after the
  previous token-carrying chunk, contributes k samples of dt/k (tokens that arrive together with the first
  token are part of TTFT and contribute no ITL sample);
* TPOT (per request) = (last token time - TTFT) / (tokens - 1); e2e = time to ``data: [DONE]``.

``--no-logprobs`` drops the field (in case logprobs themselves should not be measured) and instead spreads
``usage.completion_tokens`` over the chunks by their share of the streamed characters (an estimate).
Output tokens always come from the final ``usage`` chunk (``stream_options.include_usage``), which also carries
``usage.speculative`` (steps, drafted and accepted tokens, acceptance rate).

Per (mode, concurrency): output throughput = completion tokens / level wall time (first request sent to last
response finished), request throughput, TTFT / ITL / e2e p50 and p99 (linear interpolation), mean TPOT, mean
per-request acceptance rate, pooled acceptance (accepted / drafted) and mean accepted length
(1 + accepted / steps).  Printed as a Markdown table and written as JSON to ``benchmarks/results/serving.json``
(or ``--out``), with the two issue goals evaluated: spec throughput at concurrency 8 >= 3x concurrency 1 (the
highest / lowest ratio is reported for any levels, judged only for 8 vs 1) and spec / nospec throughput >= 0.95
at every concurrency.  Levels with errors or cut short are left out of the goals.

Robustness: every request has a timeout (``--request-timeout``); HTTP errors, in-band ``{"error"}`` events,
streams cut before ``[DONE]`` and timeouts are counted per level with their messages (never a crash); the
whole run is bounded by ``--max-duration`` (no new requests after it, in-flight ones cancelled); Ctrl-C stops
cleanly, writes what was measured so far (``"interrupted": true``) and stops the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tools.prompts import Prompt, interleave_sources, load_prompts_file  # noqa: E402  (no torch import: the client stays light)

DEFAULT_PROMPTS = ROOT / "benchmarks" / "prompts" / "bench.json"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "serving.json"
MODES = {"spec": {"enabled": True}, "nospec": {"enabled": False},
         "fixed": {"enabled": True, "adaptive": False}}  # fixed: the whole tree every step (--fixed-tree)
SCALING_GOAL = 3.0  # spec throughput at concurrency 8 / at concurrency 1
SCALING_LEVELS = (1, 8)
SPEC_RATIO_GOAL = 0.95


# ----------------------------------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary_ms(values_s: Sequence[float]) -> dict[str, Optional[float]]:
    """p50 / p99 / mean of seconds, in milliseconds."""
    if not values_s:
        return {"p50": None, "p99": None, "mean": None}
    return {"p50": percentile(values_s, 50) * 1e3, "p99": percentile(values_s, 99) * 1e3,
            "mean": sum(values_s) / len(values_s) * 1e3}


def _git_commit() -> Optional[str]:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _error_message(raw: bytes | str) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        err = json.loads(text)["error"]
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        return text.strip()[:300]


# ----------------------------------------------------------------------------------------------- one request
@dataclass
class RequestResult:
    prompt_id: str
    index: int = 0  # position in the level (request i uses prompt i mod len(prompts))
    ok: bool = False
    error: Optional[str] = None
    cancelled: bool = False  # stopped by the --max-duration deadline (not counted as an error)
    start: float = 0.0  # perf_counter when sent
    end: float = 0.0
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    tpot: Optional[float] = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    streamed_tokens: int = 0  # tokens listed in the chunks' logprobs (0 with --no-logprobs)
    chunks: int = 0  # chunks that carried tokens
    finish_reason: Optional[str] = None
    spec: Optional[dict] = None
    itl: list[float] = field(default_factory=list)  # per-token inter-token latencies, seconds

    def brief(self) -> dict:
        r = lambda x: None if x is None else round(x * 1e3, 3)  # noqa: E731
        return {"index": self.index, "prompt_id": self.prompt_id, "ok": self.ok, "error": self.error,
                "ttft_ms": r(self.ttft), "e2e_ms": r(self.e2e), "tpot_ms": r(self.tpot),
                "completion_tokens": self.completion_tokens, "prompt_tokens": self.prompt_tokens,
                "chunks": self.chunks, "finish_reason": self.finish_reason,
                "acceptance_rate": (self.spec or {}).get("acceptance_rate")}


def token_events(events: list[tuple[float, Optional[int], int]], completion_tokens: int) -> list[tuple[float, int]]:
    """``(time, tokens)`` per token-carrying chunk from ``(time, logprob tokens or None, chars)`` events.

    With logprobs the count is exact.  Without, ``completion_tokens`` is spread over the chunks by their
    cumulative share of the characters (rounded so the counts add up exactly)."""
    if events and all(n is not None for _, n, _ in events):
        return [(t, n) for t, n, _ in events if n]
    total = sum(c for _, _, c in events)
    if not events or completion_tokens <= 0:
        return []
    if total == 0:
        return [(events[-1][0], completion_tokens)]
    out, cum, given = [], 0, 0
    for t, _, chars in events:
        cum += chars
        upto = round(cum / total * completion_tokens)
        if upto > given:
            out.append((t, upto - given))
            given = upto
    return out


def apply_timing(res: RequestResult, events: list[tuple[float, Optional[int], int]]) -> None:
    """Fills TTFT, per-token ITL samples and TPOT from the chunk events (see the module docstring)."""
    toks = token_events(events, res.completion_tokens)
    res.chunks = len(toks)
    if not toks:
        return
    res.ttft = toks[0][0] - res.start
    prev = toks[0][0]
    for t, k in toks[1:]:
        res.itl += [(t - prev) / k] * k
        prev = t
    n = sum(k for _, k in toks)
    if n > 1:
        res.tpot = (toks[-1][0] - toks[0][0]) / (n - 1)


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict, headers: dict, res: RequestResult) -> None:
    """Sends one streaming chat completion and parses the raw SSE; fills ``res`` (errors included)."""
    events: list[tuple[float, Optional[int], int]] = []
    logprobs = bool(body.get("logprobs"))
    usage = None
    done = False
    res.start = time.perf_counter()
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            res.error = f"HTTP {resp.status_code}: {_error_message(await resp.aread())}"
            res.end = time.perf_counter()
            return
        async for line in resp.aiter_lines():
            now = time.perf_counter()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                obj = json.loads(data)
            except ValueError:
                res.error = f"bad SSE data: {data[:120]!r}"
                continue
            if "error" in obj:
                res.error = f"in-stream error: {_error_message(data)}"
                continue
            if obj.get("usage"):
                usage = obj["usage"]
            for choice in obj.get("choices") or ():
                content = (choice.get("delta") or {}).get("content") or ""
                ntok = len((choice.get("logprobs") or {}).get("content") or ()) if logprobs else None
                if content or ntok:
                    events.append((now, ntok, len(content)))
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
    res.end = time.perf_counter()
    if res.error:
        return
    if not done:
        res.error = "stream ended without data: [DONE]"
        return
    if usage is None:
        res.error = "no usage chunk (stream_options.include_usage ignored?)"
        return
    res.completion_tokens = int(usage.get("completion_tokens") or 0)
    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    res.spec = usage.get("speculative")
    res.streamed_tokens = sum(n or 0 for _, n, _ in events)
    res.e2e = res.end - res.start
    apply_timing(res, events)
    res.ok = True


# ----------------------------------------------------------------------------------------------- one level
@dataclass
class Load:
    """Everything that stays the same across levels."""

    base_url: str
    model: Optional[str]
    headers: dict
    max_tokens: int
    temperature: float
    logprobs: bool
    ignore_eos: bool
    seed: Optional[int]
    request_timeout: float
    deadline: float  # time.monotonic() after which nothing new starts and in-flight requests are cancelled
    fixed_tree: Optional[tuple[int, ...]] = None  # the "fixed" mode's speculative.tree (None: the server's tree)

    def body(self, prompt: Prompt, mode: str, max_tokens: Optional[int] = None) -> dict:
        body: dict[str, Any] = {
            "messages": [dict(m) for m in prompt.messages], "max_tokens": max_tokens or self.max_tokens,
            "temperature": self.temperature, "stream": True, "stream_options": {"include_usage": True},
            "speculative": dict(MODES[mode]),
        }
        if mode == "fixed" and self.fixed_tree:
            body["speculative"]["tree"] = list(self.fixed_tree)
        if self.model:
            body["model"] = self.model
        if self.logprobs:
            body["logprobs"] = True
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.seed is not None:
            body["seed"] = self.seed
        return body


async def one_request(client: httpx.AsyncClient, load: Load, prompt: Prompt, mode: str,
                      max_tokens: Optional[int] = None, index: int = 0) -> RequestResult:
    res = RequestResult(prompt.id, index)
    left = load.deadline - time.monotonic()
    timeout = min(load.request_timeout, left)
    try:
        await asyncio.wait_for(stream_chat(client, load.base_url + "/v1/chat/completions",
                                           load.body(prompt, mode, max_tokens), load.headers, res), timeout)
    except asyncio.TimeoutError:
        if timeout < load.request_timeout:
            res.cancelled, res.error = True, "cancelled: --max-duration reached"
        else:
            res.error = f"timeout after {load.request_timeout:g} s"
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - a benchmark reports, it does not crash
        res.error = f"{type(exc).__name__}: {exc}"
    if not res.end:
        res.end = time.perf_counter()
    if res.error:
        res.ok = False
    return res


async def run_level(client: httpx.AsyncClient, load: Load, mode: str, concurrency: int,
                    prompts: Sequence[Prompt], n_requests: int, sink: list[dict]) -> dict:
    """A closed loop of ``concurrency`` workers over ``n_requests`` requests; appends the level's metrics to
    ``sink`` (also when cancelled, then with what finished) and returns them."""
    todo = iter(range(n_requests))
    results: list[RequestResult] = []

    async def worker() -> None:
        for i in todo:
            if time.monotonic() >= load.deadline:
                return
            results.append(await one_request(client, load, prompts[i % len(prompts)], mode, index=i))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    except asyncio.CancelledError:  # Ctrl-C: keep the requests that finished, marked as cut short
        t1 = max((r.end for r in results), default=time.perf_counter())
        sink.append({**level_metrics(mode, concurrency, n_requests, results, t1 - t0), "truncated": True})
        raise
    t1 = max((r.end for r in results), default=time.perf_counter())
    level = level_metrics(mode, concurrency, n_requests, results, t1 - t0)
    sink.append(level)
    return level


def level_metrics(mode: str, concurrency: int, n_requests: int, results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok and not r.cancelled]
    tokens = sum(r.completion_tokens for r in ok)
    specs = [r.spec for r in ok if r.spec]
    drafted = sum(s.get("drafted_tokens", 0) for s in specs)
    accepted = sum(s.get("accepted_tokens", 0) for s in specs)
    steps = sum(s.get("steps", 0) for s in specs)
    rates = [s["acceptance_rate"] for s in specs if s.get("drafted_tokens")]
    itl = [x for r in ok for x in r.itl]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    return {
        "mode": mode, "concurrency": concurrency, "requests": n_requests, "sent": len(results),
        "completed": len(ok), "errors": len(errors), "cancelled": sum(r.cancelled for r in results),
        "truncated": len(results) < n_requests or any(r.cancelled for r in results),
        "error_messages": sorted({r.error for r in errors if r.error})[:10],
        "wall_s": wall, "completion_tokens": tokens, "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "streamed_tokens": sum(r.streamed_tokens for r in ok),
        "output_throughput_tok_s": tokens / wall if wall > 0 else None,
        "request_throughput_req_s": len(ok) / wall if wall > 0 else None,
        "ttft_ms": summary_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": summary_ms(itl), "itl_samples": len(itl),
        "tpot_ms_mean": sum(tpots) / len(tpots) * 1e3 if tpots else None,
        "e2e_ms": summary_ms([r.e2e for r in ok if r.e2e is not None]),
        "acceptance_rate_mean": sum(rates) / len(rates) if rates else None,
        "acceptance_rate_pooled": accepted / drafted if drafted else None,
        "mean_accepted_length": 1 + accepted / steps if steps else None,
        "spec_totals": {"steps": steps, "drafted_tokens": drafted, "accepted_tokens": accepted},
        "per_request": [r.brief() for r in sorted(results, key=lambda r: r.index)],
    }


# ----------------------------------------------------------------------------------------------- goals, output
def evaluate_goals(levels: list[dict]) -> dict:
    thr = {(lv["mode"], lv["concurrency"]): lv["output_throughput_tok_s"] for lv in levels
           if lv["completed"] and not lv["errors"] and not lv["truncated"]}
    concs = sorted({c for _, c in thr})
    scaling = []
    for mode in MODES:
        have = [c for c in concs if (mode, c) in thr]
        if len(have) >= 2:
            lo, hi = have[0], have[-1]
            ratio = thr[(mode, hi)] / thr[(mode, lo)] if thr[(mode, lo)] else None
            judged = ratio is not None and (lo, hi) == SCALING_LEVELS  # the goal is stated for 8 vs 1
            scaling.append({"mode": mode, "low": lo, "high": hi, "ratio": ratio, "goal": SCALING_GOAL,
                            "pass": ratio >= SCALING_GOAL if judged else None})
    spec_vs_nospec = []
    for c in concs:
        if ("spec", c) in thr and ("nospec", c) in thr and thr[("nospec", c)]:
            ratio = thr[("spec", c)] / thr[("nospec", c)]
            spec_vs_nospec.append({"concurrency": c, "ratio": ratio, "goal": SPEC_RATIO_GOAL,
                                   "pass": ratio >= SPEC_RATIO_GOAL})
    adaptive_vs_best = []  # issue 5: adaptive (spec) >= the better of fixed speculation and none
    for c in concs:
        if all((m, c) in thr for m in ("spec", "fixed", "nospec")):
            best = max(thr[("fixed", c)], thr[("nospec", c)])
            ratio = thr[("spec", c)] / best if best else None
            adaptive_vs_best.append({"concurrency": c, "ratio": ratio, "goal": 1.0,
                                     "pass": ratio is not None and ratio >= 1.0})
    spec_scaling = next((s for s in scaling if s["mode"] == "spec"), None)
    return {
        "note": "levels with errors or cut short are left out of the goals",
        "scaling": scaling,
        "spec_vs_nospec": spec_vs_nospec,
        "adaptive_vs_best_fixed_or_nospec": adaptive_vs_best,
        "throughput_scaling_pass": spec_scaling["pass"] if spec_scaling else None,
        "spec_never_slower_pass": all(x["pass"] for x in spec_vs_nospec) if spec_vs_nospec else None,
    }


def _fmt(x: Optional[float], spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(levels: list[dict]) -> str:
    cols = ["mode", "conc", "ok/sent", "err", "out tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms",
            "ITL p50 ms", "ITL p99 ms", "TPOT ms", "E2E p50 ms", "accept", "acc len"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for lv in levels:
        done = f"{lv['completed']}/{lv['sent']}" + ("*" if lv["truncated"] else "")
        row = [lv["mode"], str(lv["concurrency"]), done, str(lv["errors"]),
               _fmt(lv["output_throughput_tok_s"], ".2f"), _fmt(lv["request_throughput_req_s"], ".3f"),
               _fmt(lv["ttft_ms"]["p50"], ".0f"), _fmt(lv["ttft_ms"]["p99"], ".0f"),
               _fmt(lv["itl_ms"]["p50"], ".1f"), _fmt(lv["itl_ms"]["p99"], ".1f"), _fmt(lv["tpot_ms_mean"], ".1f"),
               _fmt(lv["e2e_ms"]["p50"], ".0f"), _fmt(lv["acceptance_rate_mean"], ".3f"),
               _fmt(lv["mean_accepted_length"], ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    if any(lv["truncated"] for lv in levels):
        lines.append("\n* cut short (Ctrl-C or --max-duration); not used for the goals")
    return "\n".join(lines)


def format_goals(goals: dict) -> str:
    verdict = lambda ok: "n/a" if ok is None else ("PASS" if ok else "FAIL")  # noqa: E731
    lines = []
    for s in goals["scaling"]:
        goal = (f"goal c={SCALING_LEVELS[1]} / c={SCALING_LEVELS[0]} >= {s['goal']:g}x"
                + (f" in spec mode: {verdict(s['pass'])}" if s["mode"] == "spec" else ""))
        lines.append(f"throughput scaling ({s['mode']}): c={s['high']} / c={s['low']} = "
                     f"{_fmt(s['ratio'], '.2f')}x ({goal})")
    for s in goals["spec_vs_nospec"]:
        lines.append(f"spec / nospec throughput at c={s['concurrency']}: {s['ratio']:.3f} "
                     f"(goal >= {s['goal']:g}) {verdict(s['pass'])}")
    for s in goals.get("adaptive_vs_best_fixed_or_nospec", []):
        lines.append(f"spec (adaptive) / max(fixed, nospec) throughput at c={s['concurrency']}: "
                     f"{_fmt(s['ratio'], '.3f')} (goal >= 1) {verdict(s['pass'])}")
    if not lines:
        lines.append("goals: not enough complete, error-free levels to evaluate")
    return "\n".join(lines)


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


# ----------------------------------------------------------------------------------------------- the server
class ServerProcess:
    """``python -m server`` as a child in its own session (so a Ctrl-C here does not reach it directly)."""

    def __init__(self, python: str, config: str, extra: Sequence[str], log_path: Optional[Path],
                 grace: float) -> None:
        self.port = free_port()
        log_path = log_path or Path(tempfile.gettempdir()) / f"mcsd-bench-serving-{os.getpid()}-{self.port}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [python, "-m", "server", "--config", config, *extra, "--host", "127.0.0.1",
                    "--port", str(self.port)]
        self.log_path = log_path
        self.grace = grace
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_healthy(self, timeout: float, headers: dict) -> None:
        t0 = time.monotonic()
        last_note = t0
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode} before it was healthy; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", headers=headers, timeout=5, trust_env=False).status_code == 200:
                    self.startup_s = time.monotonic() - t0
                    return
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if now - t0 > timeout:
                raise RuntimeError(f"server not healthy after {timeout:g} s (--startup-timeout); "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            if now - last_note >= 30:
                print(f"  ... still waiting for {self.url}/health ({now - t0:.0f} s; models may be loading)",
                      flush=True)
                last_note = now
            time.sleep(0.25)

    def stop(self) -> Optional[int]:
        """SIGINT (graceful shutdown), SIGKILL after the grace period; returns the exit status."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        try:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(self.grace)
            except subprocess.TimeoutExpired:
                print(f"server did not stop within {self.grace:g} s; killing it", file=sys.stderr)
        except KeyboardInterrupt:  # a second Ctrl-C: do not wait
            pass
        self.proc.kill()
        return self.proc.wait()


# ----------------------------------------------------------------------------------------------- main
def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, server_extra = argv[:cut], argv[cut + 1:]
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="\n\n".join(doc[1:3]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--url", help="benchmark this running server instead of starting one (e.g. http://127.0.0.1:8000)")
    g.add_argument("--config", default="default", help="preset for the started server (default: %(default)s)")
    g.add_argument("--server-args", default="", help="extra flags for `python -m server`, one shell-quoted "
                   "string (or put them after a bare --)")
    g.add_argument("--python", default=sys.executable, help="interpreter that runs the server (default: this one)")
    g.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds to wait for /health == 200 (the first start fetches models and builds kernels; default %(default)g)")
    g.add_argument("--grace", type=float, default=30.0, help="seconds between SIGINT and SIGKILL at the end")
    g.add_argument("--server-log", type=Path, help="server output (default: a file in the temp directory)")
    g.add_argument("--api-key", help="Bearer key to send (also passed to a started server)")
    g.add_argument("--model", help="model name to send (default: the first id of GET /v1/models)")
    g = p.add_argument_group("load")
    g.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="prompts file (default: %(default)s)")
    g.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels (default: %(default)s)")
    g.add_argument("--modes", default="spec,nospec", help=f"comma-separated, of {', '.join(MODES)} "
                   "(default: %(default)s)")
    g.add_argument("--fixed-tree", help="tree for mode 'fixed' (adaptive off for those requests), e.g. 2,1 "
                   "(default: the server's --tree)")
    g.add_argument("--requests-per-level", type=int, help="requests per (mode, concurrency) (default: 2 * "
                   "concurrency; use at least the number of prompts to cover them all at every level)")
    g.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: %(default)s)")
    g.add_argument("--seed", type=int, help="request seed (for temperature > 0)")
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos so every request runs max_tokens")
    g.add_argument("--no-logprobs", dest="logprobs", action="store_false",
                   help="do not request logprobs; estimate tokens per chunk from characters instead")
    g.add_argument("--warmup", type=int, default=1, help="unmeasured requests per mode before the levels")
    g.add_argument("--request-timeout", type=float, default=900.0, help="seconds per request (default %(default)g)")
    g.add_argument("--max-duration", type=float, default=4 * 3600.0,
                   help="bound on the whole load phase in seconds (default %(default)g)")
    g = p.add_argument_group("output")
    g.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (default: %(default)s)")
    args = p.parse_args(argv)
    args.server_extra = shlex.split(args.server_args) + server_extra
    try:
        args.levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrency must be comma-separated integers, got {args.concurrency!r}")
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.levels or any(c < 1 for c in args.levels):
        p.error("--concurrency needs positive integers")
    if not args.mode_list or any(m not in MODES for m in args.mode_list):
        p.error(f"--modes must be a comma-separated subset of {', '.join(MODES)}")
    try:
        args.fixed_tree = tuple(int(k) for k in args.fixed_tree.split(",")) if args.fixed_tree else None
    except ValueError:
        p.error(f"--fixed-tree must be comma-separated widths, got {args.fixed_tree!r}")
    if args.requests_per_level is not None and args.requests_per_level < 1:
        p.error("--requests-per-level must be >= 1")
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if args.url and args.server_extra:
        p.error("server flags make no sense with --url")
    return args


async def run_load(args: argparse.Namespace, base_url: str, headers: dict, prompts: list[Prompt],
                   report: dict) -> None:
    """Warm-up, then the levels; appends each finished level to ``report["results"]`` at once, so an
    interrupted run still has everything measured up to then."""
    limits = httpx.Limits(max_connections=max(args.levels) + 4, max_keepalive_connections=max(args.levels) + 4)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = args.model
        if model is None:
            try:
                r = await client.get(base_url + "/v1/models", headers=headers)
                model = r.json()["data"][0]["id"] if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                model = None
        report["server"]["model"] = model
        load = Load(base_url, model, headers, args.max_tokens, args.temperature, args.logprobs, args.ignore_eos,
                    args.seed, args.request_timeout, time.monotonic() + args.max_duration, args.fixed_tree)
        for mode in args.mode_list:
            for _ in range(args.warmup):
                res = await one_request(client, load, prompts[0], mode, min(args.max_tokens, 16))
                report["warmup"].append({"mode": mode, "ok": res.ok, "error": res.error,
                                         "seconds": round(res.end - res.start, 3)})
                if not res.ok:
                    print(f"warm-up ({mode}) failed: {res.error}", flush=True)
        for j, conc in enumerate(args.levels):
            n = args.requests_per_level or 2 * conc
            for mode in (args.mode_list if j % 2 == 0 else args.mode_list[::-1]):
                if time.monotonic() >= load.deadline:
                    report["skipped"].append({"mode": mode, "concurrency": conc, "reason": "--max-duration"})
                    continue
                print(f"[{mode:6s} c={conc}] {n} requests ...", end=" ", flush=True)
                lv = await run_level(client, load, mode, conc, prompts, n, report["results"])
                print(f"{lv['completed']}/{lv['sent']} ok, {lv['errors']} errors, "
                      f"{_fmt(lv['output_throughput_tok_s'], '.2f')} tok/s, {lv['wall_s']:.1f} s"
                      + (f"  errors: {lv['error_messages'][:2]}" if lv["errors"] else ""), flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    try:
        prompts = interleave_sources(load_prompts_file(args.prompts))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    report: dict[str, Any] = {
        "benchmark": "serving",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "server": {"url": args.url, "started_by_benchmark": not args.url},
        "settings": {
            "concurrency": args.levels, "modes": args.mode_list, "fixed_tree": args.fixed_tree,
            "requests_per_level": args.requests_per_level or "2*concurrency", "max_tokens": args.max_tokens,
            "temperature": args.temperature, "seed": args.seed, "ignore_eos": args.ignore_eos,
            "prompts_file": str(args.prompts), "num_prompts": len(prompts),
            "token_timing": "logprobs (exact tokens per chunk)" if args.logprobs else
                            "chars (usage.completion_tokens spread by character share)",
            "warmup": args.warmup, "request_timeout_s": args.request_timeout, "max_duration_s": args.max_duration,
        },
        "warmup": [], "results": [], "skipped": [], "interrupted": False,
    }
    server = None
    status = 0
    t_start = time.monotonic()
    try:
        if args.url:
            base_url = args.url.rstrip("/")
        else:
            extra = list(args.server_extra) + (["--api-key", args.api_key] if args.api_key else [])
            if not any(a in ("--prefix-cache", "--no-prefix-cache") for a in extra):
                # both modes send the same prompts to one server: with its prefix cache the second mode
                # of a level would find every prompt cached (its TTFT a fraction of the first mode's), so
                # each mode prefills its own
                extra.append("--no-prefix-cache")
            server = ServerProcess(args.python, args.config, extra, args.server_log, args.grace)
            log_path = server.log_path
            report["server"].update(config=args.config, command=server.cmd, log=str(log_path))
            print(f"starting server: {shlex.join(server.cmd)}\n  (log: {log_path})", flush=True)
            server.start()
            server.wait_healthy(args.startup_timeout, headers)
            report["server"]["startup_s"] = server.startup_s
            print(f"server healthy after {server.startup_s:.1f} s at {server.url}", flush=True)
            base_url = server.url
        report["server"]["url"] = base_url
        asyncio.run(run_load(args, base_url, headers, prompts, report))
    except KeyboardInterrupt:
        print("\ninterrupted: writing what was measured so far", file=sys.stderr)
        report["interrupted"] = True
        status = 130
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        report["error"] = str(exc)
        status = 1
    finally:
        if server is not None:
            report["server"]["exit_status"] = server.stop()
    report["elapsed_s"] = time.monotonic() - t_start
    report["goals"] = evaluate_goals(report["results"])
    if report["results"]:
        print()
        print(format_table(report["results"]))
        print()
        print(format_goals(report["goals"]))
    if report["skipped"]:
        print("\nskipped (--max-duration reached): "
              + ", ".join(f"{s['mode']} c={s['concurrency']}" for s in report["skipped"]))
    errors = sum(lv["errors"] for lv in report["results"])
    if errors:
        print(f"\n{errors} request(s) failed; see error_messages in the JSON", file=sys.stderr)
    write_report(args.out, report)
    print(f"\nwrote {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
