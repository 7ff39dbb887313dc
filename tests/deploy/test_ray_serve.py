"""Two replicas of a tiny model behind Ray Serve's proxy (``deploy/ray_serve.py``): the OpenAI API
through the proxy, streams intact, requests spread, a conversation kept on its replica with its
prefix cached, and a replica killed mid-load: its client gets an error, the other replica's
requests complete, and Ray brings the replica back."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import httpx
import openai
import pytest
import ray
from ray import serve

from deploy.ray_serve import PrefixRouter, chunk_keys, prompt_text
from tests.fakes import make_tokenizer
from tests.tiny import tiny_hf

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    """The proxy's URL, two engine replicas serving a tiny random pair behind it."""
    from deploy.ray_serve import build_app

    root, tokenizer = tmp_path_factory.mktemp("pair"), make_tokenizer()
    for name, seed, layers in (("target", 0, 4), ("draft", 1, 1)):  # big enough that a stream lasts a while
        hf = tiny_hf("qwen2", seed=seed, vocab=len(tokenizer), layers=layers, hidden=256, intermediate=512)
        hf.config.eos_token_id = tokenizer.eos_token_id
        hf.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    args = ["--model", str(root / "target"), "--draft-model", str(root / "draft"), "--dtype", "fp32",
            "--served-model-name", MODEL, "--max-model-len", "512", "--max-batch", "4", "--tree", "2,1",
            "--threads", "1", "--no-load-aware"]
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args, replicas=2, cpus_per_replica=1, imbalance=2, pin=True), name="mcsd", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def chat(url: str, messages: list[dict], **kw):
    """The response and the replica that served it."""
    raw = oai(url).chat.completions.with_raw_response.create(model=MODEL, messages=messages, temperature=0,
                                                             max_tokens=kw.pop("max_tokens", 8), **kw)
    return raw.parse(), raw.headers["x-mcsd-replica"]


def running_replicas() -> int:
    states = serve.status().applications["mcsd"].deployments["EngineReplica"].replica_states
    return states.get("RUNNING", 0)


def replica_actor(replica: str):
    from ray.serve._private.common import REPLICA_ID_FULL_ID_STR_PREFIX

    return ray.get_actor(f"{REPLICA_ID_FULL_ID_STR_PREFIX}mcsd#EngineReplica#{replica}", namespace="serve")


@pytest.mark.slow
def test_the_openai_api_and_streams_pass_through_the_proxy(proxy):
    client = oai(proxy)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(proxy + "/health").status_code == 200
    whole = client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    parts = list(client.completions.create(model=MODEL, prompt="the quick brown fox", max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in parts) == whole.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"
    bad = httpx.post(proxy + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
    assert "mcsd:" in httpx.get(proxy + "/metrics").text


@pytest.mark.slow
def test_requests_spread_and_a_conversation_keeps_its_replica(proxy):
    """Different conversations land on both replicas; each conversation's later turns go where its
    first did, and find their earlier turns in that replica's prefix cache."""
    conversations = [[{"role": "system", "content": f"You are assistant number {i}, brief and exact. " * 4},
                      {"role": "user", "content": f"Question {i}: what is the colour of the sky at noon?"}]
                     for i in range(8)]
    homes = {}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        firsts = list(pool.map(lambda m: chat(proxy, m, max_tokens=12, extra_body={"ignore_eos": True}),
                               conversations))
    for i, (resp, replica) in enumerate(firsts):
        homes[i] = replica
        conversations[i] += [{"role": "assistant", "content": resp.choices[0].message.content},
                             {"role": "user", "content": "And at midnight?"}]
    assert len(set(homes.values())) == 2  # spread over both
    for i, messages in enumerate(conversations):
        resp, replica = chat(proxy, messages, extra_body={"ignore_eos": True})
        assert replica == homes[i]
        assert resp.usage.prompt_tokens_details.cached_tokens >= firsts[i][0].usage.prompt_tokens - 4


@pytest.mark.slow
def test_a_killed_replica_fails_its_own_clients_only_and_comes_back(proxy):
    # long streams, three on each replica (prompts whose homes differ; a prompt keeps its home)
    streams: dict[str, list] = {}
    for i in range(40):
        messages = [{"role": "user", "content": f"story {i}: " + "tell me a long one about foxes and dogs. " * 4}]
        _, home = chat(proxy, messages, max_tokens=1)
        if len(streams.setdefault(home, [])) < 3:
            streams[home].append(messages)
        if len(streams) == 2 and all(len(v) == 3 for v in streams.values()):
            break
    assert len(streams) == 2 and all(len(v) == 3 for v in streams.values())
    victim, survivor = list(streams)
    jobs = [(home, m) for home in (victim, survivor) for m in streams[home]]
    started = [threading.Event() for _ in jobs]

    def consume(i, messages):
        try:
            finish = None
            for chunk in oai(proxy).chat.completions.create(model=MODEL, messages=messages, max_tokens=300,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True}):
                if chunk.choices:
                    started[i].set()
                    finish = chunk.choices[0].finish_reason or finish
            return "done", finish
        except openai.APIError as exc:
            return "error", str(exc)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(consume, i, m) for i, (_, m) in enumerate(jobs)]
        assert all(e.wait(60) for e in started)  # every stream is under way
        ray.kill(replica_actor(victim), no_restart=True)
        outcomes = [f.result(timeout=120) for f in futures]
    assert outcomes[3:] == [("done", "length")] * 3  # the survivor's streams are whole: none lost
    assert [o[0] for o in outcomes[:3]] == ["error"] * 3  # the victim's clients got an error, not a hang
    replica_actor(survivor)  # still there
    with pytest.raises(ValueError):
        replica_actor(victim)
    killed = time.monotonic()
    while time.monotonic() < killed + 60 and running_replicas() < 2:
        time.sleep(0.5)
    assert running_replicas() == 2  # Ray replaced it within 60 s
    print(f"replica back after {time.monotonic() - killed:.1f} s")
    served, i = set(), 0
    while time.monotonic() < killed + 90 and len(served) < 2:  # the router learns of it, and uses it
        served.add(chat(proxy, [{"role": "user", "content": f"are you back? {i} " * 8}], max_tokens=2)[1])
        i += 1
    assert len(served) == 2 and victim not in served


