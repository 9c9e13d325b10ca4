"""Images through `pagedllm serve` (issue 29), driven by the real `openai` client: a data-URL
image, an http URL and an allowed local file give the offline LLM's answer (Gemma 3; Qwen2.5-VL
for data URLs); bad images and places images may not come from are each a 400 that says what
was wrong, and leave no KV block or request behind."""

from __future__ import annotations

import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from models import build_checkpoint, build_vlm_checkpoint
from test_server import serving, wait_idle
from test_vlm import _image

# slow: whole models, servers or builds; `make test-fast` leaves it out
pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
MAX_TOKENS = 12
QUESTION = "What is in this picture?"


def _png(im) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _messages(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


class _Files(BaseHTTPRequestHandler):
    """Serves /img.png, and /slow.png only after a long wait (a URL that times out)."""

    png = b""

    def do_GET(self):  # noqa: N802
        if self.path == "/slow.png":
            time.sleep(6)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.png)))
        self.end_headers()
        try:
            self.wfile.write(self.png)
        except OSError:
            pass

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def setup(tmp_path_factory, hf_smollm2_tokenizer):
    from pagedllm import LLM, SamplingParams

    root = tmp_path_factory.mktemp("vlm-serve")
    path = build_vlm_checkpoint("gemma3", root / "model", hf_smollm2_tokenizer)
    media = root / "media"
    media.mkdir()
    images = [_image(10, 96, 80), _image(11, 60, 120)]
    (media / "a.png").write_bytes(_png(images[1]))
    (root / "outside.png").write_bytes(_png(images[1]))
    _Files.png = _png(images[0])
    files = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16, allowed_local_media_path=str(media))
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [llm.chat(_messages(_data_url(_png(im))), sp, use_tqdm=False).outputs[0].text for im in images]
    assert want[0] != want[1], "the two images must lead to different answers"
    yield path, root, media, images, f"http://127.0.0.1:{files.server_port}", want
    files.shutdown()


@pytest.fixture(scope="module")
def server(tmp_path_factory, setup):
    path, _, media, *_ = setup
    yield from serving(
        tmp_path_factory,
        "vlm-serve",
        [
            str(path),
            "--dtype",
            "float32",
            "--pa-gpu-mem",
            "16",
            "--allowed-local-media-path",
            str(media),
            "--limit-mm-per-prompt",
            "2",
            "--media-fetch-timeout",
            "1",
            "--log-level",
            "info",
        ],
    )


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)


def _ask(client, messages) -> str:
    r = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return r.choices[0].message.content


def test_data_url_http_url_and_local_file_give_the_offline_answer(client, setup, server):
    _, _, media, images, base, want = setup
    assert _ask(client, _messages(_data_url(_png(images[0])))) == want[0]
    assert _ask(client, _messages(f"{base}/img.png")) == want[0]
    assert _ask(client, _messages(str(media / "a.png"))) == want[1]
    assert _ask(client, _messages(f"file://{media / 'a.png'}")) == want[1]
    wait_idle(server.get())


def _bad(client, messages, match: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, messages)
    assert e.value.status_code == 400
    assert match in str(e.value), str(e.value)


