"""Server settings: one typed object from a preset file, the environment and CLI flags.

Precedence, lowest first: field defaults < ``--config`` preset (TOML or YAML; a bare name means
``configs/<name>.toml``) < ``MCSD_*`` environment variables < command-line flags.  Every field
``foo_bar`` is ``--foo-bar`` on the command line, ``MCSD_FOO_BAR`` in the environment and
``foo_bar`` in a preset.  A drafter's settings (``engine.config.DrafterSettings``, declared in the
drafter's module) are named ``<section>_<field>`` (``maxgram_len``); a preset may also group them in a
table (``[maxgram]`` with ``len = 8``).  Values are validated once, at start-up; a bad value stops the
server with a message naming the field and where the value came from.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator

from engine.config import EngineConfig, setting_fields
from engine.registry import sections
from engine.speculative.tree import parse_widths

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
ENV_PREFIX = "MCSD_"
DTYPES = ("bf16", "bfloat16", "fp16", "float16", "half", "fp32", "float32", "float")


class SettingsError(ValueError):
    """Invalid settings; the message is meant for the person starting the server."""


class ServerSettings(BaseModel):
    """The server's own settings; :data:`Settings` adds every field of ``EngineConfig``."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    model: Optional[str] = Field(None, description="target model: pack name, HF directory, GGUF file or hub id")
    draft_model: Optional[str] = Field(None, description="draft model (same sources); none = no speculation")
    dtype: str = Field("bf16", description="weights dtype: bf16, fp16 or fp32")
    device: str = Field("cpu", description="cpu or cuda[:N]")
    gguf_weights: Literal["dequantize", "native"] = Field(
        "dequantize", description="GGUF models: 'native' keeps the quantized blocks and multiplies them with our "
        "CPU integer kernels (no conversion, about 3.5x less weight memory; the default preset's choice), "
        "'dequantize' converts once to dense weights")
    quantize: Literal["none", "q8_0", "q4_k"] = Field(
        "none", description="quantize a dense model's linears on load for the CPU kernels: q8_0 (8-bit, fast "
        "to make) or q4_k (4.5 bits, about a minute for a 1.5B model; linears whose K is not a multiple of 256 "
        "get q8_0)")
    threads: Optional[int] = Field(None, ge=1, description="CPU threads for torch (default: torch's choice)")
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0 = any free port)")
    spec_enabled: bool = Field(True, description="speculate for requests that do not say")
    max_queue: int = Field(64, ge=1, description="requests waiting for a slot before 429")
    api_key: Optional[str] = Field(None, description="require 'Authorization: Bearer <key>' on /v1/*, /tokenize and /detokenize")
    metrics_auth: bool = Field(False, description="require the API key on /metrics too")
    health_auth: bool = Field(False, description="require the API key on /health too")
    cors_origins: list[str] = Field(default_factory=list, description="allowed CORS origins, comma separated")
    served_model_name: Optional[str] = Field(None, description="model id in the API (default: --model)")
    default_max_tokens: Optional[int] = Field(
        None, ge=1, description="tokens generated when a request sets no max_tokens (default: 16 for "
                                "completions, as OpenAI; all the context leaves for chat)")
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="largest accepted request body")
    shutdown_grace: float = Field(10.0, ge=0, description="seconds in-flight requests get at shutdown")
    body_read_timeout: float = Field(30.0, gt=0, description="seconds a client may stall in the middle of its "
                                     "request body before a 408")
    header_read_timeout: float = Field(10.0, gt=0, description="seconds a connection may take to send a "
                                       "request's line and headers (at connect and between keep-alive "
                                       "requests) before it is closed")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    engine_process: bool = Field(
        False, description="run the engine core in a process of its own, so the HTTP layer's Python does not "
        "take turns with the engine's for one interpreter lock (vLLM's engine-core process): for many "
        "concurrent streams when the machine has a core to spare for the server")
    gil_switch_interval: float = Field(
        0.0005, gt=0, le=0.1, description="seconds a thread may hold the GIL while another waits for it (CPython's "
        "default is 0.005): the engine thread needs it between operators while the event loop runs Python")

    @field_validator("tree", "graph_batches", "graph_rows", mode="before", check_fields=False)
    @classmethod
    def _parse_tree(cls, v: Any) -> tuple[int, ...]:
        return parse_widths(v)

    @field_validator("acceptance_heads", mode="before", check_fields=False)
    @classmethod
    def _find_heads(cls, v: Any) -> tuple[str, ...]:
        paths = v.split(",") if isinstance(v, str) else (v or ())
        return tuple(_shipped(str(p).strip()) for p in paths if str(p).strip())

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _parse_origins(cls, v: Any) -> list[str]:
        return [s.strip() for s in v.split(",") if s.strip()] if isinstance(v, str) else v

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, v: str) -> str:
        if v.lower() not in DTYPES:
            raise ValueError(f"unknown dtype {v!r}; use bf16, fp16 or fp32")
        return v.lower()

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        kind, _, index = v.partition(":")
        if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
            raise ValueError(f"unsupported device {v!r}; use cpu or cuda[:N]")
        return v

    @property
    def model_id(self) -> str:
        """The name clients must send as ``model``."""
        return self.served_model_name or self.model or "default"

    def engine_config(self) -> EngineConfig:
        """The engine's configuration: every engine setting (``EngineConfig``'s fields and each
        drafter's), as these settings say."""
        return EngineConfig.from_settings(**{name: getattr(self, name) for name, _, _ in setting_fields()
                                             if name in type(self).model_fields})


