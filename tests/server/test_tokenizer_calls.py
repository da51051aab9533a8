"""Every tokenizer call the server makes, against the transformers version installed, one test per
call: through the route that makes it, on a tokenizer that adds a BOS of its own (so
``add_special_tokens`` shows) and on the shipped byte-level BPE one. A static check lists the
tokenizer attributes the server's code uses and finds each on both tokenizers' classes (transformers
5 dropped ``build_inputs_with_special_tokens`` from its fast tokenizers: a 500 until this)."""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_helpers import API_KEY, CHAT_TEMPLATE, ServerThread

import pagedllm

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"}]
PROMPT = "t5 t6 t7"


def _bos_word_tokenizer(path: Path) -> None:
    """The tests' word-level tokenizer ("t17" <-> 17) with a post-processor that puts t1 (BOS)
    first, as Llama's tokenizers do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="t1 $A", special_tokens=[("t1", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", bos_token="t1",
                                   unk_token="t0", pad_token="t3", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(path)


@pytest.fixture(scope="module", params=["bos-word", "shipped-bpe"])
def server(request: pytest.FixtureRequest, tiny_models: dict[str, Path], bpe_model: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import build_app

    if request.param == "bos-word":
        path = tmp_path_factory.mktemp("bos") / "llama"
        shutil.copytree(tiny_models["llama"], path)
        _bos_word_tokenizer(path)
    else:
        path = bpe_model
    engine = LLMEngine.from_args(model=str(path), block_size=4, num_kv_blocks=256, max_model_len=128)
    with ServerThread(build_app(engine, model_name="m", api_key=API_KEY,
                                chat_template=CHAT_TEMPLATE)) as s:
        yield s


def _post(s: ServerThread, path: str, body: dict[str, Any]) -> Any:
    r = httpx.post(s.base_url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _rendered(s: ServerThread) -> str:
    return str(s.call(lambda e: e.tokenizer.apply_chat_template(
        MESSAGES, chat_template=CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True)))


def test_encode_of_a_completion_prompt(server: ServerThread) -> None:
    """prompts._text_prompt: ``encode(text)``, the tokenizer's special tokens included."""
    want = server.call(lambda e: e.tokenizer.encode(PROMPT))
    r = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})
    assert r["usage"]["prompt_tokens"] == len(want)
    t = _post(server, "/tokenize", {"prompt": PROMPT})
    assert t["tokens"] == want and t["count"] == len(want)
    server.wait_idle()


@pytest.mark.parametrize("special", [True, False])
def test_encode_of_a_tokenize_prompt(server: ServerThread, special: bool) -> None:
    """tokenize: ``encode(prompt, add_special_tokens=...)``."""
    want = server.call(lambda e: e.tokenizer.encode(PROMPT, add_special_tokens=special))
    t = _post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": special})
    assert t["tokens"] == want


def test_apply_chat_template_and_encode_of_a_chat(server: ServerThread) -> None:
    """chat.render_chat: ``apply_chat_template(tokenize=False)`` then ``encode(text,
    add_special_tokens=False)``: a chat completion's prompt and /tokenize's messages agree."""
    text = _rendered(server)
    want = server.call(lambda e: e.tokenizer.encode(text, add_special_tokens=False))
    r = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert r["usage"]["prompt_tokens"] == len(want)
    assert _post(server, "/tokenize", {"messages": MESSAGES})["tokens"] == want
    server.wait_idle()


@pytest.mark.parametrize("special", [True, False])
def test_tokenize_messages_with_add_special_tokens(server: ServerThread, special: bool) -> None:
    """tokenize of messages with ``add_special_tokens``: the rendered text encoded with the
    tokenizer's special tokens (vLLM's meaning); was a 500 on transformers 5."""
    text = _rendered(server)
    want = server.call(lambda e: e.tokenizer.encode(text, add_special_tokens=special))
    t = _post(server, "/tokenize", {"messages": MESSAGES, "add_special_tokens": special})
    assert t["tokens"] == want
    plain = server.call(lambda e: e.tokenizer.encode(text, add_special_tokens=False))
    if special and server.call(lambda e: e.tokenizer.bos_token_id) == 1:  # the BOS tokenizer
        assert want == [1, *plain]


def test_convert_ids_to_tokens(server: ServerThread) -> None:
    """tokenize with ``return_token_strs``: ``convert_ids_to_tokens(ids)``, one string per id."""
    t = _post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    want = server.call(lambda e: e.tokenizer.convert_ids_to_tokens(t["tokens"]))
    assert t["token_strs"] == want and all(isinstance(x, str) for x in want)


def test_decode(server: ServerThread) -> None:
    """detokenize: ``decode(ids)``."""
    ids = server.call(lambda e: e.tokenizer.encode(PROMPT))
    want = server.call(lambda e: e.tokenizer.decode(ids))
    assert _post(server, "/detokenize", {"tokens": ids}) == {"prompt": want}
    assert "t6" in want or "6" in want


def _tokenizer_attributes() -> dict[str, set[str]]:
    """{attribute: files} for every ``<x>.tokenizer.ATTR`` / ``tokenizer.ATTR`` / ``tok.ATTR``
    the server's code (and the chat rendering it calls) uses."""
    root = Path(pagedllm.__file__).parent
    files = [*sorted((root / "server").rglob("*.py")), root / "chat.py"]
    used: dict[str, set[str]] = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            v = node.value
            name = v.attr if isinstance(v, ast.Attribute) else v.id if isinstance(v, ast.Name) else None
            if name in ("tokenizer", "tok"):
                used.setdefault(node.attr, set()).add(f.name)
    return used


def test_every_tokenizer_attribute_the_server_uses_exists(server: ServerThread) -> None:
    used = _tokenizer_attributes()
    assert {"encode", "decode", "convert_ids_to_tokens", "apply_chat_template"} <= set(used)
    missing = server.call(lambda e: sorted(a for a in used if not hasattr(e.tokenizer, a)))
    assert not missing, f"{missing} (used in {[sorted(used[a]) for a in missing]}) do not exist " \
                        f"on {server.call(lambda e: type(e.tokenizer).__name__)}"
