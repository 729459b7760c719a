"""VLLMSampler's failure paths against a local misbehaving HTTP server (127.0.0.1).

Correctness of generation and weight reload against the real engine is in test_vllm_e2e.py;
here the server only plays the failures: dying mid-request, 5xx, malformed JSON, hanging.
"""

import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from pmd_jax.sampling.base import SamplerError, SamplerServerError, SamplingParams, schema_string
from pmd_jax.sampling.vllm_client import VLLMSampler

Action = Callable[[BaseHTTPRequestHandler, dict | None], None]


def reply(status: int, body: bytes | str | dict) -> Action:
    def act(h: BaseHTTPRequestHandler, _req) -> None:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        data = data.encode() if isinstance(data, str) else data
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    return act


def die(h: BaseHTTPRequestHandler, _req) -> None:
    """Read the request, then drop the connection without answering."""
    h.close_connection = True
    h.connection.shutdown(socket.SHUT_RDWR)


def hang(seconds: float) -> Action:
    def act(h, _req) -> None:
        time.sleep(seconds)

    return act


class FakeServer:
    def __init__(self, actions: list[Action]):
        self.actions = list(actions)
        self.requests: list[tuple[str, str, dict | None]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                outer.requests.append((self.command, self.path, body))
                act = outer.actions.pop(0) if outer.actions else reply(500, "no more actions")
                act(self, body)

            do_GET = _handle
            do_POST = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    servers = []

    def make(actions):
        s = FakeServer(actions)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.close()


def completion(choices):
    return {"id": "cmpl-1", "object": "text_completion", "model": "m", "choices": choices}


def choice(index, tokens, lps, reason="length"):
    return {
        "index": index,
        "text": "",
        "token_ids": tokens,
        "logprobs": {"token_logprobs": lps, "tokens": [f"token_id:{t}" for t in tokens]},
        "finish_reason": reason,
    }


def sampler(url, **kw):
    kw.setdefault("retries", 2)
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 5.0)
    return VLLMSampler(url, "m", store_url="/tmp/store", **kw)


def test_request_body_and_prompt_major_order(server):
    # the server may return choices in any order; rollouts come back prompt-major
    s = server(
        [
            reply(
                200,
                completion(
                    [
                        choice(3, [7, 8], [-0.5, -0.25], "stop"),
                        choice(0, [1], [-1.0]),
                        choice(2, [5, 6], [-0.1, -0.2]),
                        choice(1, [2, 3], [-2.0, -3.0]),
                    ]
                ),
            )
        ]
    )
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, max_tokens=2, seed=3,
                            stop_token_ids=(8,))  # fmt: skip
    out = sampler(s.url).generate([[10, 11], [12]], params)
    method, path, body = s.requests[0]
    assert (method, path) == ("POST", "/v1/completions")
    assert body["prompt"] == [[10, 11], [12]] and body["n"] == 2 and body["top_k"] == 5
    assert body["stop_token_ids"] == [8] and body["seed"] == 3 and body["logprobs"] == 0
    assert body["return_token_ids"] is True
    assert [(r.prompt_index, r.sample_index) for r in out] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert out.items[3].finish_reason == "stop"
    np.testing.assert_array_equal(out.items[3].tokens, [7, 8])
    np.testing.assert_allclose(out.items[1].logprobs, [-2.0, -3.0])
    assert out.items[0].tokens.dtype == np.int32 and out.items[0].logprobs.dtype == np.float32


REFLECTION = {
    "type": "object",
    "properties": {
        "strategies": {"type": "array", "items": {"type": "string", "maxLength": 60},
                       "maxItems": 3},
        "lessons": {"type": "array", "items": {"type": "string", "maxLength": 60},
                    "maxItems": 3},
    },
    "required": ["strategies", "lessons"],
    "additionalProperties": False,
}  # fmt: skip


