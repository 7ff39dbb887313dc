"""One loader for every source a user may name: a local Hugging Face directory (safetensors),
a GGUF file, a pack name from ``engine.models.fetch``, or a hub id (when a hub is reachable).

GGUF files are dequantized once by ``transformers``' GGUF reader and the result is cached as an
ordinary Hugging Face directory (fp32 safetensors + config + tokenizer with its chat template), so
a restart loads in seconds.  The cache key is the file's size and a hash of its first and last
megabytes, so a replaced file is converted again while a moved one is not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.models.fetch import default_cache_dir
from engine.models.llama import build_model
from engine.models.model import Model

log = logging.getLogger(__name__)

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}


class ModelLoadError(RuntimeError):
    """The model source cannot be found, fetched or read."""


@dataclass
class LoadedModel:
    model: Model
    config: ModelConfig
    tokenizer: Any  # transformers PreTrainedTokenizerBase
    source: str  # what the user asked for
    path: Path  # the local Hugging Face directory the weights came from
    load_seconds: float = 0.0


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32") from None


def parse_device(name: str) -> torch.device:
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unsupported device {name!r}; use cpu or cuda[:N]") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {name!r}; use cpu or cuda[:N]")
    return dev


def load_model(source: str, dtype: str | torch.dtype = "bf16", device: str = "cpu",
               cache_dir: str | Path | None = None, gguf_weights: str = "dequantize",
               quantize: str = "none", tokenizer_of: Optional[LoadedModel] = None) -> LoadedModel:
    """Loads weights, config and tokenizer of ``source`` into our runtime.

    ``gguf_weights``: ``"dequantize"`` (the default) converts a GGUF file once into a cached dense
    directory; ``"native"`` keeps its quantized tensors in their blocks (CPU, with the kernels built;
    a fraction of the dense weights' memory, int8 activations as llama.cpp does: docs/quantized.md).
    ``quantize``: ``"q8_0"`` quantizes a dense model's linears on load (``"none"``: as they are).
    ``tokenizer_of``: a model already loaded (the target, for a draft) whose tokenizer this model takes,
    instead of loading its own (seconds for a large vocabulary), when the two directories hold the same bytes in
    every one of ``_TOKENIZER_FILES`` and name the same ``model_type``.  A chat template kept in a file of
    its own (``chat_template.jinja``) may differ; the engine never formats chats with a draft's."""
    t0 = time.perf_counter()
    torch_dtype, dev = parse_dtype(dtype), parse_device(device)
    if gguf_weights not in ("native", "dequantize"):
        raise ValueError(f"gguf_weights must be 'native' or 'dequantize', not {gguf_weights!r}")
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    located = locate_source(source, cache)
    from transformers import AutoConfig, AutoTokenizer

    if located.suffix == ".gguf" and gguf_weights == "native" and _native_ok(dev):
        from engine.models.gguf_native import build_native

        path = gguf_meta(located, cache)
        hf_cfg = AutoConfig.from_pretrained(path)
        cfg = ModelConfig.from_hf(hf_cfg)
        model = build_native(cfg, located, hf_cfg.model_type, torch_dtype)
    else:
        path = convert_gguf(located, cache) if located.suffix == ".gguf" else located
        hf_cfg = AutoConfig.from_pretrained(path)
        cfg = ModelConfig.from_hf(hf_cfg)
        model = build_model(cfg, read_state_dict(path, torch_dtype), torch_dtype, dev)
        if quantize != "none":
            if dev.type != "cpu":
                raise ValueError(f"--quantize {quantize} runs on the CPU kernels; use --quantize none on {dev.type}")
            from engine.models.qweight import quantize_linears

            quantize_linears(model, quantize)
    tokenizer = _same_tokenizer(tokenizer_of, path) or AutoTokenizer.from_pretrained(path)
    return LoadedModel(model, cfg, tokenizer, source, path, time.perf_counter() - t0)


#: the files that make a tokenizer, less its chat template
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json")


def _same_tokenizer(other: Optional[LoadedModel], path: Path) -> Any:
    """``other``'s tokenizer if ``path`` holds a ``tokenizer.json``, the same bytes as ``other``'s
    directory in each of :data:`_TOKENIZER_FILES` (or lacks the same ones) and the same ``model_type``
    in ``config.json``, else None."""
    if other is None or other.path is None or not (Path(path) / "tokenizer.json").is_file():
        return None

    def read(p: Path) -> Optional[bytes]:
        return p.read_bytes() if p.is_file() else None

    def model_type(d: Path) -> Optional[str]:  # AutoTokenizer's choice of class when the files name none
        return json.loads(read(d / "config.json") or b"{}").get("model_type")

    try:
        if any(read(Path(path) / f) != read(Path(other.path) / f) for f in _TOKENIZER_FILES):
            return None
        if model_type(Path(path)) != model_type(Path(other.path)):
            return None
    except (OSError, ValueError):
        return None
    log.info("%s: the tokenizer of %s (the same tokenizer files)", Path(path).name, other.source)
    return other.tokenizer


def _native_ok(device: torch.device) -> bool:
    from engine.models import qweight

    if device.type != "cpu":
        log.warning("GGUF blocks run on the CPU kernels; dequantizing for %s", device)
        return False
    if not qweight.available():
        log.warning("the CPU kernels are unavailable (%s); dequantizing the GGUF file",
                    qweight.cpu_kernels.unavailable_reason())
        return False
    return True


def resolve_source(source: str, cache_dir: Path) -> Path:
    """Returns a local Hugging Face directory holding ``source``'s weights (a GGUF file converted)."""
    located = locate_source(source, cache_dir)
    return convert_gguf(located, cache_dir) if located.suffix == ".gguf" else located


def locate_source(source: str, cache_dir: Path) -> Path:
    """A local GGUF file or Hugging Face directory for ``source`` (fetching a pack or a hub id)."""
    p = Path(source).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"{p} is a file but not a .gguf; pass a GGUF file or a model directory")
        return p
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(
            f"{p} has no config.json and {len(ggufs)} .gguf files; pass a Hugging Face model "
            f"directory or a single GGUF file")
    from engine.models import fetch

    if source in fetch.PACKS:
        return fetch.fetch_pack(source, cache_dir=cache_dir)
    if source.count("/") == 1 and not source.startswith((".", "/")):
        return download_from_hub(source)
    raise ModelLoadError(
        f"model {source!r} not found: not a local file or directory, not a known pack "
        f"({', '.join(fetch.PACKS)}), and not a hub id of the form org/name")


