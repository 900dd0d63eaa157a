"""The new families through the real server: ``saltserve serve --model <folder>`` on tiny
random-weight checkpoints (transformers' own config classes, the bundled tokenizer and its chat
template) answers the OpenAI SDK with Hugging Face's greedy tokens, hits its prefix cache on a
repeat, keeps tenants apart on it, and refuses a hostile request without harm to the next."""

from __future__ import annotations

import openai
import pytest
import torch
from serve_process import serve
from tiny_checkpoints import build_checkpoint


def hf_greedy_text(model_dir, tokenizer, prompt: str, n: int) -> tuple[list[int], str]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          min_new_tokens=n, pad_token_id=0)[0, len(ids):].tolist()
    return out, tokenizer.decode(out, skip_special_tokens=True)


@pytest.mark.parametrize("family", ["gemma2", "qwen3-moe"])
def test_saltserve_serve_runs_a_new_family(family, model_dir, tokenizer, tmp_path):
    ckpt = build_checkpoint(family, tmp_path / "models", tokenizer_dir=model_dir)
    prompt = ("You are a careful assistant for a company that builds bridges. Answer with "
              "facts and keep answers short. Question: which bridge is the longest?")
    ref_ids, ref_text = hf_greedy_text(ckpt, tokenizer, prompt, 12)
    with serve(ckpt, tmp_path / "data") as proc:
        key = (tmp_path / "data" / "demo-api-key").read_text().strip()
        client = openai.OpenAI(base_url=proc.base + "/v1", api_key=key)
        model = client.models.list().data[0].id
        first = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert first.choices[0].text == ref_text
        assert first.usage.completion_tokens == len(ref_ids) == 12
        with pytest.raises(openai.BadRequestError):  # over --max-model-len 512
            client.completions.create(model=model, prompt="hi " * 600, max_tokens=4)
        again = client.completions.create(model=model, prompt=prompt, max_tokens=12,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].text == ref_text
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name a bridge."}],
            max_tokens=6, temperature=0)
        assert chat.usage.completion_tokens >= 1
    assert "Traceback" not in proc.output, proc.output[-2000:]