def test_json_schema_goes_to_structured_outputs(server):
    text_ok = completion([choice(0, [5, 2], [-0.1, 0.0], "stop")])
    s = server([reply(200, {"version": "0.32.0+cpu"}), reply(200, text_ok), reply(200, text_ok),
                reply(200, text_ok)])  # fmt: skip
    smp = sampler(s.url)
    params = SamplingParams(max_tokens=4, json_schema=schema_string(REFLECTION))
    out = smp.generate([[1, 2]], params)
    assert out.items[0].tokens.tolist() == [5, 2]
    (m0, p0, _), (m1, p1, body) = s.requests
    assert (m0, p0) == ("GET", "/version") and (m1, p1) == ("POST", "/v1/completions")
    # vLLM's own field, with the schema as an object (not a string, not guided_json)
    assert body["structured_outputs"] == {"json": REFLECTION}
    assert not any(k.startswith("guided") for k in body) and "response_format" not in body
    # the version is asked once; unconstrained requests carry no structured_outputs
    smp.generate([[1, 2]], params)
    smp.generate([[1, 2]], SamplingParams(max_tokens=4))
    assert [r[1] for r in s.requests] == ["/version"] + ["/v1/completions"] * 3
    assert "structured_outputs" not in s.requests[-1][2]


def test_schema_the_server_rejects_names_schema_and_server_message(server):
    bad = {"type": "nonsense"}
    err = {"error": {"message": "Grammar error: Invalid type: nonsense",
                     "type": "BadRequestError", "param": None, "code": 400}}  # fmt: skip
    s = server([reply(200, {"version": "0.32.0"}), reply(400, err)])
    with pytest.raises(SamplerError) as e:
        sampler(s.url).generate([[1]], SamplingParams(max_tokens=4, json_schema=json.dumps(bad)))
    msg = str(e.value)
    assert "refused the request with JSON schema" in msg and '{"type": "nonsense"}' in msg
    assert "HTTP 400" in msg and "Grammar error: Invalid type: nonsense" in msg
    assert len(s.requests) == 2  # a 400 is not retried
    # a 5xx during a constrained request stays a plain server error (not blamed on the schema)
    s = server([reply(200, {"version": "0.32.0"}), reply(500, {"error": "engine died"})])
    with pytest.raises(SamplerServerError) as e:
        sampler(s.url).generate([[1]], SamplingParams(max_tokens=4, json_schema="{}"))
    assert "HTTP 500" in str(e.value) and "refused" not in str(e.value)


def test_server_without_structured_outputs_is_refused_before_sampling(server):
    # vLLM ignores unknown request fields: an old server would sample unconstrained text
    s = server([reply(200, {"version": "0.9.2"})])
    with pytest.raises(SamplerError, match=r"version '0\.9\.2'.*needs vLLM >= 0\.10\.2"):
        sampler(s.url).generate([[1]], SamplingParams(max_tokens=4, json_schema="{}"))
    assert [r[1] for r in s.requests] == ["/version"]
    s = server([reply(404, {"detail": "Not Found"})])
    with pytest.raises(SamplerServerError, match=r"HTTP 404 from GET .*/version"):
        sampler(s.url).generate([[1]], SamplingParams(max_tokens=4, json_schema="{}"))
    # a schema that is not a JSON object never reaches the server
    s = server([])
    with pytest.raises(SamplerError, match="json_schema is not valid JSON"):
        sampler(s.url).generate([[1]], SamplingParams(max_tokens=4, json_schema="{strat"))
    with pytest.raises(SamplerError, match="must be a JSON object"):
        sampler(s.url).generate([[1]], SamplingParams(max_tokens=4, json_schema="[1]"))
    assert s.requests == []


def test_connection_refused_names_the_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed when the block ends: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(SamplerServerError, match=rf"127\.0\.0\.1:{port}/v1/completions.*3 attempt"):
        sampler(f"http://127.0.0.1:{port}").generate([[1]], SamplingParams(max_tokens=1))
    assert time.monotonic() - t0 < 5


