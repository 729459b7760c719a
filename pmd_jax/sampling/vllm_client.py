"""Sampler backed by an external vLLM server (OpenAI-compatible completions endpoint).

The server is started by ``launch/vllm_server.sh``: it loads the worker extension in
``third_party/pmd_vllm`` (``--worker-extension-cls``), serves the development endpoints
(``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``, ``/reset_prefix_cache``) and returns
logprobs of the processed distribution (``--logprobs-mode processed_logprobs``), i.e. after
temperature, top-k and top-p: with ``top_p=1`` and ``top_k=0`` that is ``log_softmax(logits
/ T)``, the trainer's logprob at the sampling temperature; with top-k / top-p the
distribution is renormalised over the kept tokens (what was actually sampled from).

Structured output: ``SamplingParams.json_schema`` is sent as vLLM's own structured-outputs
field of the completions request, ``"structured_outputs": {"json": <schema>}`` (vLLM >= 0.10.2;
``guided_json`` is gone in 0.32). The server compiles the schema (xgrammar, falling back to
llguidance for features xgrammar lacks) when it receives the request and answers 400 if it
cannot; that comes back as a ``SamplerError`` naming the schema and quoting the server. While
decoding, the engine applies the grammar's token bitmask to the logits *before* its sampler
(``apply_grammar_bitmask`` in the model runner), so every sampled token is one the grammar
allows, and the returned logprobs, raw or processed alike, are computed from the masked logits:
for a constrained request they are those of the masked, renormalised distribution actually
sampled from (at the sampling temperature, after top-k / top-p, with the processed mode above;
at T=1 over the allowed tokens for greedy requests).

Only the standard library is used (``urllib``). Every call has a timeout; connection errors
and 5xx answers are retried with exponential backoff; errors say which URL failed, with the
status and an excerpt of the body.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from pmd_jax.sampling.base import (
    Rollout,
    Rollouts,
    SamplerError,
    SamplerServerError,
    SamplingParams,
    WeightSharing,
)

_RETRYABLE_STATUS = {429, 502, 503, 504}
# The completions request's `structured_outputs` field (vLLM's rename of `guided_json` & co.).
_MIN_STRUCTURED_OUTPUTS_VERSION = (0, 10, 2)


class VLLMSampler:
    """``Sampler`` over a vLLM server.

    ``params.json_schema`` is honoured through vLLM's structured outputs (see the module
    docstring): outputs follow the schema, logprobs are those of the masked, renormalised
    distribution sampled from, and a server that cannot constrain (older than vLLM 0.10.2, or
    one that rejects the schema) raises ``SamplerError`` rather than sample unconstrained.

    Args:
      base_url: e.g. ``http://127.0.0.1:8000`` (no trailing ``/v1``).
      model: the served model name (the path given to ``vllm serve`` unless renamed).
      store_url: the weight store (local path or gs://) the server reads versions from.
      timeout_s: per-request timeout for generation.
      reload_timeout_s: timeout of a weight reload (read + load on the server).
      retries: extra attempts on connection errors, timeouts and 429/502/503/504.
      backoff_s: first backoff; doubles after each failed attempt.
      vocab_size: when given, prompts and stop tokens are checked against it.
      max_model_len: when given, prompts longer than this (minus max_tokens) are rejected.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        store_url: str | None = None,
        *,
        timeout_s: float = 300.0,
        reload_timeout_s: float = 600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        vocab_size: int | None = None,
        max_model_len: int | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise SamplerError(f"VLLMSampler: base_url must be http(s)://..., got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model or None  # None: the one model the server serves (GET /v1/models)
        self.store_url = store_url
        self.timeout_s = timeout_s
        self.reload_timeout_s = reload_timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.weights_version: int | None = None
        self.last_reload: dict[str, Any] | None = None
        self._server_version: str | None = None

    # ------------------------------------------------------------------------- HTTP
    def _request(
        self,
        method: str,
        path: str,
        body: Any | None = None,
        *,
        timeout_s: float | None = None,
        retry: bool = True,
    ) -> Any:
        """JSON request with timeout and retries; returns the decoded JSON (None if empty)."""
        url = self.base_url + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        timeout = self.timeout_s if timeout_s is None else timeout_s
        attempts = 1 + (self.retries if retry else 0)
        delay = self.backoff_s
        last: str = ""
        for attempt in range(attempts):
            req = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=timeout) as resp:
                    raw = resp.read()
                    status = resp.status
            except urllib.error.HTTPError as e:
                excerpt = _excerpt(_error_text(e.read()))
                last = f"HTTP {e.code} from {method} {url}: {excerpt}"
                if e.code in _RETRYABLE_STATUS and attempt + 1 < attempts:
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise SamplerServerError(last) from e
            except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
                # OSError covers ConnectionError, TimeoutError and socket.timeout
                reason = getattr(e, "reason", e)
                last = f"{method} {url} failed: {type(reason).__name__}: {reason}"
                if attempt + 1 < attempts:
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise SamplerServerError(f"{last} (after {attempts} attempt(s))") from e
            if not raw.strip():
                return None
            try:
                return json.loads(raw)
            except json.JSONDecodeError as e:
                raise SamplerServerError(
                    f"malformed JSON (HTTP {status}) from {method} {url}: {_excerpt(raw)}"
                ) from e
        raise SamplerServerError(last)

    def health(self, timeout_s: float = 5.0) -> bool:
        try:
            self._request("GET", "/health", timeout_s=timeout_s, retry=False)
            return True
        except SamplerServerError:
            return False

    def wait_until_ready(self, timeout_s: float = 300.0, poll_s: float = 1.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.health(timeout_s=min(5.0, poll_s * 5)):
                return
            time.sleep(poll_s)
        raise SamplerServerError(f"vLLM server at {self.base_url} not healthy after {timeout_s}s")

    def served_models(self) -> list[str]:
        """Model names the server serves (``GET /v1/models``)."""
        out = self._request("GET", "/v1/models")
        try:
            return [str(m["id"]) for m in out["data"]]
        except (KeyError, TypeError) as e:
            raise SamplerServerError(
                f"unexpected /v1/models answer from {self.base_url}: {_excerpt(out)}") from e

    def server_version(self) -> str:
        """The server's vLLM version (``GET /version``), asked once."""
        if self._server_version is None:
            out = self._request("GET", "/version")
            if not isinstance(out, dict) or not isinstance(out.get("version"), str):
                raise SamplerServerError(
                    f"unexpected /version answer from {self.base_url}: {_excerpt(out)}")
            self._server_version = out["version"]
        return self._server_version

    def check_structured_outputs(self) -> None:
        """Raise SamplerError unless the server honours ``structured_outputs``.

        vLLM's OpenAI server ignores unknown request fields (it only logs them), so a server
        older than the field would sample unconstrained text without saying so.
        """
        version = self.server_version()
        parsed = _version_tuple(version)
        if parsed is None or parsed < _MIN_STRUCTURED_OUTPUTS_VERSION:
            need = ".".join(map(str, _MIN_STRUCTURED_OUTPUTS_VERSION))
            raise SamplerError(
                f"vLLM server at {self.base_url} is version {version!r}; constrained "
                f"sampling (SamplingParams.json_schema) needs vLLM >= {need}, whose "
                "completions API takes the `structured_outputs` field (older servers ignore "
                "it and would return unconstrained text)")

    def model_name(self) -> str:
        """The model name sent with each request; asks the server once when not given."""
        if self.model is None:
            names = self.served_models()
            if len(names) != 1:
                raise SamplerError(
                    f"vLLM server at {self.base_url} serves {names}; set the model name "
                    "(rollout.vllm_model) to one of them")
            self.model = names[0]
        return self.model

    # ------------------------------------------------------------------------- Sampler
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 progress: Callable[[int], None] | None = None) -> Rollouts:
        params.validate(self.vocab_size)
        if not prompts:
            return Rollouts(items=[], weights_version=self.weights_version)
        clean: list[list[int]] = []
        for i, p in enumerate(prompts):
            toks = [int(t) for t in p]
            if not toks:
                raise SamplerError(f"prompt {i} is empty")
            if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in toks):
                raise SamplerError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
            if self.max_model_len is not None and len(toks) + params.max_tokens > (
                self.max_model_len
            ):
                raise SamplerError(
                    f"prompt {i} has {len(toks)} tokens; with max_tokens={params.max_tokens} "
                    f"that exceeds the context of {self.max_model_len}"
                )
            clean.append(toks)
        body: dict[str, Any] = {
            "model": self.model_name(),
            "prompt": clean if len(clean) > 1 else clean[0],
            "n": params.n,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "seed": params.seed,
            "logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "stop_token_ids": list(params.stop_token_ids),
            "ignore_eos": False,
            "skip_special_tokens": False,
        }
        if params.json_schema is not None:
            self.check_structured_outputs()
            # vLLM's structured outputs; a dict, so the server sees the schema, not a string
            body["structured_outputs"] = {"json": json.loads(params.json_schema)}
        try:
            out = self._request("POST", "/v1/completions", body)
        except SamplerServerError as e:
            if params.json_schema is not None and _is_client_error(e):
                raise SamplerServerError(
                    f"vLLM server at {self.base_url} refused the request with JSON schema "
                    f"{_excerpt(params.json_schema, 200)}: {e}"
                ) from e
            raise
        rollouts = self._parse_completions(out, len(clean), params)
        if progress is not None:  # one request: all rows finish together
            progress(len(rollouts.items))
        return rollouts

    def _parse_completions(self, out: Any, num_prompts: int, params: SamplingParams) -> Rollouts:
        where = f"{self.base_url}/v1/completions"
        if not isinstance(out, dict) or not isinstance(out.get("choices"), list):
            raise SamplerServerError(f"unexpected response from {where}: {_excerpt(out)}")
        choices = out["choices"]
        if len(choices) != num_prompts * params.n:
            raise SamplerServerError(
                f"{where} returned {len(choices)} choices, expected {num_prompts} x {params.n}"
            )
        items: list[Rollout] = []
        for j, c in enumerate(choices):
            try:
                idx = int(c["index"])
                tokens = c.get("token_ids")
                lp = (c.get("logprobs") or {}).get("token_logprobs")
                if tokens is None:
                    # Older servers: ids only as "token_id:123" strings in logprobs.tokens.
                    tokens = [int(t.split(":", 1)[1]) for t in c["logprobs"]["tokens"]]
                if lp is None:
                    raise KeyError("logprobs.token_logprobs")
                reason = c.get("finish_reason")
            except (KeyError, TypeError, ValueError, IndexError) as e:
                raise SamplerServerError(f"choice {j} from {where} lacks {e}: {_excerpt(c)}") from e
            if len(lp) != len(tokens):
                raise SamplerServerError(
                    f"choice {j} from {where}: {len(tokens)} tokens but {len(lp)} logprobs"
                )
            if reason not in ("stop", "length"):
                raise SamplerServerError(f"choice {j} from {where}: finish_reason {reason!r}")
            items.append(
                Rollout(
                    prompt_index=idx // params.n,
                    sample_index=idx % params.n,
                    tokens=np.asarray(tokens, np.int32),
                    logprobs=np.asarray([np.nan if x is None else x for x in lp], np.float32),
                    finish_reason=reason,
                )
            )
        items.sort(key=lambda r: (r.prompt_index, r.sample_index))
        return Rollouts(items=items, weights_version=self.weights_version)

    # ------------------------------------------------------------------------- weights
    def share_weights(self) -> WeightSharing:
        """The ``Sampler`` contract: the server reads published versions from the store."""
        return "store"

    def set_params(self, params: Any, version: int, *, copy: bool = False) -> None:
        """Not served: the server is another process; publish through the weight store."""
        raise _params_not_served()

    def release_params(self) -> None:
        """Not served: the server's weights live in another process (``set_params``)."""
        raise _params_not_served()

    def set_weights(self, version: int) -> None:
        """Make the server load committed ``version`` from the store; returns once served.

        The server reads and verifies the whole version before touching any weight, so on
        error (missing version, bad checksum) it keeps serving the previous weights.
        """
        if self.store_url is None:
            raise SamplerError("VLLMSampler.set_weights needs store_url")
        if int(version) < 0:
            raise SamplerError(f"set_weights: version must be >= 0, got {version}")
        body = {
            "method": "pmd_load_weights",
            "args": [str(self.store_url), str(int(version)), str(self.reload_timeout_s)],
            "timeout": self.reload_timeout_s,
        }
        # Not retried: a reload that timed out on the client may still be running there.
        t0 = time.perf_counter()
        out = self._request(
            "POST", "/collective_rpc", body, timeout_s=self.reload_timeout_s + 30, retry=False
        )
        results = (out or {}).get("results") if isinstance(out, dict) else None
        if not results or not all(
            isinstance(r, dict) and r.get("version") == int(version) for r in results
        ):
            raise SamplerServerError(
                f"reload of version {version} via {self.base_url}/collective_rpc returned "
                f"{_excerpt(out)}"
            )
        reset = self._request("POST", "/reset_prefix_cache", None)
        if isinstance(reset, dict) and reset.get("success") is False:
            # Blocks still held by running requests; the server says retrying is fine.
            for _ in range(10):
                time.sleep(0.2)
                reset = self._request("POST", "/reset_prefix_cache", None)
                if not (isinstance(reset, dict) and reset.get("success") is False):
                    break
            else:
                raise SamplerServerError(
                    f"{self.base_url}/reset_prefix_cache kept failing after loading "
                    f"version {version}: {_excerpt(reset)}"
                )
        self.weights_version = int(version)
        self.last_reload = dict(results[0], client_s=time.perf_counter() - t0)


