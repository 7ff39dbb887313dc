"""Typed engine configuration, validated once at start-up."""

from __future__ import annotations

import dataclasses
import operator
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Mapping, Optional

from engine.registry import method_names, sections
from engine.speculative.tree import parse_widths


def setting(default, help: str, *, server: bool = True, **bounds):  # noqa: A002 - the field's help text
    """An :class:`EngineConfig` or :class:`DrafterSettings` field with its help text and bounds (``ge``,
    ``gt``, ``le``, ``lt``, ``choices``: a collection, or a function returning one): the one declaration
    the server's settings, flags and environment variables are generated from (``server.settings``),
    and the bounds :func:`check_bounds` enforces.  ``path=True`` marks a file path (the server also looks
    a relative one up in the project, for presets naming shipped files).  ``server=False`` keeps a field
    out of the server's settings."""
    return field(default=default, metadata={"help": help, "server": server, **bounds})


@dataclass
class EngineConfig:
    """Everything the engine is configured with; each field also is a server setting (``--flag``,
    ``MCSD_FLAG``, a preset key) unless marked otherwise."""

    max_batch: int = setting(8, "sequences decoding together", ge=1)
    max_model_len: int = setting(4096, "context length, prompt + output (capped by the model's)", ge=2)
    tree: tuple[int, ...] = setting((4, 2, 2), "largest draft tree, widths per depth, e.g. 4,2,2 (empty: no "
                                    "speculation)")
    prefill_chunk: int = setting(512, "prompt tokens prefilled per step, so running streams keep flowing", ge=1)
    kv_cache_tokens: int = setting(0, "KV cache pool per model, in tokens (0: room for max_batch sequences of "
                                   "max_model_len each); sequences take blocks as they grow, and when the pool "
                                   "runs out the newest are preempted and recomputed later", ge=0)
    kv_block_size: int = setting(4, "positions per KV cache block: the unit of paging and of prefix sharing "
                                 "(small blocks reuse more of a prompt; the attention reads rows, so their "
                                 "size costs it nothing)", ge=1, le=1024)
    prefix_cache: bool = setting(True, "a new request reuses the cached keys and values of the longest prefix of "
                                 "its prompt that a finished or running sequence holds (chat turns, shared "
                                 "system prompts)")
    batch_invariant: bool = setting(True, "CPU: every linear and the attention compute each row alone, so a "
                                    "request's output does not depend on the rest of the batch (off: torch's "
                                    "kernels where they are faster)")
    without_replacement: bool = setting(True, "draw sibling candidates without replacement", server=False)
    # forwards at fixed shapes (engine.graphs)
    cuda_graphs: bool = setting(True, "CUDA: capture the target's and the draft's forwards as CUDA graphs at "
                                "start-up, one per bucket of batch x rows x context (graph_* settings); a forward "
                                "outside every bucket runs eagerly.  Ignored on the CPU")
    graph_batches: tuple[int, ...] = setting((1, 2, 4, 8, 16, 32), "batch buckets captured (those above max_batch "
                                             "are dropped, max_batch itself is added)")
    graph_rows: tuple[int, ...] = setting((), "rows-per-sequence buckets captured (empty: 1, 4, 16, ... up to the "
                                          "largest verification block)")
    graph_context: int = setting(256, "smallest context bucket; buckets double up to the cache's length", ge=1)
    graph_compile: bool = setting(False, "compile each decoder layer with torch.compile before capturing the "
                                  "graphs (Inductor fuses a layer's elementwise work: 27 torch kernels a layer "
                                  "eagerly); 4 graphs a model serve every bucket, kept in $MCSD_CACHE/inductor, and "
                                  "a layer that fails to compile is captured without it (logged)")
    decode_ahead: str = setting("auto", "plain decoding queues the next step's forward on the device before the "
                                "host reads this step's tokens, so the host's work between steps (output, "
                                "scheduling) overlaps the device's; waiting requests join a step later.  "
                                "'auto': on CUDA", choices=("auto", "on", "off"))
    defer_host_work: str = setting("auto", "a step's accounting and the server's metrics run in the next step once its "
                                   "device work is queued, before its read, so the host does them while the device "
                                   "computes; otherwise at the end of the next step (on the CPU, where the host is "
                                   "the device, that keeps them out of the times the cost model learns).  'auto': "
                                   "on CUDA", choices=("auto", "on", "off"), server=False)
    warm_up: str = setting("auto", "before it serves, the engine runs a few requests of its own (one greedy, one "
                           "sampled, then a batch of both, with the configured speculation), so the first "
                           "requests do not pay what a process sets up at its first use of each kernel and size "
                           "(CUDA modules, memory pools, compiled code); nothing is learned from them.  'auto': "
                           "on CUDA", choices=("auto", "on", "off"))
    static_shapes: bool = setting(False, "run every forward that fits a bucket through the padded fixed-shape path "
                                  "a CUDA graph replays, on any device (tests; off the GPU it is slower)",
                                  server=False)
    # adaptive speculation (engine.speculative.adaptive)
    adaptive: bool = setting(False, "adapt tree depth per step (SpecDec++ threshold) and the budget to load")
    adaptive_threshold: float = setting(0.5, "stop drafting when 1 - prod(p_accept) > h", ge=0.0, le=1.0)
    adaptive_min_depth: int = setting(1, "adaptive: always draft at least this deep", ge=1)
    adaptive_max_depth: Optional[int] = setting(None, "adaptive: never deeper than this (default: the tree's)", ge=1)
    adaptive_level_stop: bool = setting(True, "adaptive: also stop a tree level by level inside the step (the "
                                        "SpecDec++ rule reads each draft level on the host); off: the depth the "
                                        "budget plans from the calibrated acceptance stands, and a tree is read "
                                        "once (the GPU preset)")
    acceptance_heads: tuple[str, ...] = setting((), "trained acceptance head files, comma separated (one per "
                                                "temperature); none = online calibration")
    load_aware: bool = setting(True, "measure the cost curve at start-up and choose the budget per step")
    cost_model_cache: bool = setting(True, "load_aware: reuse the cost curves an earlier start measured on this "
                                     "machine for the same models, kernels and settings ($MCSD_CACHE/cost-model); "
                                     "off: measure at every start (and store the new curves)")
    # structured outputs (engine.grammar)
    grammar_whitespace: str = setting("compact", "JSON under a schema: 'compact' writes Python's separators "
                                      "(', ' and ': ', no other blanks), so keys and separators are forced and "
                                      "drafted for free; 'flexible' allows up to 8 blanks in a row anywhere "
                                      "(pretty-printed output)", choices=("compact", "flexible"))
    # speculation methods (engine.speculative.methods); each drafter's own knobs are its settings section
    spec_method: str = setting("mcsd", "drafter for requests that do not say", choices=method_names)
    drafters: Mapping[str, "DrafterSettings"] = field(
        default_factory=dict, metadata={"server": False, "help": "each drafter's settings by section name (missing "
                                        "ones: the defaults); a dict of field values is accepted for a section"})
    # the draft model (every drafter that runs it)
    draft_vocab: int = setting(0, "draft output layer cut to this many most frequent tokens (lossless; 0 = whole "
                               "vocabulary)", ge=0)
    draft_vocab_file: Optional[str] = setting(None, "token ranking the cut reads (python -m tools.rank_vocab)",
                                              path=True)
    draft_int8: bool = setting(False, "draft model's linears in Q8_0 blocks, int8 per 32 weights (lossless: only "
                               "the draft changes; CPU only)")

    def __post_init__(self) -> None:
        self.tree = parse_widths(self.tree)
        self.graph_batches, self.graph_rows = parse_widths(self.graph_batches), parse_widths(self.graph_rows)
        check_bounds(self)
        self._validate_adaptive()
        self._validate_drafters()

    def _validate_drafters(self) -> None:
        self.drafters = _sections(self.drafters)  # (spec_method's choices are checked with the bounds)
        if self.draft_vocab and (self.draft_vocab_file is None or not Path(self.draft_vocab_file).is_file()):
            raise ValueError(f"draft_vocab {self.draft_vocab} needs a token ranking file (draft_vocab_file), "
                             f"got {self.draft_vocab_file!r}")

    def _validate_adaptive(self) -> None:
        if isinstance(self.acceptance_heads, (str, Path)):
            self.acceptance_heads = (str(self.acceptance_heads),)
        self.acceptance_heads = tuple(str(p) for p in self.acceptance_heads)
        if not self.adaptive:
            return
        if not self.tree:
            raise ValueError("adaptive speculation needs a draft tree (tree is empty)")
        if self.adaptive_max_depth is None:
            self.adaptive_max_depth = len(self.tree)
        if not 1 <= self.adaptive_min_depth <= self.adaptive_max_depth:
            raise ValueError(f"adaptive_min_depth must be in [1, adaptive_max_depth={self.adaptive_max_depth}], "
                             f"got {self.adaptive_min_depth}")
        if self.adaptive_max_depth > len(self.tree):
            raise ValueError(f"adaptive_max_depth {self.adaptive_max_depth} is deeper than the tree "
                             f"{list(self.tree)} ({len(self.tree)} levels)")
        for p in self.acceptance_heads:
            if not Path(p).is_file():
                raise ValueError(f"acceptance head file {p} does not exist")

    @property
    def max_depth(self) -> int:
        return len(self.tree)

    @classmethod
    def from_settings(cls, **values: Any) -> "EngineConfig":
        """The config from flat setting names, as the server's flags and presets spell them: this
        class's fields, and ``<section>_<field>`` for a drafter's (``maxgram_len=4``, ``mjsd_tau=0.3``)."""
        own = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {k: v for k, v in values.items() if k in own}
        by_section: dict[str, dict[str, Any]] = {}
        for name in values.keys() - own:
            section, key = _split(name)
            by_section.setdefault(section, {})[key] = values[name]
        given = dict(kwargs.pop("drafters", {}))
        for section, fields in by_section.items():
            base = given.get(section, {})
            base = dataclasses.asdict(base) if dataclasses.is_dataclass(base) else dict(base)
            given[section] = {**base, **fields}
        return cls(**kwargs, drafters=given)