def test_server_dying_mid_request_is_retried_then_reported(server):
    ok = reply(200, completion([choice(0, [4], [-0.5])]))
    s = server([die, die, ok])
    out = sampler(s.url).generate([[1]], SamplingParams(max_tokens=1))
    assert len(s.requests) == 3 and out.items[0].tokens.tolist() == [4]
    s2 = server([die, die, die])
    with pytest.raises(SamplerServerError, match=r"/v1/completions failed.*after 3 attempt"):
        sampler(s2.url).generate([[1]], SamplingParams(max_tokens=1))


def test_500_is_reported_with_status_and_body_not_retried(server):
    s = server([reply(500, {"error": "engine exploded: CUDA-less core"})])
    with pytest.raises(SamplerServerError, match=r"HTTP 500 .*/v1/completions.*engine exploded"):
        sampler(s.url).generate([[1]], SamplingParams(max_tokens=1))
    assert len(s.requests) == 1


def test_503_is_retried_with_backoff(server):
    ok = reply(200, completion([choice(0, [4], [-0.5])]))
    s = server([reply(503, "busy"), reply(503, "busy"), ok])
    t0 = time.monotonic()
    sampler(s.url, backoff_s=0.1).generate([[1]], SamplingParams(max_tokens=1))
    assert len(s.requests) == 3
    assert time.monotonic() - t0 >= 0.1 + 0.2  # 0.1 then 0.2 s


def test_malformed_json_and_unexpected_shapes(server):
    s = server([reply(200, b"{not json at all")])
    with pytest.raises(SamplerServerError, match=r"malformed JSON.*not json at all"):
        sampler(s.url).generate([[1]], SamplingParams(max_tokens=1))
    s = server([reply(200, {"choices": [choice(0, [1], [-1.0])]})])
    with pytest.raises(SamplerServerError, match=r"1 choices, expected 1 x 2"):
        sampler(s.url).generate([[1]], SamplingParams(n=2, max_tokens=1))
    bad = choice(0, [1, 2], [-1.0])
    s = server([reply(200, completion([bad]))])
    with pytest.raises(SamplerServerError, match=r"2 tokens but 1 logprobs"):
        sampler(s.url).generate([[1]], SamplingParams(max_tokens=2))
    bad = {"index": 0, "finish_reason": "length"}
    s = server([reply(200, completion([bad]))])
    with pytest.raises(SamplerServerError, match=r"choice 0 .* lacks"):
        sampler(s.url).generate([[1]], SamplingParams(max_tokens=2))


def test_hanging_server_times_out(server):
    s = server([hang(3), hang(3)])
    t0 = time.monotonic()
    with pytest.raises(SamplerServerError, match=r"/v1/completions failed.*timed out"):
        sampler(s.url, timeout_s=0.5, retries=1).generate([[1]], SamplingParams(max_tokens=1))
    assert time.monotonic() - t0 < 3


def test_bad_input_never_reaches_the_server(server):
    s = server([])
    smp = sampler(s.url, vocab_size=100, max_model_len=16)
    with pytest.raises(SamplerError, match="n must be >= 1"):
        smp.generate([[1]], SamplingParams(n=0))
    with pytest.raises(SamplerError, match="stop_token_ids"):
        smp.generate([[1]], SamplingParams(stop_token_ids=(100,), max_tokens=1))
    with pytest.raises(SamplerError, match="prompt 1 is empty"):
        smp.generate([[1], []], SamplingParams(max_tokens=1))
    with pytest.raises(SamplerError, match="exceeds the context of 16"):
        smp.generate([[1] * 10], SamplingParams(max_tokens=8))
    with pytest.raises(SamplerError, match=r"outside \[0, 100\)"):
        smp.generate([[1, 100]], SamplingParams(max_tokens=1))
    with pytest.raises(SamplerError, match="base_url"):
        VLLMSampler("127.0.0.1:8000", "m")
    assert s.requests == []
    assert len(smp.generate([], SamplingParams())) == 0


