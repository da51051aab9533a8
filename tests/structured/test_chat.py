"""``LLM.chat``: conversations through the chat template (the tokenizer's, a file or a string),
``chat_template_kwargs`` reaching the template, structured outputs on chat replies."""

from __future__ import annotations

from pathlib import Path

import pytest
from structured_helpers import SMALL_SCHEMA, check_json

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

CONV = [{"role": "user", "content": "Describe an item as JSON."}]
GREET = "{% if greeting %}{{ greeting }}\n{% endif %}{% for m in messages %}{{ m.content }}\n{% endfor %}"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=16, num_kv_blocks=256)


def test_chat_is_generate_on_the_rendered_template(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tok = llm.get_tokenizer()
    want = tok.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    ref = llm.generate({"prompt_token_ids": tok.encode(want, add_special_tokens=False)}, greedy,
                       use_tqdm=False)[0]
    got = llm.chat(CONV, greedy, use_tqdm=False)
    assert len(got) == 1 and got[0].prompt_token_ids == ref.prompt_token_ids
    assert got[0].outputs[0].token_ids == ref.outputs[0].token_ids
    two = llm.chat([CONV, CONV + [{"role": "assistant", "content": "ok"}]], greedy, use_tqdm=False)
    assert len(two) == 2 and len(two[1].prompt_token_ids) > len(two[0].prompt_token_ids)


def test_chat_template_and_its_kwargs(llm: LLM, tmp_path: Path) -> None:
    tok = llm.get_tokenizer()
    p = SamplingParams(temperature=0.0, max_tokens=1)
    plain = llm.chat(CONV, p, use_tqdm=False, chat_template=GREET)[0]
    assert plain.prompt_token_ids == tok.encode(CONV[0]["content"] + "\n", add_special_tokens=False)
    f = tmp_path / "t.jinja"
    f.write_text(GREET)
    greeted = llm.chat(CONV, p, use_tqdm=False, chat_template=str(f),
                       chat_template_kwargs={"greeting": "Hello"})[0]
    assert greeted.prompt_token_ids == tok.encode("Hello\n" + CONV[0]["content"] + "\n",
                                                  add_special_tokens=False)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        llm.chat(CONV, p, use_tqdm=False, chat_template_kwargs={"tokenize": True})
    with pytest.raises(ValueError, match="chat_template 'no-such-file' is neither"):
        llm.chat(CONV, p, use_tqdm=False, chat_template="no-such-file")


def test_chat_with_a_json_schema(llm: LLM) -> None:
    so = StructuredOutputsParams(json=SMALL_SCHEMA)
    outs = llm.chat([CONV] * 6, [SamplingParams(temperature=1.0, seed=s, max_tokens=80,
                                                structured_outputs=so) for s in range(6)],
                    use_tqdm=False)
    for o in outs:
        check_json(o.outputs[0].text, SMALL_SCHEMA)
        assert o.outputs[0].finish_reason == "stop"
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_continue_final_message(llm: LLM) -> None:
    """vLLM's ``continue_final_message``: the prompt ends inside the last (assistant) message,
    without its end-of-turn and without a generation prompt, so the model continues it."""
    tok = llm.get_tokenizer()
    conv = CONV + [{"role": "assistant", "content": 'Here it is: {"name": "'}]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = llm.chat(conv, greedy, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    # the shipped template: "<|role|>\n" + content + "<|eos|>\n" per message
    want = f'<|user|>\n{CONV[0]["content"]}<|eos|>\n<|assistant|>\nHere it is: {{"name": "'
    assert got.prompt_token_ids == tok.encode(want, add_special_tokens=False)
    ref = llm.generate({"prompt_token_ids": got.prompt_token_ids}, greedy, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    closed = llm.chat(conv, greedy, use_tqdm=False, add_generation_prompt=False)[0]
    assert tok.decode(closed.prompt_token_ids).endswith('"name": "<|eos|>\n')
    with pytest.raises(ValueError, match="Cannot set both `continue_final_message` and "
                                         "`add_generation_prompt`"):
        llm.chat(conv, greedy, use_tqdm=False, continue_final_message=True)