class DrafterSettings:
    """A drafter's own settings: a dataclass declared in the drafter's module (fields made with
    :func:`setting`) and registered with ``engine.registry.drafter_settings`` under a section name.
    Field ``f`` of section ``s`` is the setting ``s_f`` everywhere settings are named: the server's
    ``--s-f`` flag, ``MCSD_S_F``, a preset's ``s_f`` key (or ``f`` in an ``[s]`` table) and
    :meth:`EngineConfig.from_settings`.  Bounds are checked from the declarations; :meth:`validate`
    checks what spans fields."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        check_bounds(self, self.section + "_")
        self.validate()

    def validate(self) -> None:
        """Raises ValueError, naming the setting, for values that are wrong together."""

    @classmethod
    def of(cls, config: EngineConfig):
        """This drafter's settings in ``config``."""
        return config.drafters[cls.section]


def setting_fields() -> list[tuple[str, Any, dataclasses.Field]]:
    """``(name, type, field)`` of every server-visible setting, flat: this module's ``EngineConfig``
    fields, then each drafter's as ``<section>_<field>``."""
    out = [(f.name, typing.get_type_hints(EngineConfig)[f.name], f) for f in dataclasses.fields(EngineConfig)
           if f.metadata.get("server", True)]
    for section, cls in sections().items():
        hints = typing.get_type_hints(cls)
        out += [(f"{section}_{f.name}", hints[f.name], f) for f in dataclasses.fields(cls)]
    return out