def test_bad_images_are_400_and_leave_nothing(client, setup, server, tmp_path):
    from PIL import Image

    _, root, media, images, base, want = setup
    _bad(client, _messages(_data_url(b"this is not an image at all")), "not a readable image")
    png = _png(images[0])
    _bad(client, _messages(_data_url(png[: len(png) // 2])), "corrupt or truncated")
    bomb = io.BytesIO()
    Image.new("1", (12000, 12000)).save(bomb, format="PNG")  # 144 M pixels in a few kB
    _bad(client, _messages(_data_url(bomb.getvalue())), "over the limit of")
    _bad(client, _messages(*[_data_url(png)] * 3), "at most 2")
    _bad(client, _messages(str(root / "outside.png")), "outside the allowed media directory")
    _bad(client, _messages(str(media / ".." / "outside.png")), "outside the allowed media directory")
    t0 = time.time()
    _bad(client, _messages(f"{base}/slow.png"), "1 s")
    assert time.time() - t0 < 5
    srv = server.get()
    m = wait_idle(srv)
    assert m["pagedllm_kv_blocks_used"] == 0
    assert _ask(client, _messages(_data_url(png))) == want[0]  # and it still answers


def test_image_to_a_text_only_model_is_400(tmp_path_factory, hf_smollm2_tokenizer, setup):
    _, root, _, images, _, _ = setup
    text = build_checkpoint("llama", root / "text", hf_smollm2_tokenizer, len(hf_smollm2_tokenizer))
    gen = serving(tmp_path_factory, "text-serve", [str(text), "--dtype", "float32", "--pa-gpu-mem", "16"])
    srv = next(gen)
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
        _bad(c, _messages(_data_url(_png(images[0]))), "text-only")
        wait_idle(srv.get())
    finally:
        gen.close()


def test_qwen2_5_vl_data_url_gives_the_offline_answer(tmp_path_factory, hf_smollm2_tokenizer):
    """A Qwen2.5-VL folder served: two images of different sizes (so different token counts and
    M-RoPE grids), each sent as a data URL by the openai client, get the offline LLM's answers."""
    from pagedllm import LLM, SamplingParams

    root = tmp_path_factory.mktemp("qwen-vl-serve")
    path = build_vlm_checkpoint("qwen2_5_vl", root / "model", hf_smollm2_tokenizer)
    images = [_image(10, 96, 80), _image(11, 60, 120)]
    llm = LLM(str(path), dtype="float32", kv_cache_memory_mb=16)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [llm.chat(_messages(_data_url(_png(im))), sp, use_tqdm=False).outputs[0].text for im in images]
    assert want[0] != want[1], "the two images must lead to different answers"
    del llm
    gen = serving(tmp_path_factory, "qwen-vl-serve", [str(path), "--dtype", "float32", "--pa-gpu-mem", "16"])
    srv = next(gen)
    try:
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=300)
        assert [_ask(c, _messages(_data_url(_png(im)))) for im in images] == want
        wait_idle(srv.get())
    finally:
        gen.close()


def test_chat_page_attaches_an_image(server, setup, tmp_path):
    """The chat page at GET / in headless Chromium: a picture attached with the file input goes
    with the question as an image_url part, shows in the conversation, and the answer is the
    offline LLM's for the same image and words."""
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not (chromium and shutil.which("chromedriver")):
        pytest.skip("Debian's chromium and chromium-driver are not installed (make setup installs them)")
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    _, _, _, images, _, want = setup
    pic = tmp_path / "pic.png"
    pic.write_bytes(_png(images[0]))
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(arg)
    drv = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        drv.get(server.get().url + "/")
        find = lambda css: drv.find_element(By.CSS_SELECTOR, css)  # noqa: E731
        for css, value in (("#temperature", "0"), ("#max_tokens", str(MAX_TOKENS))):
            find(css).clear()
            find(css).send_keys(value)
        find("#image").send_keys(str(pic))
        t0 = time.time()
        while not drv.find_elements(By.CSS_SELECTOR, "#preview img") and time.time() - t0 < 30:
            time.sleep(0.1)
        find("#input").send_keys(QUESTION, Keys.ENTER)
        t0 = time.time()
        while time.time() - t0 < 240:
            done = drv.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]")
            if done:
                break
            time.sleep(0.2)
        assert done and done[0].get_attribute("data-done") == "finished", find("#error").text
        assert drv.find_elements(By.CSS_SELECTOR, ".msg.user img")  # the picture is in the conversation
        assert not drv.find_elements(By.CSS_SELECTOR, "#preview img")  # and no longer attached
        sent, answer = drv.execute_script("return history")
        assert sent["content"][0]["type"] == "image_url" and sent["content"][1]["text"] == QUESTION
        assert answer["content"] == want[0]
    finally:
        drv.quit()
    wait_idle(server.get())
