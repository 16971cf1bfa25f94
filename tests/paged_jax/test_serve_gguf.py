"""`paged-jax serve --model FILE.gguf`: the OpenAI server built from its
flags (`api_server.build`) serves a GGUF model through the `openai` client:
`/v1/models` lists it, chat completions streamed and not agree; on the real
SmolLM2 file (where installed) the answer is real text."""

from __future__ import annotations

import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("gguf")

from paged_jax.entrypoints.openai import api_server  # noqa: E402
from paged_jax.models import loader  # noqa: E402
from paged_jax.models.llama import model as model_lib  # noqa: E402
from tests.paged_jax.models import test_gguf  # noqa: E402

# Two compiled shapes (decode 4 rows, mixed 16).
SIZES = ["--block-size", "4", "--num-blocks", "32", "--max-batch", "4",
         "--max-tokens-per-step", "16", "--max-model-len", "128", "--no-compile-cache",
         "--min-bucket", "16", "--no-bucket-midpoints"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def serve(model_path):
  args = api_server.parse_args(["--model", str(model_path), *SIZES])
  loop, app = api_server.build(args)
  loop.start()
  server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(),
                                          log_level="warning"))
  thread = threading.Thread(target=server.run, daemon=True)
  thread.start()
  deadline = time.time() + 60
  while not server.started:
    assert time.time() < deadline, "server did not start"
    time.sleep(0.02)
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.config.port}/v1",
                         api_key="x", max_retries=0)

  def close():
    server.should_exit = True
    thread.join(timeout=10)
    loop.close()
  return client, close


def chat(client, name, question, max_tokens):
  messages = [{"role": "user", "content": question}]
  whole = client.chat.completions.create(model=name, messages=messages,
                                         max_tokens=max_tokens, temperature=0)
  stream = client.chat.completions.create(model=name, messages=messages,
                                          max_tokens=max_tokens, temperature=0,
                                          stream=True)
  streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
  return whole.choices[0].message.content, streamed


def test_tiny_gguf_with_its_tokenizer(tmp_path):
  d = test_gguf.trained_tokenizer_json("smollm")
  cfg = model_lib.LlamaConfig.tiny(vocab_size=len(d["model"]["vocab"]), rope_scaling=None)
  path = tmp_path / "tiny-chat.gguf"
  test_gguf.write_gguf(path, test_gguf.hf_tensors(cfg), cfg, types={},
                       tokenizer=test_gguf.gguf_tokenizer_metadata(d, "smollm"))
  client, close = serve(path)
  try:
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    whole, streamed = chat(client, "tiny-chat", "hi there", 6)
    assert isinstance(whole, str) and whole == streamed
  finally:
    close()


def test_real_smollm2_answers_through_the_openai_client():
  try:
    path = loader.smollm2_path(fetch=False)
  except loader.ModelNotAvailable as e:
    pytest.skip(f"the real model is not installed ({e})")
  client, close = serve(path)
  try:
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]
    whole, streamed = chat(client, "SmolLM2-135M-Instruct.Q4_1",
                           "What is the capital of France?", 16)
    assert whole == streamed == "The capital of France is Paris."
  finally:
    close()