def test_prompt_text_and_its_keys():
    chat_body = b'{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}'
    assert prompt_text(chat_body) == "system: be brief\nuser: hi\n"
    assert prompt_text(b'{"prompt": ["abc", "def"]}') == "abc"
    assert prompt_text(b"not json") == prompt_text(b"[1, 2]") == prompt_text(b'{"prompt": [1, 2]}') == ""
    short, longer = "a" * 130, "a" * 130 + "b" * 70
    assert chunk_keys(short) == chunk_keys(longer)[:2] and len(chunk_keys(longer)) == 3
    assert chunk_keys("x" * 63) == []


class _Replica:
    def __init__(self, rid: str) -> None:
        self.replica_id = rid
        self.max_ongoing_requests = 16


class _Pending:
    def __init__(self, prompt: str) -> None:
        from deploy.ray_serve import Forwarded

        self.args = [Forwarded("POST", "/v1/completions", "", [], b"", prompt)]


class _Queue(dict):
    def get(self, key, default=None):  # the queue-length cache's interface
        return super().get(key, default)


def test_the_router_prefers_the_longest_prefix_unless_that_replica_is_busy():
    import asyncio

    router = PrefixRouter.__new__(PrefixRouter)  # its routing logic alone, without a Serve controller
    router.initialize_state(imbalance=2, min_share=0.5, min_chars=1024)
    queue = _Queue()
    type(router).replica_queue_len_cache = property(lambda self: queue)
    a, b = _Replica("a"), _Replica("b")
    system = "s" * 256
    router.on_request_routed(_Pending(system + "first question"), "a", None)
    ranks = asyncio.run(router.choose_replicas([a, b], _Pending(system + "another question")))
    assert ranks == [[a], [b]]
    queue.update(a=5, b=0)  # a's queue is 5 longer: the match yields to the load
    assert asyncio.run(router.choose_replicas([a, b], _Pending(system + "x"))) == [[b], [a]]
    assert asyncio.run(router.choose_replicas([a, b], _Pending("no match at all " * 8))) == [[b], [a]]
    queue.update(a=0)  # a short common opening is no match: any replica, Ray takes the least loaded
    opening = "Complete the following Python function:\n" * 2
    router.on_request_routed(_Pending(opening + "def f(): " * 30), "a", None)
    ranks = asyncio.run(router.choose_replicas([a, b], _Pending(opening + "def g(): " * 30)))
    assert len(ranks[0]) == 2 and set(ranks[0]) == {a, b}
    assert len(asyncio.run(router.choose_replicas([a, b], _Pending("short")))[0]) == 2  # no text to match: any
