"""Decode speed and TTFT of OpenAI-compatible servers side by side: ours with
fp32 and with ``--quantization gguf``, llama.cpp's server on the bundled GGUF, vLLM, ...

One client, the same prompts, one request (or one burst) at a time
(``--server NAME=URL[,KEY[,MODEL]]``, repeatable; the first is the baseline of the ratios unless
``--baseline`` names another). Each phase's repetitions alternate across the servers (A B C, then
C B A, ...), so every server's figures come from the same minutes: a 2-vCPU VM's speed drifts
by up to 1.4x within minutes. The 16-concurrent rounds also print each round's ratio to the
baseline.

1. single-stream decode: one chat request at a time, ``max_tokens`` 128, decode tokens/s =
   (streamed tokens - 1) / (time from the first to the last token); median of 3;
2. 16 concurrent chat requests sharing a ~1,750-token system prompt, 64 tokens each: output
   tokens / wall time (warmed once with the system prompt); median of 3 rounds, each with 16
   new questions (one round's figure can move by up to 1.7x between passes on a 2-vCPU VM); each
   round's line also gives its replies' own decode rates (min, median, max), which show a
   server that runs requests one at a time changing speed within a round;
3. cold TTFT: a ~1,750-token prompt no server has seen (median of 3);
4. warm TTFT: the same long prefix again with a new question (median of 3).

Tokens are counted as streamed chunks with text (one token each on our server, vLLM and
llama.cpp). Requests are greedy (temperature 0) unless ``--temperature`` / ``--top-p`` say
otherwise: every server then samples with those settings and its own defaults for the rest
(top_k, min_p, ...), which is how chat clients usually call them, but not a like-for-like
sampler. Targets (4-bit weights against llama.cpp): single stream >= 1.0x,
16 concurrent >= 10x, cold TTFT <= 0.5x, warm TTFT <= 1.0x.

Usage: ``python benchmarks/bench_servers.py --server ours-gguf=http://127.0.0.1:8000,KEY
--server llamacpp=http://127.0.0.1:8002 [--baseline llamacpp]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from app.bench.baselines import parse_peer
from app.bench.validate import WORDS


def system_prompt(rng: random.Random, words: int = 1300) -> str:
    """About 1,750 tokens of instructions (1.3 tokens per word), unique per ``rng``."""
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are the assistant of port authority {rng.getrandbits(32):08x}. Rules: {body}"


class Server:
    def __init__(self, name: str, url: str, key: str, model: str | None,
                 sampling: dict[str, float] | None = None) -> None:
        self.name, self.url = name, url
        self.sampling = sampling or {"temperature": 0}
        self.client = httpx.Client(timeout=600, headers={"Authorization": f"Bearer {key}"})
        self.model = model or self.client.get(url + "/v1/models").json()["data"][0]["id"]

    def chat(self, messages: list[dict], max_tokens: int) -> tuple[float, float, int]:
        """(TTFT s, seconds from first to last token, tokens streamed)."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                **self.sampling, "stream": True}
        start = time.perf_counter()
        first = last = None
        tokens = 0
        with self.client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{self.name}: {r.status_code} {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choices = json.loads(line[6:]).get("choices") or []
                if any((c.get("delta") or {}).get("content") for c in choices):
                    last = time.perf_counter()
                    first = first or last
                    tokens += 1
        if first is None:
            raise RuntimeError(f"{self.name} streamed no tokens")
        return first - start, last - first, tokens


def decode_rate(span: float, tokens: int) -> float | None:
    """A reply's decode tokens/s: (tokens - 1) / seconds from its first to its last token, or
    None for a reply of fewer than 2 tokens (a sampled reply may end at once)."""
    return (tokens - 1) / span if tokens >= 2 and span > 0 else None


class Run:
    """One server's measurements, taken a repetition at a time (``step``) so that the servers'
    repetitions can alternate: a 2-vCPU VM's speed drifts by up to 1.4x within minutes, and a
    ratio of two figures taken minutes apart measures the drift as much as the servers."""

    def __init__(self, s: Server, seed: int) -> None:
        self.s, self.rng = s, random.Random(seed)  # every server gets the same prompts
        self.decode: list[float] = []
        self.cold: list[float] = []
        self.warm: list[float] = []
        self.concurrent: list[float] = []
        self.request_rates: list[list[float]] = []  # per 16-concurrent round, sorted
        self.story = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
        self.shared = ""

    def warm_up(self) -> None:
        self.s.chat(self.story, 8)

    def single_stream(self) -> None:
        """One decode figure (a sampled reply may end at once: only replies of 2+ tokens
        count, up to 10 tries for each figure)."""
        for _ in range(10):
            rate = decode_rate(*self.s.chat(self.story, 128)[1:])
            if rate is not None:
                self.decode.append(rate)
                return
        raise RuntimeError(f"{self.s.name}: no reply of 2+ tokens in 10 tries")

    def ttft(self, i: int) -> None:
        system = system_prompt(self.rng)
        self.cold.append(self.s.chat([{"role": "system", "content": system},
                                      {"role": "user", "content": f"Question {i}: which berth?"}],
                                     4)[0])
        self.warm.append(self.s.chat([{"role": "system", "content": system},
                                      {"role": "user", "content": f"Question {i}: which crane?"}],
                                     4)[0])

    def share(self) -> None:
        """The 16-concurrent rounds' system prompt, sent once to warm the server."""
        self.shared = system_prompt(self.rng)
        self.s.chat([{"role": "system", "content": self.shared},
                     {"role": "user", "content": "Hello"}], 1)

    def concurrent_round(self, rnd: int) -> None:
        asks = [[{"role": "system", "content": self.shared},
                 {"role": "user", "content": f"Question {i}: tell me about pier {16 * rnd + i}."}]
                for i in range(16)]
        start = time.perf_counter()
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda m: self.s.chat(m, 64), asks))
        self.concurrent.append(sum(n for _, _, n in results) / (time.perf_counter() - start))
        # Each reply's own decode rate: a server that runs one request at a time (llama-cpp-
        # python's) shows here whether its decode speed moved within the round.
        rates = (decode_rate(span, n) for _, span, n in results)
        self.request_rates.append(sorted(r for r in rates if r is not None))

    def result(self) -> dict[str, float]:
        return {"decode_tok_s": statistics.median(self.decode),
                "concurrent16_tok_s": statistics.median(self.concurrent),
                "cold_ttft_s": statistics.median(self.cold),
                "warm_ttft_s": statistics.median(self.warm)}


