"""Dry run: a full-width train step compiles on abstract, sharded inputs for a simulated mesh."""


import jax
import pytest

from pmd_jax.dry_run import forward_backward as dr
from pmd_jax.models.config import olmo3_7b, qwen3_8b
from pmd_jax.run import sharding as sh
from tests.host import need_devices
from tests.tiny_runs import child_env

needs8 = pytest.mark.devices(8)  # skipped with fewer, naming the count found (tests/host.py)
# The dry runs started in a child simulate their mesh on fake CPU devices: on a GPU host the
# child's jax would take its GPUs instead (JAX_PLATFORMS=cuda, or the default), so it is told
# to use the CPU (what it uses anyway on a CPU-only host).
SIMULATED = {"JAX_PLATFORMS": "cpu"}


def _two_layers(cfg):
    over = {"num_layers": 2}
    if cfg.layer_types is not None:
        over["layer_types"] = cfg.layer_types[-2:]  # one sliding, one full layer
    return cfg.replace(**over)


@needs8
def test_reduced_qwen3_full_width_compiles_and_reports():
    cfg = _two_layers(qwen3_8b())
    r = dr.dry_run(cfg, {"data": 1, "fsdp": 4, "tensor": 2}, batch=4, seq=128)
    pd = r["per_device_bytes"]
    # every big tensor is split 8 ways (embed over fsdp, heads/mlp/vocab over tensor); only the
    # tiny norm vectors are replicated
    total = cfg.num_params() * 2  # bf16
    assert total / 8 <= pd["params"] < total / 8 * 1.01
    # AdamW: mu and nu like the params, plus a scalar count
    assert 2 * pd["params"] <= pd["optimizer_state"] <= 2 * pd["params"] + 64
    assert pd["xla_arguments"] >= pd["params"] + pd["optimizer_state"]
    assert pd["xla_temp_activations"] > 0
    # XLA's own FLOP count for the step vs the analytic 6*N-style count: remat recomputes the
    # forward (x4/3), softmax/norm/optimizer elementwise work adds a little
    ratio = r["compiled_flops_per_token"] / r["model_flops_per_token_train"]
    assert 1.0 < ratio < 2.0, ratio
    assert "GiB" in dr.format_report(r)


@needs8
def test_errors_name_the_setting():
    cfg = _two_layers(olmo3_7b())
    with pytest.raises(sh.ShardingError, match="batch=3"):
        dr.dry_run(cfg, {"data": 1, "fsdp": 4, "tensor": 2}, batch=3, seq=64)
    with pytest.raises(sh.ShardingError, match="needs 16 devices"):
        dr.dry_run(cfg, {"data": 2, "fsdp": 4, "tensor": 2}, batch=8, seq=64)
    bad = cfg.replace(num_heads=33, num_kv_heads=33)  # 33 heads over tensor=2
    with pytest.raises(sh.ShardingError, match=r"\['layers'\]\['(q|k|v|o)'\].*heads"):
        dr.dry_run(bad, {"data": 1, "fsdp": 4, "tensor": 2}, batch=4, seq=64)
    with pytest.raises(sh.ShardingError, match=r"\['embed'\].*vocab"):  # 100278 over 4
        dr.dry_run(cfg, {"data": 1, "fsdp": 2, "tensor": 4}, batch=2, seq=64)
    with pytest.raises(ValueError, match="axis:size"):
        dr.parse_mesh("fsdp=4")