def _split(name: str) -> tuple[str, str]:
    """``maxgram_len`` -> (``maxgram``, ``len``): the longest section that prefixes it with a field."""
    known = sections()
    for section in sorted(known, key=len, reverse=True):
        cls = known[section]
        key = name[len(section) + 1:]
        if name.startswith(section + "_") and key in {f.name for f in dataclasses.fields(cls)}:
            return section, key
    raise TypeError(f"unknown engine setting {name!r}")


def _sections(given: Mapping[str, Any]) -> dict[str, Any]:
    """Every registered section's settings: ``given``'s (an instance, or a dict of its fields), else
    the defaults."""
    known = sections()
    unknown = set(given) - set(known)
    if unknown:
        raise ValueError(f"unknown drafter settings section(s) {sorted(unknown)}; known: {sorted(known)}")
    out = {}
    for section, cls in known.items():
        value = given.get(section)
        if value is None:
            value = cls()
        elif isinstance(value, Mapping):
            value = cls(**value)
        elif not isinstance(value, cls):
            raise TypeError(f"drafters[{section!r}] must be a {cls.__name__} or a dict, got {type(value).__name__}")
        out[section] = value
    return out


def check_bounds(obj: Any, prefix: str = "") -> None:
    """Checks each field of the dataclass ``obj`` against its declared bounds (``ge``, ``gt``, ``le``,
    ``lt``, ``choices``: :func:`setting`); None passes."""
    for f in dataclasses.fields(obj):
        value, meta = getattr(obj, f.name), f.metadata
        if value is None or isinstance(value, bool):
            continue
        name = prefix + f.name
        for key, ok, word in (("ge", operator.ge, ">="), ("gt", operator.gt, ">"), ("le", operator.le, "<="),
                              ("lt", operator.lt, "<")):
            if key in meta and not ok(value, meta[key]):
                raise ValueError(f"{name} must be {word} {meta[key]}, got {value}")
        choices = meta.get("choices")
        if choices is not None:
            allowed = tuple(choices() if callable(choices) else choices)
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")
