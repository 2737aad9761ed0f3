"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP.

Uses the bundled demo model when it is present, else a tiny random qwen3_moe with a real
tokenizer (random weights: the text is gibberish, but every check here is about equality,
shape and bookkeeping, not meaning). MOERUN_TEST_SERVER_MODEL=DIR picks another model.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

import moerun  # noqa: E402
from moerun.engine.llm import DEMO_MODEL  # noqa: E402
from moerun.server import create_app  # noqa: E402

from conftest import make_tiny_model  # noqa: E402

KEY = "sekrit-key"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    override = os.environ.get("MOERUN_TEST_SERVER_MODEL")  # e.g. a checkpoint exported mid-training
    if override:
        path = Path(override)
    elif (DEMO_MODEL / "config.json").is_file():
        path = DEMO_MODEL
    else:
        path = tmp_path_factory.mktemp("tiny")
        make_tiny_model(path, max_position_embeddings=512)
    return moerun.load(path, dtype="float32", threads=1)


LIVE = []  # the apps of the servers running now


def books_balance(app, timeout: float = 30.0) -> None:
    """The scheduler's invariant, once the server is idle: free slots + running = slots."""
    sched = app.state.server.scheduler
    deadline = time.time() + timeout
    while sched.running or sched.queue_depth:
        assert time.time() < deadline, f"the server did not go idle: {sched.running} running"
        time.sleep(0.02)
    sched.check()


@pytest.fixture(autouse=True)
def slot_books():
    """After every test, every running server's slot books balance."""
    yield
    for app in list(LIVE):
        books_balance(app)


@contextmanager
def running_server(llm, **kw):
    """uvicorn in a background thread on a socket bound beforehand (no port race)."""
    app = create_app(llm, **kw)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.02)
    LIVE.append(app)
    try:
        yield f"http://127.0.0.1:{port}", app.state.server.model_name
    finally:
        LIVE.remove(app)
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="module")
def server(llm):
    # a small prefill budget, so that prompts go in as chunks between decode steps
    with running_server(llm, max_concurrency=16, max_queue=8, prefill_budget=48) as s:
        yield s


@pytest.fixture(scope="module")
def guarded(llm):
    """One slot, one place in the queue, and an API key: for 401 and 429."""
    with running_server(llm, api_key=KEY, max_concurrency=1, max_queue=1) as s:
        yield s


def client(base, key="unused"):
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


def metric(base, name):
    text = httpx.get(base + "/metrics").text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def wait_idle(base, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = httpx.get(base + "/health").json()
        if h["running"] == 0 and h["queued"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"the server still has work after {timeout} s: {h}")


def chat(c, model, text, **kw):
    kw.setdefault("max_tokens", 12)
    return c.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], **kw)


def check_error(resp, status, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


# -- endpoints -------------------------------------------------------------------------


def test_models_health_metrics(server, llm):
    base, model = server
    c = client(base)
    models = c.models.list().data
    assert [m.id for m in models] == [model] and models[0].owned_by == "moerun"
    assert c.models.retrieve(model).id == model
    assert httpx.get(base + "/health").json()["status"] == "ok"

    class FakeStore:
        def stats(self):
            return {"expert_hit_rate": 0.75, "stall_s": 1.5, "policy": "lru", "emulated": True}

    llm.expert_store = FakeStore()
    try:
        text = httpx.get(base + "/metrics").text
    finally:
        del llm.expert_store
    for name in ("moerun_requests_total", "moerun_prompt_tokens_total", "moerun_generation_tokens_total",
                 "moerun_generation_tokens_per_second", "moerun_queue_depth", "moerun_running_requests"):
        assert f"\n{name}" in text, name
    assert "moerun_expert_store_expert_hit_rate 0.75" in text and "moerun_expert_store_stall_s 1.5" in text
    assert "expert_store_policy" not in text and "expert_store_emulated" not in text


def test_chat_completion(server):
    base, model = server
    r = chat(client(base), model, "Say hello.", temperature=0)
    assert r.object == "chat.completion" and r.model == model
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 1 <= r.usage.completion_tokens <= 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_reassembles_to_the_same_text(server):
    base, model = server
    c = client(base)
    kw = dict(temperature=0.9, top_p=0.95, seed=1234, max_completion_tokens=16, extra_body={"ignore_eos": True})
    plain = chat(c, model, "Tell me a story.", **kw)
    chunks = list(chat(c, model, "Tell me a story.", stream=True, stream_options={"include_usage": True}, **kw))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == plain.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [plain.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert all(ch.usage is None for ch in chunks[:-1])
    # a different seed gives a different continuation (sampling honours the seed)
    other = chat(c, model, "Tell me a story.", **{**kw, "seed": 99, "temperature": 1.5})
    assert other.choices[0].message.content != plain.choices[0].message.content


def test_completions_plain_stream_and_stop(server):
    base, model = server
    c = client(base)
    plain = c.completions.create(model=model, prompt="def add(a, b):", max_tokens=10, temperature=0)
    text = plain.choices[0].text
    assert plain.object == "text_completion" and plain.usage.prompt_tokens > 0
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model=model, prompt="def add(a, b):", max_tokens=10, temperature=0, stream=True) if ch.choices)
    assert streamed == text
    if len(text.strip()) >= 4:
        i = len(text) - len(text.lstrip()) + 2
        stop = text[i : i + 2]
        cut = c.completions.create(model=model, prompt="def add(a, b):", max_tokens=10, temperature=0, stop=[stop])
        assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"


