"""Images over HTTP (``server.images``) to a served tiny Qwen3.5 with its vision tower, on the real
stack (uvicorn, loopback sockets, the ``openai`` SDK): OpenAI ``image_url`` chat parts, SGLang's
``/generate`` ``image_data``, ``/v1/logprobs`` ``images`` and verl's ``multi_modal_data``. The
numbers are the library's, bitwise (one deterministic ``Scorer`` serves both); every bad image is
a 400 naming the item, and the server answers afterwards.

The checkpoint is ``test_qwen3_5_images``'s (vision depth 2, hidden 32, patch 8, merge 2): a
32 x 48 image is a grid (1, 4, 6), 6 image tokens.
"""

from __future__ import annotations

import base64
import http.server
import struct
import threading
import zlib

import pytest
import requests
from server_util import serve

from logprobe import LogprobeError, Scorer
from logprobe.server import ServerConfig, create_app

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL.Image")
openai = pytest.importorskip("openai")
from test_qwen3_5_images import IMAGE_ID, PAD, _image, _png, save_vl_checkpoint  # noqa: E402

PNG = _png(_image(32, 48, 1))
URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
OTHER = _png(_image(48, 48, 2))


@pytest.fixture(scope="module")
def vl_scorer(tmp_path_factory):
    d = tmp_path_factory.mktemp("served-qwen3_5")
    save_vl_checkpoint(d)
    return Scorer(str(d), device="cpu", dtype="float32", progress=False, deterministic=True)


@pytest.fixture(scope="module")
def server(vl_scorer):
    with serve(create_app(vl_scorer, ServerConfig(max_images_per_request=3, max_image_pixels=64 * 64))) as url:
        yield url


def chat(content: list, answer: str = "A noisy square.") -> list[dict]:
    return [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, timeout=120)


def refused(r: requests.Response) -> str:
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


def prompt_ids(scorer) -> list[int]:
    ids = scorer.tokenizer.encode(f"Look: {PAD} what is it?")
    assert ids.count(IMAGE_ID) == 1
    return ids


def test_chat_image_url_parts_through_the_sdk(server, vl_scorer):
    """OpenAI image_url parts (data: URLs) through the SDK: Scorer.score_chat's numbers, bitwise."""
    messages = chat([{"type": "text", "text": "What is "}, {"type": "image_url", "image_url": {"url": URL}},
                     {"type": "text", "text": "?"}])
    want = vl_scorer.score_chat(messages)
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=0,
                                       logprobs=True, extra_body={"echo": True})
    got = r.choices[0].logprobs.content
    assert [t.logprob for t in got] == want.token_logprobs  # bitwise
    assert r.usage.prompt_tokens > 6 + want.num_tokens  # the image's 6 tokens counted
    other = chat([{"type": "text", "text": "What is "},
                  {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(OTHER).decode()}},
                  {"type": "text", "text": "?"}])
    r2 = client.chat.completions.create(model=r.model, messages=other, max_tokens=0, logprobs=True,
                                        extra_body={"echo": True})
    assert [t.logprob for t in r2.choices[0].logprobs.content] != want.token_logprobs  # the image was seen


def test_logprobs_and_generate_with_images_match_the_library(server, vl_scorer):
    """/v1/logprobs ``images`` and verl's ``multi_modal_data`` (bare base64), and SGLang's
    /generate ``image_data`` over ids with the image token once or expanded: Scorer.logprobs's
    numbers, bitwise."""
    prompt = prompt_ids(vl_scorer)
    completion = vl_scorer.tokenizer.encode(" A red square.")
    want = vl_scorer.logprobs([{"prompt_token_ids": prompt, "completion_token_ids": completion,
                                "images": [PNG]}])[0].logprobs.tolist()
    seq = {"prompt_token_ids": prompt, "completion_token_ids": completion}
    r = post(server, "/v1/logprobs", {"sequences": [seq, dict(seq, images=[URL]),
                                                    dict(seq, multi_modal_data={"image": [base64.b64encode(PNG).decode()]})]})
    assert r.status_code == 200, r.text
    got = [x["logprobs"] for x in r.json()["results"]]
    assert got[1] == want and got[2] == want and got[0] != want  # the text alone differs
    expanded, _, _ = vl_scorer.context.images.prompt_ids(prompt, [PNG], "x")
    assert len(expanded) == len(prompt) + 5  # one token -> 6
    for ids in (prompt, expanded):
        body = {"input_ids": [ids + completion], "image_data": [URL], "return_logprob": True,
                "logprob_start_len": len(expanded) - 1, "sampling_params": {"max_new_tokens": 0}}
        r = post(server, "/generate", body)
        assert r.status_code == 200, r.text
        meta = r.json()[0]["meta_info"]
        assert meta["prompt_tokens"] == len(expanded) + len(completion)
        assert [e[0] for e in meta["input_token_logprobs"][1:]] == want
    # text with the placeholder: tokenized, then expanded (the ids' numbers again)
    text = vl_scorer.tokenizer.decode(prompt + completion)
    assert vl_scorer.tokenizer.encode(text) == prompt + completion and not vl_scorer.tokenizer.add_bos
    r = post(server, "/generate", {"text": text, "image_data": URL, "return_logprob": True,
                                   "logprob_start_len": len(expanded) - 1})
    assert [e[0] for e in r.json()["meta_info"]["input_token_logprobs"][1:]] == want, r.text
    # a batch: one entry per input (null: no images); entries before the last image are refused
    body = {"input_ids": [prompt + completion, prompt + completion], "image_data": [None, [URL]],
            "return_logprob": True, "logprob_start_len": 0}
    assert refused(post(server, "/generate", body)) == "logprob_start_len"