_TOKENIZER_BY_TYPE = ("qwen2",)  # config types whose tokenizer class AutoTokenizer takes from the type


def gguf_meta(gguf: Path, cache_dir: Path) -> Path:
    """A cached directory with ``gguf``'s config and tokenizer only (kilobytes; built once)."""
    from transformers import AutoConfig, AutoTokenizer

    def build(tmp: Path) -> None:
        log.info("first start on %s: reading its config and tokenizer from the GGUF metadata; later starts "
                 "read them from the cache", gguf.name)
        t0 = time.perf_counter()
        kw = dict(gguf_file=gguf.name)
        try:
            hf_cfg = gguf_config(gguf)
            if hf_cfg is None:  # an architecture not ours, or a transformers without the mapping
                hf_cfg = AutoConfig.from_pretrained(gguf.parent, **kw)
            ModelConfig.from_hf(hf_cfg)
            # Given a GGUF file, AutoTokenizer reads the config from its whole metadata again to choose the
            # tokenizer's class (seconds for a large vocabulary). For Qwen2 that class is named by the
            # type (the same files, tested); llama-type files keep AutoTokenizer's own choice.
            if hf_cfg.model_type in _TOKENIZER_BY_TYPE:
                kw["tokenizer_type"] = hf_cfg.model_type
            tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        except (ValueError, OSError, KeyError) as e:
            raise ModelLoadError(f"cannot read GGUF file {gguf}: {e}") from e
        hf_cfg.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        log.info("cached %s's config and tokenizer in %.1f s", gguf.name, time.perf_counter() - t0)

    return _cached_dir(cache_dir / "gguf-meta" / f"{gguf.stem}-{gguf_cache_key(gguf)}", gguf, build)


