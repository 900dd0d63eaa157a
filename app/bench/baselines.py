"""Baselines and peers for ``saltserve bench``: other OpenAI-compatible servers given as
``--peer NAME=URL[,KEY,MODEL]``, and Hugging Face transformers ``generate`` in this process.

A peer runs the same prompts as ours, after ours and one request stream at a time, so the two
never share the machine's cores. Its cache figures come from each response's ``cached_tokens``
(vLLM needs ``--enable-prompt-tokens-details`` for them) and its block size from
``vllm:cache_config_info`` on its ``/metrics``; a block size unlike ours is reported, because a
prefix is only reused in whole blocks.

The ``generate`` baseline is how a user without a server runs the model: load it with
transformers, then call ``model.generate`` for each prompt in turn (greedy, ``max_tokens`` new
tokens, the prompt tokenised as the server would: ``tokenizer(prompt)``). TTFT is the time from
the call to the first new token handed to a streamer.
"""

from __future__ import annotations

import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.bench.validate import Sample, percentile


@dataclass(frozen=True)
class Peer:
    """Another OpenAI-compatible server: its name in reports, base URL (without ``/v1``), API
    key and model (None: its first model)."""

    name: str
    url: str
    api_key: str = "EMPTY"
    model: str | None = None


def parse_peer(spec: str) -> Peer:
    """``NAME=URL[,KEY[,MODEL]]`` (the ``--peer`` option) as a ``Peer``.

    Raises:
        ValueError: no ``NAME=``, no URL, or a URL that is not http(s).
    """
    name, sep, rest = spec.partition("=")
    parts = [p.strip() for p in rest.split(",")] if sep else []
    name = name.strip()
    if not name or not parts or not parts[0]:
        raise ValueError("expected NAME=URL[,KEY[,MODEL]], e.g. vllm=http://127.0.0.1:8001")
    if not re.fullmatch(r"[\w.-]+", name) or name == "hf_generate":
        raise ValueError(f"peer name {name!r}: letters, digits, '_', '.' and '-' only, and not "
                         "hf_generate")
    if len(parts) > 3:
        raise ValueError("expected at most URL,KEY,MODEL after NAME=")
    url = parts[0].rstrip("/").removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"peer URL must start with http:// or https://, got {url!r}")
    key = parts[1] if len(parts) > 1 and parts[1] else "EMPTY"
    model = parts[2] if len(parts) > 2 and parts[2] else None
    return Peer(name, url, key, model)


def summarise(samples: list[Sample], wall_s: float, block_size: int | None = None
              ) -> dict[str, Any]:
    """The figures every run reports (``bench profiles``' columns) from its samples and its
    wall time (seconds). ``hit_rate`` counts tokens (cached / prompt); with the server's
    ``block_size`` (tokens), ``block_hit_rate`` counts blocks: blocks reused (cached tokens /
    block size) over blocks requested (each prompt's tokens in blocks, rounded up), the seed's
    "effective hit rate"; None without it."""
    ttfts = [s.ttft_s for s in samples]
    prompt = sum(s.prompt_tokens for s in samples)
    cached = sum(s.cached_tokens for s in samples)
    itl = [(s.total_s - s.ttft_s) / (s.completion_tokens - 1) for s in samples
           if s.completion_tokens > 1]
    return {
        "requests": len(samples), "wall_s": wall_s,
        "ttft_p50_s": statistics.median(ttfts), "ttft_p95_s": percentile(ttfts, 0.95),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "itl_mean_s": statistics.fmean(itl) if itl else None,
        "requests_per_s": len(samples) / wall_s,
        "output_tokens_per_s": sum(s.completion_tokens for s in samples) / wall_s,
        "prefill_tokens_per_s": (prompt - cached) / wall_s,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "block_size": block_size,
        "block_hit_rate": _block_hit_rate(samples, block_size),
    }


def _block_hit_rate(samples: list[Sample], block_size: int | None) -> float | None:
    if not block_size:
        return None
    requested = sum(-(-s.prompt_tokens // block_size) for s in samples)
    return sum(s.cached_tokens // block_size for s in samples) / requested if requested else 0.0


class HFGenerate:
    """Hugging Face transformers ``generate`` on ``model_dir`` (a Hugging Face folder), fp32 on
    the CPU, one prompt at a time. Loads torch and transformers when built."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        # Greedy: the folder's sampling defaults (temperature, top_p) do not apply.
        self.model.generation_config.update(temperature=None, top_p=None, top_k=None)

    def complete(self, prompt: str, max_tokens: int) -> Sample:
        """Greedy ``generate`` of up to ``max_tokens`` new tokens (stops at EOS, as the server
        does); TTFT and total time in seconds."""
        from transformers.generation.streamers import BaseStreamer

        times: list[float] = []

        class Clock(BaseStreamer):  # put() gets the prompt once, then each new token
            def put(self, value: Any) -> None:
                times.append(time.perf_counter())

            def end(self) -> None:
                pass

        ids = self.tokenizer(prompt, return_tensors="pt")
        start = time.perf_counter()
        with self.torch.inference_mode():
            out = self.model.generate(**ids, max_new_tokens=max_tokens, do_sample=False,
                                      streamer=Clock(), pad_token_id=self.tokenizer.eos_token_id)
        total = time.perf_counter() - start
        new = out.shape[1] - ids["input_ids"].shape[1]
        first = times[1] - start if len(times) > 1 else total
        return Sample(first, total, int(ids["input_ids"].shape[1]), 0, int(new))


def run_hf(hf: HFGenerate, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """``prompts`` through ``generate`` one after another; ``summarise``'s figures."""
    start = time.perf_counter()
    samples = [hf.complete(p, max_tokens) for p in prompts]
    return summarise(samples, time.perf_counter() - start)