def test_score_with_images_matches_the_library(server, vl_scorer):
    """/v1/score ``images`` (a multiple-choice question about an image): Scorer.score's numbers,
    bitwise; another image gives others."""
    prompt, answers = f"Look: {PAD} what is it?", [" A square.", " A cat."]
    want = [r.to_dict() for r in vl_scorer.score(prompt, answers, images=[PNG])]
    r = post(server, "/v1/score", {"prompt": prompt, "continuations": answers, "images": [URL]})
    assert r.status_code == 200, r.text
    assert r.json()["results"] == want  # bitwise
    other = "data:image/png;base64," + base64.b64encode(OTHER).decode()
    r = post(server, "/v1/score", {"prompt": prompt, "continuations": answers, "images": [other]})
    assert [x["token_logprobs"] for x in r.json()["results"]] != [w["token_logprobs"] for w in want]


SCORE = {"prompt": f"Look: {PAD} what is it?", "continuations": [" A square."]}


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/score", dict(SCORE, images=["https://example.com/a.png"]), "images[0]", "fetches no images"),
    ("/v1/score", dict(SCORE, images=["/etc/passwd"]), "images[0]", "reads no files"),
    ("/v1/score", dict(SCORE, prompt=PAD * 4, images=[URL] * 4), "images[3]", "limit of 3"),
    ("/v1/score", dict(SCORE, images=["data:image/png;base64," + base64.b64encode(_png(_image(65, 64, 0))).decode()]),
     "images[0]", "4160 pixels"),
    ("/v1/score", dict(SCORE, images=["data:image/png;base64," + base64.b64encode(PNG[:200]).decode()]),
     "images[0]", "truncated"),
    ("/v1/score", dict(SCORE, images=[URL, URL]), "images", "2 images for 1"),
    ("/v1/score", dict(SCORE, continuations=[f" {PAD}"], images=[URL]), "continuations[0]", "only text is scored"),
    ("/v1/chat/completions", {"messages": chat([{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]),
                              "max_tokens": 0, "echo": True, "logprobs": True}, "messages[0].content[0].image_url.url",
     "fetches no images"),
    ("/v1/chat/completions", {"messages": chat([{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]),
                              "max_tokens": 0, "echo": True, "logprobs": True}, "messages[0].content[0].image_url.url",
     "reads no files"),
    ("/v1/chat/completions", {"messages": chat([{"type": "image_url", "image_url": {"url": URL}}] * 4),
                              "max_tokens": 0, "echo": True, "logprobs": True}, "messages[0].content[3].image_url.url",
     "limit of 3"),
    ("/v1/chat/completions", {"messages": chat([{"type": "image_url", "image_url": {"url": URL}}]),
                              "max_tokens": 0, "prompt_logprobs": 1}, "prompt_logprobs", "image tokens"),
    ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [5, IMAGE_ID], "completion_token_ids": [6],
                                     "images": ["data:image/png;base64," + base64.b64encode(PNG[:200]).decode()]}]},
     "sequences[0].images[0]", "truncated"),
    ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [5, IMAGE_ID], "completion_token_ids": [6],
                                     "images": ["data:image/png;base64," + base64.b64encode(b"%PDF-1.4 x").decode()]}]},
     "sequences[0].images[0]", "not an image in a format"),
    ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [5, IMAGE_ID], "completion_token_ids": [6],
                                     "images": ["data:image/png;base64," + base64.b64encode(_png(_image(65, 64, 0))).decode()]}]},
     "sequences[0].images[0]", "4160 pixels"),
    ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [5, IMAGE_ID, IMAGE_ID], "completion_token_ids": [6],
                                     "images": [URL]}]}, "sequences[0].images", "1 images (6 image tokens) for 2"),
    ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [5, IMAGE_ID], "completion_token_ids": [6],
                                     "multi_modal_data": {"image": [URL, URL]}}]}, "sequences[0].multi_modal_data.image",
     "2 images (12 image tokens) for 1"),
    ("/v1/logprobs", {"sequences": [{"prompt_token_ids": [5, IMAGE_ID], "completion_token_ids": [6],
                                     "multi_modal_data": {"image": ["not base64!"]}}]},
     "sequences[0].multi_modal_data.image[0]", "neither a data: URL nor base64"),
    ("/generate", {"input_ids": [5, IMAGE_ID, 6], "image_data": "http://127.0.0.1:9/a.png", "return_logprob": True},
     "image_data", "fetches no images"),
    ("/generate", {"input_ids": [5, IMAGE_ID, 6], "image_data": [URL, URL], "return_logprob": True}, "image_data",
     "2 images (12 image tokens) for 1"),
])
def test_bad_images_are_400s_naming_the_item(server, path, body, param, words):
    r = post(server, path, body)
    assert refused(r) == param and words in r.json()["error"]["message"], r.text
    assert post(server, "/v1/logprobs", {"sequences": [{"prompt_token_ids": [5, 7], "completion_token_ids": [6]}]}
                ).status_code == 200  # the server still answers