def test_long_prompt_prefilled_in_chunks_matches_the_engine(server, llm):
    base, model = server
    prompt = "The quick brown fox jumps over the lazy dog. " * 12  # several prefill chunks
    ids = llm.encode_prompt(prompt)
    assert len(ids) > 3 * 48 and len(ids) + 8 < llm.context_length
    r = client(base).completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(ids)
    wait_idle(base)
    ref = "".join(llm.generate(prompt, max_tokens=8, temperature=0.0))  # one full prefill, plain loop
    assert r.choices[0].text == ref
    assert r.usage.completion_tokens == llm.last_stats.generated_tokens


# -- errors ----------------------------------------------------------------------------


def test_errors_in_openai_shape_and_server_keeps_serving(server, llm):
    base, model = server
    url = base + "/v1/chat/completions"
    good = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    check_error(httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}), 400, "invalid_json")
    check_error(httpx.post(url, json=[1, 2]), 400)
    err = check_error(httpx.post(url, json={**good, "max_tokens": "many"}), 400)
    assert err["param"] == "max_tokens"
    check_error(httpx.post(url, json={**good, "messages": "hi"}), 400)
    check_error(httpx.post(url, json={**good, "temperature": -1}), 400)
    check_error(httpx.post(url, json={**good, "stop": 5}), 400)
    check_error(httpx.post(base + "/v1/completions", json={"model": model, "prompt": {"a": 1}}), 400)
    err = check_error(httpx.post(url, json={**good, "model": "no-such-model"}), 404, "model_not_found")
    assert err["param"] == "model"
    long_prompt = "hello world " * (llm.context_length + 10)
    check_error(httpx.post(url, json={**good, "messages": [{"role": "user", "content": long_prompt}]}),
                400, "context_length_exceeded")
    check_error(httpx.get(base + "/v1/nothing-here"), 404)

    c = client(base)
    with pytest.raises(openai.NotFoundError):
        chat(c, "no-such-model", "hi")
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=model, prompt="hello world " * (llm.context_length + 10), max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    assert chat(c, model, "still there?", max_tokens=3).choices[0].message.content is not None
    wait_idle(base)


def test_speculative_server_matches_the_batched_one(server, llm):
    """`--speculative mtp`: greedy completions (plain and streamed, stop strings and length
    included) equal the batched server's; requests run one at a time, concurrent ones queue;
    a model without an MTP head is refused at start."""
    if not getattr(llm.net, "has_mtp", False):
        pytest.skip("the test model has no MTP head")
    base, model = server
    prompts = ["def add(a, b):", "The os module provides", "import sys\n"]
    want = [client(base).completions.create(model=model, prompt=p, max_tokens=20, temperature=0) for p in prompts]
    with running_server(llm, speculative="mtp", draft_tokens=2, max_concurrency=8) as (sbase, smodel):
        c = client(sbase)
        with ThreadPoolExecutor(3) as pool:  # arrive together: served one after the other
            got = list(pool.map(lambda p: c.completions.create(model=smodel, prompt=p, max_tokens=20, temperature=0),
                                prompts))
        for g, w in zip(got, want):
            assert g.choices[0].text == w.choices[0].text and g.choices[0].finish_reason == w.choices[0].finish_reason
            assert g.usage.completion_tokens == w.usage.completion_tokens
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model=smodel, prompt=prompts[0], max_tokens=20, temperature=0, stream=True) if ch.choices)
        assert streamed == want[0].choices[0].text
        assert wait_idle(sbase)["running"] == 0
        assert metric(sbase, "moerun_generation_tokens_total") >= sum(w.usage.completion_tokens for w in want)
        # the speculative loop ran them: drafts checked, some accepted, no batched decode steps
        assert 0 < metric(sbase, "moerun_accepted_draft_tokens_total") <= metric(sbase, "moerun_draft_tokens_total")
        assert metric(sbase, "moerun_verification_steps_total") > 0 and not metric(sbase, "moerun_decode_steps_total")
    from moerun.errors import MoerunError
    from moerun.server import create_app

    with pytest.raises(MoerunError, match="draft_tokens"):
        create_app(llm, speculative="mtp", draft_tokens=9)