def measure(runs: list[Run], reps: int = 3) -> None:
    """Every phase's ``reps`` repetitions in turn across the servers, the order reversed
    every other repetition (A B C, C B A, ...), so each server's figures come from the same
    minutes as the others'."""
    def each(rep: int):
        return runs if rep % 2 == 0 else runs[::-1]

    for r in runs:
        print(f"warming {r.s.name} at {r.s.url} ...", flush=True)
        r.warm_up()
    for rep in range(reps):
        for r in each(rep):
            r.single_stream()
    for rep in range(reps):
        for r in each(rep):
            r.ttft(rep)
    for r in runs:
        r.share()
    for rep in range(reps):
        for r in each(rep):
            r.concurrent_round(rep)
            rates = r.request_rates[-1]
            spread = (f" (replies' own decode: min {rates[0]:.0f}, median "
                      f"{statistics.median(rates):.0f}, max {rates[-1]:.0f} tok/s)"
                      if rates else "")
            print(f"16 concurrent, round {rep + 1}: {r.s.name} {r.concurrent[-1]:.1f} tok/s"
                  f"{spread}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", action="append", required=True,
                        metavar="NAME=URL[,KEY[,MODEL]]")
    parser.add_argument("--baseline", default=None, help="[the first server]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="Sent with every request. [0: greedy]")
    parser.add_argument("--top-p", type=float, default=None,
                        help="Sent with every request when given. [not sent]")
    args = parser.parse_args()
    sampling = {"temperature": args.temperature}
    if args.top_p is not None:
        sampling["top_p"] = args.top_p
    peers = [parse_peer(spec) for spec in args.server]
    runs = [Run(Server(p.name, p.url, p.api_key, p.model, sampling), args.seed)
            for p in peers]
    measure(runs)
    rows = {r.s.name: r.result() for r in runs}
    base_name = args.baseline or peers[0].name
    base = rows[base_name]
    print(f"\nsampling: {json.dumps(sampling)} (each server's own sampler for the rest)")
    print(f"\n{'server':14} {'1 stream':>10} {'16 concurrent':>14} {'cold TTFT':>10} "
          f"{'warm TTFT':>10}   ratios to {base_name}")
    for name, r in rows.items():
        print(f"{name:14} {r['decode_tok_s']:7.1f}/s {r['concurrent16_tok_s']:11.1f}/s "
              f"{r['cold_ttft_s']:9.3f}s {r['warm_ttft_s']:9.3f}s   "
              f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x "
              f"{r['concurrent16_tok_s'] / base['concurrent16_tok_s']:.2f}x "
              f"{r['cold_ttft_s'] / base['cold_ttft_s']:.2f}x "
              f"{r['warm_ttft_s'] / base['warm_ttft_s']:.2f}x")
    by_name = {r.s.name: r for r in runs}
    print(f"\n16 concurrent, each round's ratio to {base_name} (taken in the same minute):")
    for name, r in by_name.items():
        if name != base_name:
            ratios = [a / b for a, b in zip(r.concurrent, by_name[base_name].concurrent)]
            print(f"{name:14} " + " ".join(f"{x:.2f}x" for x in ratios))


if __name__ == "__main__":
    main()
