"""A stand-in for a VLM served by vLLM or SGLang: the OpenAI chat completions API, a judge whose answer depends on the
request. Run as a process: python -m tests.recipe.judge_server --port PORT

    GET  /v1/models             {"object": "list", "data": [{"id": "tiny-judge", "object": "model"}]}
    POST /v1/chat/completions   {"choices": [{"message": {"role": "assistant", "content": ANSWER}, ...}], ...}

The request must look like what vLLM accepts for a vision model (model id, messages whose user content has one PNG
data URL image_url part and one text part, max_tokens, temperature); anything else is HTTP 400 with an OpenAI-style
error. The answer (see `rating`): "Score: S" with S = 10 x the mean of the image channel named by the first colour
word of the text (red, green or blue), 2 decimals, so it checks the image's pixels, its channel order and that the
prompt reached the text; with several images (an edit's source first, the image to rate last) S is 10 x the mean
absolute difference of that channel between the first and the last; a text containing "ramble" gets a sentence
instead of the format; a text asking for UnifiedReward's point-wise scores ("Alignment Score (1-5)") gets its three
lines, alignment 1 + 4 x that mean / 255 and style 5 - 4 x it.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import re
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image

MODEL = "tiny-judge"
CHANNELS = {"red": 0, "green": 1, "blue": 2}


def rating(images: list[np.ndarray], text: str) -> str:
    """The judge's answer for the uint8 [H, W, 3] images of a request (the one to rate last) and the user text."""
    if "ramble" in text:
        return "What a lovely picture, I would give it a high mark."
    colour = re.search(r"\b(red|green|blue)\b", text)
    channel = CHANNELS[colour.group(1)] if colour else 0
    last = images[-1][..., channel].astype(np.float64)
    if "Alignment Score (1-5)" in text:  # UnifiedReward's point-wise format (docs/rewards.md)
        return (f"Alignment Score (1-5): {1 + 4 * last.mean() / 255:.2f}\nCoherence Score (1-5): 3\n"
                f"Style Score (1-5): {5 - 4 * last.mean() / 255:.2f}")
    if len(images) > 1:
        return f"Score: {10 * np.abs(last - images[0][..., channel]).mean() / 255:.2f}"
    return f"Score: {10 * last.mean() / 255:.2f}"


def _parse(body: dict) -> tuple[list[np.ndarray], str]:
    """(images, user text) of a chat request; ValueError naming what is wrong."""
    if body.get("model") != MODEL:
        raise ValueError(f"The model `{body.get('model')}` does not exist.")
    if not isinstance(body.get("max_tokens"), int) or not isinstance(body.get("temperature"), (int, float)):
        raise ValueError("max_tokens (int) and temperature are expected")
    users = [m for m in body.get("messages", []) if m.get("role") == "user"]
    if len(users) != 1 or not isinstance(users[0].get("content"), list):
        raise ValueError("expected one user message with a list of content parts")
    parts = users[0]["content"]
    urls = [p.get("image_url", {}).get("url", "") for p in parts if p.get("type") == "image_url"]
    texts = [p.get("text") for p in parts if p.get("type") == "text"]
    if len(texts) != 1 or not urls or not all(u.startswith("data:image/png;base64,") for u in urls):
        raise ValueError("expected image_url parts (PNG data URLs) and one text part")
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(u.split(",", 1)[1]))).convert("RGB")) for u in urls]
    return images, texts[0]


class Handler(BaseHTTPRequestHandler):
    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 -- http.server's naming
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self._send(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError"}})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/v1/chat/completions":
            return self._send(404, {"error": {"message": f"no route {self.path}", "type": "NotFoundError"}})
        try:
            images, text = _parse(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        except (ValueError, KeyError, OSError) as err:
            return self._send(400, {"error": {"message": str(err), "type": "BadRequestError", "code": 400}})
        answer = rating(images, text)
        self._send(200, {"id": "chatcmpl-0", "object": "chat.completion", "model": MODEL, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": answer}, "finish_reason": "stop"}]})

    def log_message(self, *args) -> None:  # quiet: the tests read answers, not access logs
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    ThreadingHTTPServer(("127.0.0.1", parser.parse_args().port), Handler).serve_forever()


if __name__ == "__main__":
    main()