def unreachable_message(base_url: str, model_source: str = "", *, timeout_s: float = 5.0,
                        retries: int = 2, backoff_s: float = 0.5) -> str | None:
    """None when a server answers ``GET <base_url>/health``; else one line naming the URL, why
    not, and the command that starts a server for ``model_source`` (``launch/vllm_server.sh``,
    on the URL's port). ``pmd_jax.main`` asks before the model loads; ``retries`` with
    ``backoff_s`` doubling (1.5 s at the defaults) cover a server that is just coming up."""

    probe = VLLMSampler(base_url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
    try:
        probe._request("GET", "/health")
        return None
    except SamplerServerError as e:
        why = str(e)
    try:
        parts = urlsplit(base_url)
        host, port = parts.hostname or "", parts.port
    except ValueError:
        host, port = "", None
    env, where = "", ""
    if host not in ("127.0.0.1", "localhost", "::1", ""):  # started on that host
        env, where = f"PMD_VLLM_HOST={host} ", f" on {host}"
    if port not in (None, 8000):  # the script's default port
        env += f"PMD_VLLM_PORT={port} "
    model = (model_source if model_source and os.path.isdir(model_source)
             else f"<HF folder of model.source={model_source!r}>")
    return (f"rollout.sampler=vllm: no vLLM server answers at {probe.base_url} ({why}); start "
            f"one{where} with `{env}bash launch/vllm_server.sh {model}` (its venv once: `bash "
            "launch/setup_vllm_venv.sh`), or set rollout.vllm_url to a running one")


def _version_tuple(version: str) -> tuple[int, ...] | None:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``; ``"0.11.0rc1"`` -> ``(0, 11, 0)``; None if no digits."""
    parts: list[int] = []
    for piece in re.split(r"[.+]", version.strip().lstrip("v"))[:3]:
        m = re.match(r"\d+", piece)
        if m is None:
            break
        parts.append(int(m.group()))
    return tuple(parts) if parts else None


def _is_client_error(e: SamplerServerError) -> bool:
    """The server refused the request (4xx but 429), e.g. a schema it cannot compile."""
    cause = e.__cause__
    return (isinstance(cause, urllib.error.HTTPError) and 400 <= cause.code < 500
            and cause.code not in _RETRYABLE_STATUS)


def _error_text(raw: bytes) -> str | bytes:
    """The message of an OpenAI-style error body ``{"error": {"message": ...}}``, else raw."""
    try:
        err = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return raw
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        return err["message"]
    return raw


def _excerpt(x: Any, n: int = 300) -> str:
    if isinstance(x, bytes):
        x = x.decode("utf-8", "replace")
    elif not isinstance(x, str):
        try:
            x = json.dumps(x)
        except (TypeError, ValueError):
            x = repr(x)
    x = x.strip()
    return x if len(x) <= n else x[:n] + f"... ({len(x)} chars)"


def _params_not_served() -> SamplerError:
    """What ``set_params``/``release_params`` raise: the server takes weights from the store."""
    return SamplerError(
        "VLLMSampler takes weights through the weight store (share_weights() == 'store'): "
        "publish the version (sampling.publish.publish, or WeightStore.publish) and call "
        "set_weights(version)")