def test_images_to_a_text_only_model(tmp_path):
    """A model without a vision tower: each form of image is a 400 naming it."""
    from helpers import make_hf_dir

    make_hf_dir(tmp_path, "llama")
    scorer = Scorer(str(tmp_path), device="cpu", dtype="float32", progress=False)
    with serve(create_app(scorer)) as url:
        cases = [("/v1/logprobs", {"sequences": [{"prompt_token_ids": [5], "completion_token_ids": [6],
                                                  "images": [URL]}]}, "sequences[0].images"),
                 ("/generate", {"input_ids": [5, 6], "image_data": URL, "return_logprob": True}, "image_data"),
                 ("/v1/score", {"prompt": "a", "continuations": ["b"], "images": [URL]}, "images"),
                 ("/v1/chat/completions", {"messages": chat([{"type": "image_url", "image_url": {"url": URL}}]),
                                           "max_tokens": 0, "echo": True, "logprobs": True}, "messages[0].content[0]")]
        for path, body, param in cases:
            r = post(url, path, body)
            assert refused(r) == param and "no vision tower" in r.json()["error"]["message"], r.text


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the stdlib's name)
        if self.path != "/cat.png":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)

    def log_message(self, *args):
        pass


def test_remote_images_only_when_allowed(vl_scorer):
    """--allow-remote-images: an http URL is fetched (a local server here): the data: URL's numbers;
    a 404 or an image over the size limit is a 400 naming the field."""
    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{images.server_address[1]}"
    seq = {"prompt_token_ids": prompt_ids(vl_scorer), "completion_token_ids": [40, 41, 42]}
    try:
        with serve(create_app(vl_scorer, ServerConfig(allow_remote_images=True))) as url:
            inline = post(url, "/v1/logprobs", {"sequences": [dict(seq, images=[URL])]})
            fetched = post(url, "/v1/logprobs", {"sequences": [dict(seq, images=[base + "/cat.png"])]})
            assert fetched.status_code == 200, fetched.text
            assert fetched.json()["results"] == inline.json()["results"]
            assert refused(post(url, "/v1/logprobs", {"sequences": [dict(seq, images=[base + "/dog.png"])]})) \
                == "sequences[0].images[0]"
        with serve(create_app(vl_scorer, ServerConfig(allow_remote_images=True, max_remote_image_bytes=100))) as url:
            r = post(url, "/v1/logprobs", {"sequences": [dict(seq, images=[base + "/cat.png"])]})
            assert refused(r) == "sequences[0].images[0]" and "100 bytes" in r.text
    finally:
        images.shutdown()


def _huge_png(w: int, h: int) -> bytes:
    """A PNG header of w x h pixels and no pixel data: a few bytes whose decoding would take w * h * 3."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))  # noqa: E731
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_a_huge_image_is_refused_by_name(server, vl_scorer):
    """Pillow's own ceiling (a DecompressionBombError, not an OSError) is a LogprobeError naming the
    image in the library, and a 400 on the server (its header read, nothing decoded)."""
    bomb = _huge_png(20000, 20000)
    with pytest.raises(LogprobeError) as e:
        vl_scorer.logprobs([{"prompt_token_ids": [5, IMAGE_ID], "completion_token_ids": [6], "images": [bomb]}])
    assert e.value.field == "sequences[0].images[0]" and "too many pixels" in str(e.value)
    r = post(server, "/v1/logprobs", {"sequences": [{"prompt_token_ids": [5, IMAGE_ID], "completion_token_ids": [6],
                                                     "images": ["data:image/png;base64," + base64.b64encode(bomb).decode()]}]})
    assert refused(r) == "sequences[0].images[0]" and "400000000 pixels" in r.text
