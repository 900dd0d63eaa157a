"""``engine.weights.load_tokenizer``: the same tokenizer as ``AutoTokenizer``, loaded without
importing transformers' model code (server start-up time)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from engine.weights import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnew lines", "naïve café — 東京 🙂",
         "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "def f(x):\n    return x**2"]


def test_it_is_what_autotokenizer_gives(model_dir, tokenizer):
    fast = load_tokenizer(model_dir)
    assert type(fast) is type(tokenizer)
    for text in TEXTS:
        assert fast.encode(text) == tokenizer.encode(text)
        ids = tokenizer.encode(text)
        assert fast.decode(ids) == tokenizer.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert (fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True))
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                 "all_special_ids"):
        assert getattr(fast, attr) == getattr(tokenizer, attr), attr
    assert len(fast) == len(tokenizer) and fast.get_vocab() == tokenizer.get_vocab()


def test_a_folder_naming_another_class_goes_through_autotokenizer(model_dir, tokenizer,
                                                                   tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"  # not the tokenizers backend: the slow path
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    code = ("import sys; from engine.weights import load_tokenizer; "
            f"t = load_tokenizer({str(folder)!r}); "
            "print(type(t).__name__, 'transformers.models.auto.configuration_auto' in "
            "sys.modules, t.encode('Hello, world!'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split(maxsplit=2)
    assert out[1] == "True"  # AutoTokenizer resolved it
    assert out[2].strip() == str(tokenizer.encode("Hello, world!"))


def test_the_fast_path_imports_no_model_code(model_dir):
    """What start-up saves: neither transformers' auto-config machinery (AutoTokenizer) nor
    torch._dynamo (meta-device tensor ops in the model constructor) is imported."""
    code = ("import sys; from engine.weights import load_tokenizer; "
            f"load_tokenizer({str(model_dir)!r}); "
            "from engine.models.config import ModelConfig; "
            "from engine.models.decoder import DecoderForCausalLM; "
            "from engine.attention import get_attention_backend; import torch; "
            f"cfg = ModelConfig.from_pretrained({str(model_dir)!r}); "
            "DecoderForCausalLM(cfg, 64, get_attention_backend('torch', "
            "torch.device('cpu'))); "
            "print(sorted(m for m in ('transformers.models.auto.configuration_auto', "
            "'transformers.models.llama', 'torch._dynamo', 'sympy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"