def test_api_key_and_overload(guarded):
    base, model = guarded
    url = base + "/v1/chat/completions"
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    check_error(httpx.post(url, json=body), 401, "invalid_api_key")
    check_error(httpx.get(base + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        chat(client(base, "wrong-key"), model, "hi")
    c = client(base, KEY)
    assert chat(c, model, "hi", max_tokens=2).usage.completion_tokens >= 1

    # one request runs, one waits; the next is refused with 429 until they are gone
    long = {**body, "max_tokens": 10_000, "stream": True, "ignore_eos": True}
    hdr = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=base, headers=hdr, timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json=long) as first:
            assert first.status_code == 200
            first_lines = first.iter_lines()  # kept: closing this iterator closes the connection
            next(first_lines)
            with h.stream("POST", "/v1/chat/completions", json=long) as second:
                deadline = time.time() + 30
                while httpx.get(base + "/health").json()["queued"] < 1:
                    assert time.time() < deadline
                    time.sleep(0.02)
                with pytest.raises(openai.RateLimitError) as e:
                    chat(c, model, "hi", max_tokens=2)
                assert e.value.status_code == 429
                assert second.status_code == 200
    wait_idle(base)
    assert chat(c, model, "back to normal", max_tokens=2).usage.completion_tokens >= 1


# -- concurrency -----------------------------------------------------------------------


def _stream_text(base, model, prompt, max_tokens):
    c = client(base)
    pieces = []
    for ch in chat(c, model, prompt, max_tokens=max_tokens, temperature=0, stream=True):
        if ch.choices:
            pieces.append(ch.choices[0].delta.content or "")
    return "".join(pieces)


def test_sixteen_concurrent_streams_match_one_at_a_time(server):
    base, model = server
    prompts = [f"Request number {i}: tell me about topic {i * 7 % 13}." for i in range(16)]
    c = client(base)
    alone = [chat(c, model, p, max_tokens=12, temperature=0).choices[0].message.content for p in prompts]
    wait_idle(base)
    steps0 = metric(base, "moerun_decode_batch_size_count") or 0
    single0 = metric(base, 'moerun_decode_batch_size_bucket{le="1.0"}') or 0
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda p: _stream_text(base, model, p, 12), prompts))
    assert together == alone
    # the requests really were decoded together: some steps ran several slots at once
    steps = metric(base, "moerun_decode_batch_size_count") - steps0
    single = metric(base, 'moerun_decode_batch_size_bucket{le="1.0"}') - single0
    assert steps > single
    wait_idle(base)


def test_client_disconnect_cancels_and_frees_the_slot(server):
    base, model = server
    cancelled0 = metric(base, "moerun_cancelled_requests_total")
    body = {"model": model, "messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 400,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
    wait_idle(base, timeout=20)
    assert metric(base, "moerun_cancelled_requests_total") == cancelled0 + 1
    # a non-streaming client that gives up (read timeout) is noticed too: 1500 tokens take
    # the demo model 0.75 s or more (2000 tok/s, its fastest on a Zen 4 core pair), 3x the
    # client's patience
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 1500},
                   timeout=httpx.Timeout(60, read=0.25))
    wait_idle(base, timeout=20)
    assert metric(base, "moerun_cancelled_requests_total") == cancelled0 + 2
    r = chat(client(base), model, "and now?", max_tokens=4)
    assert r.usage.completion_tokens >= 1