def _shipped(path: Optional[str]) -> Optional[str]:
    """A relative path is looked up in the working directory, then in the project (presets name files
    shipped with it, e.g. ``benchmarks/prompts/train.json`` or ``configs/heads/...``)."""
    if path is None or Path(path).is_absolute() or Path(path).exists():
        return path
    shipped = CONFIG_DIR.parent / path
    return str(shipped) if shipped.exists() else path


def _engine_fields() -> dict[str, Any]:
    """Pydantic fields for every server-visible engine setting, from its declaration
    (``engine.config.setting``: ``EngineConfig``'s fields, then each drafter's section): type,
    default, help text and bounds."""
    out: dict[str, Any] = {}
    for name, kind, f in setting_fields():
        meta = f.metadata
        choices = meta.get("choices")
        if choices:
            kind = Literal[tuple(choices() if callable(choices) else choices)]
        bounds = {k: meta[k] for k in ("ge", "gt", "le", "lt") if k in meta}
        out[name] = (kind, Field(f.default, description=meta.get("help", ""), **bounds))
    return out


def settings_model() -> type[ServerSettings]:
    """The settings model for the drafters registered now (:data:`Settings` is the one made at import,
    with every drafter module of ``engine.speculative``).  Settings declared ``path=True`` are looked
    up in the project too (:func:`_shipped`)."""
    paths = [name for name, _, f in setting_fields() if f.metadata.get("path")]
    validators = {"_find_shipped": field_validator(*paths)(classmethod(lambda cls, v: _shipped(v)))} if paths else {}
    model = create_model("Settings", __base__=ServerSettings, __module__=__name__, __validators__=validators,
                         **_engine_fields())
    model.__doc__ = "Server settings: the server's own (:class:`ServerSettings`) and every engine setting."
    return model


Settings = settings_model()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser(model: Optional[type[ServerSettings]] = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m server", description=__doc__.split("\n\n")[0],
                                     argument_default=argparse.SUPPRESS)
    parser.add_argument("--config", help="preset: a TOML/YAML file, or a name in configs/ (e.g. default)")
    for name, info in (model or Settings).model_fields.items():
        if info.annotation is bool:
            parser.add_argument(_flag(name), action=argparse.BooleanOptionalAction, help=info.description)
        else:
            parser.add_argument(_flag(name), metavar=name.upper(), help=info.description)
    return parser


def read_preset(ref: str) -> dict[str, Any]:
    path = Path(ref)
    if not path.suffix and not path.exists():
        path = CONFIG_DIR / f"{ref}.toml"
    if not path.is_file():
        raise SettingsError(f"config preset {ref!r} not found (looked for {path})")
    text = path.read_text()
    try:
        data = yaml.safe_load(text) if path.suffix in (".yaml", ".yml") else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise SettingsError(f"config preset {path} is not valid: {exc}") from None
    if not isinstance(data, dict):
        raise SettingsError(f"config preset {path} must be a table of settings")
    data = data.get("server", data)  # an optional [server] table
    out: dict[str, Any] = {}
    for key, value in data.items():
        key = key.replace("-", "_")
        if isinstance(value, dict) and key in sections():  # a drafter's table: [maxgram] len = 8
            out.update({f"{key}_{k.replace('-', '_')}": v for k, v in value.items()})
        else:
            out[key] = value
    return out


def load_settings(argv: Optional[Sequence[str]] = None, environ: Optional[Mapping[str, str]] = None,
                  model: Optional[type[ServerSettings]] = None) -> Settings:
    """Settings from ``argv`` (default: sys.argv) and ``environ`` (default: os.environ); ``model``: a
    :func:`settings_model` made after registering another drafter (default: :data:`Settings`)."""
    environ = os.environ if environ is None else environ
    model = model or Settings
    cli = vars(build_parser(model).parse_args(argv))
    preset = cli.pop("config", None) or environ.get(ENV_PREFIX + "CONFIG")
    sources: dict[str, tuple[str, Any]] = {}
    if preset:
        sources.update({k: (f"config {preset}", v) for k, v in read_preset(preset).items()})
    for name in model.model_fields:
        if ENV_PREFIX + name.upper() in environ:
            sources[name] = (ENV_PREFIX + name.upper(), environ[ENV_PREFIX + name.upper()])
    sources.update({k: (_flag(k), v) for k, v in cli.items()})
    try:
        return model.model_validate({k: v for k, (_, v) in sources.items()})
    except ValidationError as exc:
        raise SettingsError(_describe(exc, sources)) from None


def _describe(exc: ValidationError, sources: dict[str, tuple[str, Any]]) -> str:
    lines = ["invalid server settings:"]
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        origin = sources.get(name, ("default", None))[0]
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown setting"
        lines.append(f"  {name} (from {origin}): {msg}")
    return "\n".join(lines)