def test_set_weights_calls_rpc_then_resets_prefix_cache(server):
    ok = {"results": [{"version": 7, "step": 70, "num_arrays": 3, "bytes": 12}]}
    s = server([reply(200, ok), reply(200, {"success": True})])
    smp = sampler(s.url)
    smp.set_weights(7)
    (m1, p1, b1), (m2, p2, _b2) = s.requests
    assert (m1, p1) == ("POST", "/collective_rpc") and (m2, p2) == ("POST", "/reset_prefix_cache")
    assert b1["method"] == "pmd_load_weights" and b1["args"][:2] == ["/tmp/store", "7"]
    assert smp.weights_version == 7 and smp.last_reload["bytes"] == 12
    # the server reports a failed load (e.g. checksum): error says what, version unchanged
    s = server([reply(500, {"error": "version 8 under '/tmp/store' is damaged: q_proj"})])
    with pytest.raises(SamplerServerError, match=r"HTTP 500.*/collective_rpc.*damaged: q_proj"):
        sampler(s.url).set_weights(8)
    # a reply that does not confirm the requested version
    s = server([reply(200, {"results": [{"version": 6}]})])
    with pytest.raises(SamplerServerError, match="reload of version 9"):
        sampler(s.url).set_weights(9)
    with pytest.raises(SamplerError, match="store_url"):
        VLLMSampler(s.url, "m").set_weights(1)


# ----------------------------------------------------------------------------- extension
def test_worker_extension_imports_without_jax_and_loads_a_version(tmp_path):
    """third_party/pmd_vllm runs in the server's venv (no jax): import it with jax blocked.

    The method is driven here with a recording ``reload_weights`` in place of vLLM's worker;
    the real worker is exercised in test_vllm_e2e.py.
    """
    import subprocess
    import sys
    from pathlib import Path

    import ml_dtypes

    from pmd_jax.sampling.weight_store import WeightStore

    repo = Path(__file__).resolve().parents[2]
    rng = np.random.default_rng(0)
    arrays = {
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(4).astype(ml_dtypes.bfloat16),
    }
    WeightStore(tmp_path / "s").publish(arrays, version=5, step=50)
    code = f"""
import sys, json
sys.modules["jax"] = None  # any `import jax` now fails
sys.path.insert(0, {str(repo / "third_party")!r})
import torch
from pmd_vllm.worker_ext import TensorstoreWeightLoader

class Worker(TensorstoreWeightLoader):
    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        ts = dict(weights_iterator)
        self.got = {{n: t.float().tolist() for n, t in ts.items()}}
        self.dtypes = {{n: str(t.dtype) for n, t in ts.items()}}

w = Worker()
info = w.pmd_load_weights({str(tmp_path / "s")!r}, "latest", "30")
print(json.dumps({{"info": info, "got": w.got, "dtypes": w.dtypes,
                  "version": w.pmd_weights_version()}}))
try:
    w.pmd_load_weights({str(tmp_path / "s")!r}, "6", "30")
except Exception as e:
    print("ERR", type(e).__name__, e)
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    first, err = res.stdout.strip().splitlines()[-2:]
    out = json.loads(first)
    assert out["info"]["version"] == 5 and out["info"]["step"] == 50
    assert out["info"]["num_arrays"] == 2 and out["version"] == {"version": 5}
    for k, a in arrays.items():
        np.testing.assert_array_equal(np.asarray(out["got"][k], np.float32), a.astype(np.float32))
    assert out["dtypes"]["model.norm.weight"] == "torch.bfloat16"
    assert out["dtypes"]["model.layers.0.self_attn.q_proj.weight"] == "torch.float32"
    assert err.startswith("ERR") and "version 6 is not committed" in err