# -- chat page -------------------------------------------------------------------------


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (fds 3 and 4), so the
    test needs no WebDriver and no websocket library."""

    def __init__(self, browser, profile):
        import os

        to_child_r, self._w = os.pipe()
        self._r, from_child_w = os.pipe()
        os.dup2(to_child_r, 50)
        os.dup2(from_child_w, 51)
        os.close(to_child_r)
        os.close(from_child_w)

        def child_fds():
            os.dup2(50, 3)
            os.dup2(51, 4)

        self.proc = subprocess.Popen(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--user-data-dir={profile}", "--window-size=900,640", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=False, preexec_fn=child_fds,
        )
        os.close(50)
        os.close(51)
        self._buf = b""
        self._id = 0
        self.session = None

    def call(self, method, timeout=60, **params):
        import os
        import select

        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise AssertionError(f"{method}: {reply['error']}")
                    return reply["result"]
            left = deadline - time.time()
            assert left > 0, f"Chromium did not answer {method}"
            if select.select([self._r], [], [], left)[0]:
                data = os.read(self._r, 1 << 20)
                assert data, "Chromium exited"
                self._buf += data

    def open(self, url):
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def eval(self, expression):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self):
        import os

        try:
            self.call("Browser.close", timeout=10)
        except Exception:  # noqa: BLE001 - it is going away either way
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)


def test_chat_page_streams_in_headless_chromium(server, tmp_path):
    import base64

    base, model = server
    page = httpx.get(base + "/")
    assert page.status_code == 200 and "moerun chat" in page.text
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium)")
    gen0 = metric(base, "moerun_generation_tokens_total")
    chrome = Chromium(browser, tmp_path / "profile")
    try:
        chrome.open(base + "/?q=Hello%20there")
        deadline = time.time() + 120
        state = ""
        while state != "1":
            assert time.time() < deadline, "the reply did not finish streaming in the page"
            time.sleep(0.2)
            state = chrome.eval("(document.querySelector('.msg.assistant') || {dataset: {}}).dataset.done || ''")
            assert state != "error", chrome.eval("document.querySelector('.msg.assistant').textContent")
        assert chrome.eval("document.querySelector('.msg.user').textContent") == "Hello there"
        assert chrome.eval("document.getElementById('model').textContent") == model
        reply = chrome.eval("document.querySelector('.msg.assistant').textContent")
        png = base64.b64decode(chrome.call("Page.captureScreenshot", format="png")["data"])
    finally:
        chrome.close()
    assert metric(base, "moerun_generation_tokens_total") > gen0
    assert isinstance(reply, str)
    shot = tmp_path / "chat.png"
    shot.write_bytes(png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    print(f"chat page screenshot: {shot}")


def test_bad_seeds_fail_alone_and_leak_nothing(server, llm):
    """A seed outside the generator's domain is a 400 (at validation, and, should one reach
    the scheduler, as an error for that request alone: its slot never taken); a stream
    running meanwhile is untouched, and the server then answers as before."""
    from moerun.engine.sampling import SamplingParams
    from moerun.server.scheduler import Scheduler

    base, model = server
    url = base + "/v1/chat/completions"
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 1.0}
    c = client(base)
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(lambda: "".join(ch.choices[0].delta.content or "" for ch in chat(
            c, model, "a long story", max_tokens=48, temperature=0.0, stream=True)))
        for seed in (2**64, 2**70, -1):
            err = check_error(httpx.post(url, json={**body, "seed": seed}), 400)
            assert err["param"] == "seed"
        streamed = stream.result(timeout=120)
    assert streamed == chat(c, model, "a long story", max_tokens=48, temperature=0.0).choices[0].message.content
    h = wait_idle(base)
    assert h["running"] == 0

    # past validation, in the scheduler itself: the request alone gets an error event
    sched = Scheduler(llm, max_concurrency=2, max_queue=4)
    try:
        good = SamplingParams(max_tokens=3, temperature=0.0)
        bad = SamplingParams(max_tokens=3, temperature=1.0)
        object.__setattr__(bad, "seed", 2**70)  # (SamplingParams refuses it; a bug elsewhere might not)

        async def go():
            reqs = [sched.submit([1, 2, 3], p) for p in (bad, good, bad)]
            return [[ev.kind for ev in await _drain(r)] for r in reqs]

        kinds = asyncio.run(go())
        assert kinds[0] == ["error"] and kinds[2] == ["error"] and kinds[1][-1] == "done"
        assert sched.running == 0 and len(sched.free) == 2
    finally:
        sched.close()


async def _drain(req, timeout=60.0):
    """A scheduler request's events up to its last (done or error)."""
    out = []
    while not out or out[-1].kind not in ("done", "error"):
        out.append(await asyncio.wait_for(req.events.get(), timeout))
    return out