def gguf_config(gguf: Path):
    """The ``transformers`` config of a GGUF file of an architecture we run (llama, qwen2, mistral),
    built as ``transformers`` builds it (its own key mapping, defaults, tied embeddings, vocabulary
    size) from the metadata read by :func:`read_metadata`, which leaves the tokenizer's arrays undecoded
    (``AutoConfig.from_pretrained(..., gguf_file=...)`` decodes them all: seconds for a large
    vocabulary). ``None`` for other architectures, or where this ``transformers`` has no such mapping:
    the caller then asks ``transformers``. Tested to give the same config as it
    (``tests/engine/models/test_gguf_native.py``)."""
    from engine.models.gguf_native import GGUFArray, read_metadata

    try:
        from transformers import CONFIG_MAPPING
        from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING
    except ImportError:
        return None
    meta, tensor_names = read_metadata(gguf)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        return None
    # as transformers reads it: a llama file named exactly "mistral" is a Mistral model
    model_type = "mistral" if arch == "llama" and meta.get("general.name") == "mistral" else arch
    config: dict[str, Any] = {"tie_word_embeddings": "output.weight" not in tensor_names}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(model_type, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}).items():
        config.setdefault(key, value)
    for key, value in meta.items():
        prefix, _, rest = key.replace(arch, model_type).partition(".")
        name = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if name is None or name == -1:
            continue
        if isinstance(value, GGUFArray):
            return None  # an array-valued setting: transformers' own reader decodes it
        config[name] = value.replace(arch, model_type) if isinstance(value, str) and arch in value else value
    if "vocab_size" not in config:
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, GGUFArray):
            return None
        config["vocab_size"] = tokens.count
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


def download_from_hub(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(
            repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]))
    except Exception as e:  # network, auth, missing repo: all end the same way for the user
        raise ModelLoadError(
            f"could not download {repo_id!r} from the model hub ({type(e).__name__}: {e}). "
            f"Without hub access, pass a local directory, a GGUF file or a pack name") from e


def read_state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Reads every safetensors shard, casting tensor by tensor to keep peak memory low."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {path}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():
                sd[name] = st.get_tensor(name).to(dtype)
    return sd


def gguf_cache_key(gguf: Path) -> str:
    size = gguf.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantizes ``gguf`` into a cached Hugging Face directory (once) and returns it."""
    out = cache_dir / "converted" / f"{gguf.stem}-{gguf_cache_key(gguf)}"
    if not _complete(out):
        log.warning("converting %s once (dequantizing; later loads use %s)", gguf.name, out)
    return _cached_dir(out, gguf, lambda tmp: _convert_into(gguf, tmp))


def _complete(out: Path) -> bool:
    return (out / "mcsd-complete.json").is_file()


def _cached_dir(out: Path, gguf: Path, build) -> Path:
    """``out``, built once from ``gguf`` by ``build(tmp)`` into a temporary directory that is renamed
    into place with a completion marker, so an interrupted build is never mistaken for a finished one."""
    if _complete(out):
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        (tmp / "mcsd-complete.json").write_text(json.dumps({"source": str(gguf), "key": gguf_cache_key(gguf)}))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _convert_into(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name)
    try:
        hf_cfg = AutoConfig.from_pretrained(gguf.parent, **kw)
        ModelConfig.from_hf(hf_cfg)  # reject unsupported architectures before the slow part
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    except (ValueError, OSError, KeyError) as e:
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {e}") from e
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf_cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(out / "model.safetensors"))
    hf_cfg.save_pretrained(out)
    tok.save_pretrained(out)