def test_cli_reduced_olmo3_in_subprocess(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the child inherits it: SIMULATED
    r = dr.dry_run_subprocess("olmo3-7b", "data:2,fsdp:2,tensor:2", batch=4, seq=128,
                              num_layers=2, timeout=600, count_flops=False)
    assert r["devices"] == 8 and r["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert r["per_device_bytes"]["params"] > 0 and r["compiled_flops_per_token"] > 0
    assert "counted once" in r["compiled_flops_note"]


FULL = [
    ("olmo3-7b", "data:1,fsdp:32,tensor:2", 32, 4096),
    ("qwen3-8b", "data:1,fsdp:32,tensor:2", 32, 4096),
]


@pytest.mark.slow
@pytest.mark.parametrize("model,mesh,batch,seq", FULL, ids=[f[0] for f in FULL])
def test_full_size_dry_run_64_devices(model, mesh, batch, seq, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the child inherits it: SIMULATED
    r = dr.dry_run_subprocess(model, mesh, batch=batch, seq=seq, timeout=3000)
    print(r)
    assert r["devices"] == 64
    pd = r["per_device_bytes"]
    assert pd["params"] < 1 * 2**30  # ~7-8B bf16 params over 64 devices: ~0.25 GiB
    assert 1.0 < r["compiled_flops_per_token"] / r["model_flops_per_token_train"] < 2.0


def test_chunked_next_token_loss_equals_full_logits_loss():
    """The dry run's loss (logits chunk by chunk) == log_softmax over the full [B, T, V]
    logits, value and gradients, with left padding and a chunk that does not divide T."""
    import jax.numpy as jnp
    import numpy as np

    from pmd_jax.models import decoder
    from pmd_jax.models.config import tiny_llama

    cfg = tiny_llama().replace(vocab_size=300)
    params = decoder.init_params(cfg, jax.random.PRNGKey(0))
    tok = jax.random.randint(jax.random.PRNGKey(1), (2, 37), 0, 300)
    mask = (jnp.arange(37)[None] >= jnp.array([[0], [6]])).astype(jnp.int32)
    pos = decoder.positions_from_mask(mask)

    def full(p):
        lg, _ = decoder.forward(p, tok, pos, cfg, attn_mask=mask)
        return dr.next_token_loss(lg, tok, mask)

    def chunked(p):
        h, _ = decoder.forward(p, tok, pos, cfg, attn_mask=mask, return_hidden=True)
        return dr.chunked_next_token_loss(h, p, cfg, tok, mask, chunk=8)

    # jitted: one compile each instead of one per op (the same maths, in seconds)
    la, ga = jax.jit(jax.value_and_grad(full))(params)
    lb, gb = jax.jit(jax.value_and_grad(chunked))(params)
    assert abs(float(la) - float(lb)) < 1e-5 and float(la) > 1.0
    for a, b in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def _small_step_report(impl: str, student: int, teacher: int, response: int,
                       lora: bool = False):
    from pmd_jax.config import apply_mode, base_config, freeze
    from pmd_jax.dry_run.distill_step import distill_step_report
    from pmd_jax.models.config import ModelConfig

    c = base_config()
    c.distill.loss.chunk_size = 256
    c.lora.enabled, c.lora.r = lora, 2  # (r 2: the tiny model's hidden size is 64)
    cfg = freeze(apply_mode(c))  # (the mode's loss, as every run gets it)
    mc = ModelConfig(family="qwen3", vocab_size=1024, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16,
                     qk_norm="per_head", attention_impl=impl, attention_chunk=256)
    mesh = sh.make_mesh({"data": 1, "fsdp": 8, "tensor": 1}, devices=need_devices(8))
    return distill_step_report(cfg, mc, mesh, sh.ShardingRules.from_mapping(None), 8,
                               student, teacher, response)


def test_mel_step_compiles_on_the_abstract_batch_with_lesson_rows():
    """mode=mel's loss reads lesson rows: the dry run's abstract batch has them, as many as
    the largest step makes (mel.max_pairs on the mesh's batch axes, a power of two), each the
    prompt budget plus mel.lesson_max_tokens long, and the real step lowers on it."""
    from pmd_jax.config import apply_mode, base_config, freeze
    from pmd_jax.distill.registry import LESSON_KEYS
    from pmd_jax.distill.step import TrainStep
    from pmd_jax.dry_run.distill_step import abstract_batch, lesson_shape
    from tests.fakes import tiny_model_config

    c = base_config()
    c.mode, c.mel.max_pairs, c.mel.lesson_max_tokens = "mel", 5, 16
    c.rollout.max_prompt_tokens, c.distill.loss.topk = 32, 8
    cfg = freeze(apply_mode(c))
    assert lesson_shape(cfg, 1) == (8, 48, 16) and lesson_shape(cfg, 4) == (8, 48, 16)
    assert lesson_shape(cfg, 16) == (16, 48, 16)
    tiny = tiny_model_config(num_layers=1)
    ts = TrainStep(tiny, cfg.distill, lesson_nll_weight=float(cfg.mel.nll_weight))
    ab = abstract_batch(ts, 8, 24, 24, 8, lesson_shape(cfg, ts.batch_divisor()))
    assert set(LESSON_KEYS) <= set(ab) and ab["lesson_tokens"].shape == (8, 48)
    assert ab["lesson_mask"].shape == (8, 16) and "teacher_tokens" not in ab
    ts.lower(ts.abstract_state(), ab)


@needs8
def test_a_lora_dry_run_compiles_the_adapter_step_with_its_base():
    """lora.enabled: the dry run compiles the step the run takes (adapters in the state, the
    frozen base an argument) and reports it; its arguments are the base plus the adapters'
    state, less than the full state's params + moments + teacher (at a rank small beside the
    hidden size, as r=16 is beside real models')."""
    full = _small_step_report("chunked", 64, 64, 32)
    lo = _small_step_report("chunked", 64, 64, 32, lora=True)
    assert full["lora"] is None and lo["lora"].startswith("LoraConfig(")
    assert 0 < lo["argument_bytes"] < full["argument_bytes"], (lo, full)


@needs8
def test_distill_step_memory_bounded_with_chunked_attention():
    """The real distillation step (student + teacher forward, backward, loss, optimizer) on a
    small-width model at long-ish sequences: dense attention needs at least one [T, S] score
    tensor per device, chunked attention has no array with two sequence axes and a temp
    figure far below one such tensor."""
    from pmd_jax.dry_run.distill_step import format_step_memory

    S, T, R = 2048, 3072, 1024
    one_scores_gib = 8 * T * T * 4 / 2**30  # 1 row per device x 8 heads x T x T float32
    dense = _small_step_report("dense", S, T, R)
    chunked = _small_step_report("chunked", S, T, R)
    print(format_step_memory(dense))
    print(format_step_memory(chunked))
    assert dense["temp_size_gib"] >= one_scores_gib
    assert any(f"{T},{T}" in s for s in dense["seq_x_seq_shapes"])
    assert chunked["seq_x_seq_shapes"] == []
    assert chunked["temp_size_gib"] < one_scores_gib / 4
    assert "temp" in format_step_memory(chunked) and chunked["attention_impl"] == "chunked"


@pytest.mark.slow
def test_qwen3_8b_distill_step_8k_response_in_subprocess():
    """configs/qwen3.py's distillation step at full size (student 10240, teacher 18432 tokens,
    64 simulated devices), ~1-2 min of XLA:CPU compile: no [T, S] array anywhere."""
    import json
    import subprocess
    import sys

    code = (
        "import os, json, importlib.util\n"
        "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=64'\n"
        "import jax\n"
        "from pmd_jax.dry_run.distill_step import distill_step_report, mesh_shape\n"
        "from pmd_jax.models.config import preset\n"
        "from pmd_jax.run.sharding import ShardingRules, make_mesh\n"
        "from pmd_jax.loop.build import attention_options\n"
        "spec = importlib.util.spec_from_file_location('c', 'configs/qwen3.py')\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "from pmd_jax.config import apply_mode, freeze\n"
        "cfg = freeze(apply_mode(m.get_config()))\n"
        "mc = preset('qwen3-8b').replace(dtype=cfg.model.dtype,\n"
        "    param_dtype=cfg.model.param_dtype, **attention_options(cfg))\n"
        "shape = mesh_shape(cfg, jax.device_count())\n"
        "resp = int(cfg.rollout.max_tokens)\n"
        "r = distill_step_report(cfg, mc, make_mesh(shape), ShardingRules.from_mapping(None),\n"
        "    shape['data'] * shape['fsdp'], int(cfg.rollout.max_prompt_tokens) + resp,\n"
        "    int(cfg.teacher_prompt.max_tokens) + resp, resp)\n"
        "print(json.dumps(r))\n"
    )
    env = {**child_env(), **SIMULATED}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=1800, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(r)
    assert r["attention_impl"] == "chunked"
    assert (r["student_len"], r["teacher_len"], r["response_len"]) == (10240, 18432, 8192)
    assert r["seq_x_seq_shapes"] == []
    # dense attention: 134 GiB temp per device (one [8, 4, 18432, 18432] float32 score tensor
    # alone is 40.5 GiB); chunked: 54 GiB, 37 GiB of it the loss's lax.top_k all-gather;
    # with the vocab-sharded top-K (distill/sharded_topk.py): 19.0 GiB
    assert r["temp_size_gib"] < 24


# --------------------------------------------------------------------------- hardware targets
def test_verdict_and_roofline_on_numbers():
    from pmd_jax.dry_run import hardware as tg

    v = tg.verdict(60 * 10**9, 80 * 10**9)
    assert v.fits and v.word == "FITS" and v.headroom_bytes == 20 * 10**9
    assert v.headroom_frac == pytest.approx(0.25)
    v = tg.verdict(100 * 10**9, 80 * 10**9)
    assert not v.fits and v.word == "DOES NOT FIT" and v.headroom_bytes == -20 * 10**9
    assert v.headroom_frac == pytest.approx(-0.25)
    assert tg.verdict(80, 80).fits  # exactly full still fits
    with pytest.raises(ValueError, match="HBM"):
        tg.verdict(1, 0)
    h100 = tg.get_target("8xH100")
    assert (h100.chips, h100.hbm_bytes) == (8, 80 * 10**9)
    assert tg.get_target("v5p-64").chips == 32  # 64 TensorCores, 2 per chip
    # 989e12 FLOPs at 989 TFLOP/s: 1 s compute; 3.35e12 bytes at 3.35 TB/s: 1 s memory
    r = tg.roofline(2 * 989e12, 3.35e12, h100, model_flops=989e12)
    assert r.seconds == pytest.approx(2.0) and r.bound == "compute"
    assert r.mfu == pytest.approx(0.5)
    r = tg.roofline(989e12, 4 * 3.35e12, h100)
    assert r.seconds == pytest.approx(4.0) and r.bound == "memory"
    assert r.mfu == pytest.approx(0.25)
    with pytest.raises(ValueError, match="unknown dry-run target 'v9'"):
        tg.get_target("v9")

    class MA:  # the attribute names of jax's CompiledMemoryStats
        argument_size_in_bytes, output_size_in_bytes = 10, 4
        alias_size_in_bytes, temp_size_in_bytes = 3, 7

    assert tg.memory_need(MA())["total"] == 10 + 4 - 3 + 7


def _main(*args, timeout=1500):
    import subprocess
    import sys

    env = {**child_env(), **SIMULATED}
    return subprocess.run(
        [sys.executable, "-m", "pmd_jax.main", "--config=configs/smollm2_sciq.py", "--dry_run",
         *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_dry_run_target_bad_settings_fail_before_compiling():
    p = _main("--config.dry_run.target=v9")
    assert p.returncode == 2 and "dry_run.target='v9' is not one of" in p.stderr
    p = _main("--config.dry_run.target=8xH100", "--config.train.microbatch_rows=5")
    assert p.returncode == 2 and "train.microbatch_rows=5 does not divide" in p.stderr


def test_dry_run_target_does_not_fit_exits_nonzero():
    """tiny-llama (vocab 49152) with 8192 rows of 512 response tokens on 8 x H100: each
    device's logits of one loss chunk alone are 1024 rows x 512 x 49152 x 4 bytes = 96 GiB.
    The decode step's arguments are the compute-dtype params and the KV cache, checked
    against the direct formula."""
    import json

    from pmd_jax.models.config import preset

    p = _main("--config.dry_run.target=8xH100", "--config.model.preset=tiny-llama",
              "--config.rollout.problems_per_step=2048", "--config.rollout.n=4",
              "--config.rollout.max_tokens=512", "--config.dry_run.roofline=False")
    assert p.returncode == 1, p.stderr[-3000:]
    assert "DOES NOT FIT" in p.stdout
    r = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("{")))
    # a GPU target: the step's GPU program too (StableHLO without the CUDA plugin)
    assert r["gpu"]["path"] in ("cuda_stablehlo", "xla_gpu_compile"), r["gpu"]
    # the loss's top-100 is the two-stage one on a GPU (issue 50, part 2): its full sort is
    # only the exact fallback's, in a conditional branch
    assert "GPU program:" in p.stdout
    assert "(a) vocabulary sort: only in a conditional branch" in p.stdout
    tr, de = r["train_step"], r["decode_step"]
    assert r["fits"] is False and tr["verdict"] == "DOES NOT FIT" and tr["rows"] == 8192
    assert tr["total"] > 80 * 10**9 and tr["headroom"] < 0
    assert de["verdict"] == "FITS" and de["rows"] == 64 and de["context"] == 384 + 512
    mc = preset("tiny-llama")
    kv = 2 * mc.num_layers * (64 // 8) * mc.num_kv_heads * 896 * mc.head_dim * 4
    params = mc.num_params() * 4 / 8  # float32, fsdp over 8 (norms replicated: tiny)
    assert de["arguments"] == pytest.approx(params + kv, rel=0.02)
