"""The registries of speculation: methods, drafters, verification rules and drafters' settings.

A leaf module: it imports nothing of the engine, so the bottom contracts (``engine.config``,
``engine.request``) validate against it and every layer above reads it.  The built-in drafters
register themselves when their modules are imported; :func:`load_builtin` imports every module of
``engine.speculative`` by name, so a new drafter is one new file there (``CONTRIBUTING.md``).
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Optional

LOSSLESS_RULE = "lossless"  # the exact multi-candidate rule (engine.speculative.verify.LosslessRule)
BUILTIN_PACKAGE = "engine.speculative"


@dataclass(frozen=True)
class Method:
    """A speculation method a request can name (``speculative.method``): its drafters (in the order
    they grow the tree), its plan (``PlanInput -> DraftPlan``, ``engine.speculative.methods``: how much
    each may draft this step), and what the engine and the server must know about it."""

    name: str
    drafters: tuple[str, ...]
    plan: Callable[[Any], Any]
    needs_draft: bool = True  # runs the draft model (without one, the server turns speculation off)
    rule: str = LOSSLESS_RULE  # the verification rule (register_rule)
    lossy_note: Optional[str] = None  # a lossy method's note on every response (None: lossless)
    penalties: bool = True  # supports presence / frequency / repetition penalties
    grammar: bool = True  # verifies under a grammar (structured outputs: the masked target's law)
    order: int = 100  # where it is listed among the methods (the settings' choices, errors, docs)


_METHODS: dict[str, Method] = {}
_DRAFTERS: dict[str, type] = {}
_RULES: dict[str, Callable[[Any, int], Any]] = {}
_SECTIONS: dict[str, type] = {}
_loaded = False


def load_builtin() -> None:
    """Imports every module of ``engine.speculative`` (once): importing a drafter's module registers
    it, its method, its rule and its settings."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    package = importlib.import_module(BUILTIN_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{BUILTIN_PACKAGE}.{info.name}")


# ---------------------------------------------------------------------------------------- methods
def register_method(method: Method) -> Method:
    """Makes ``method`` one a request can name (``speculative.method``)."""
    if method.name in _METHODS:
        raise ValueError(f"speculation method {method.name!r} is registered twice")
    _METHODS[method.name] = method
    return method


def method(name: str) -> Method:
    """The registered method ``name`` (ValueError with the choices if unknown)."""
    if name not in _METHODS:
        load_builtin()  # a drafter module not imported yet may register it
    if name not in _METHODS:
        raise ValueError(f"unknown speculation method {name!r}; choose one of {', '.join(method_names())}")
    return _METHODS[name]


def methods() -> list[Method]:
    """Every registered method, in listing order."""
    load_builtin()
    return sorted(_METHODS.values(), key=lambda m: m.order)


def method_names() -> tuple[str, ...]:
    """Names of every registered method (the settings' and the API's choices)."""
    return tuple(m.name for m in methods())


def check_method(name: str) -> str:
    method(name)
    return name


# --------------------------------------------------------------------------------------- drafters
def register_drafter(cls: type) -> type:
    """Class decorator: registers a drafter (``engine.speculative.drafter.Drafter``) under its ``name``."""
    if cls.name in _DRAFTERS:
        raise ValueError(f"drafter {cls.name!r} is registered twice")
    _DRAFTERS[cls.name] = cls
    return cls


def drafter_classes() -> dict[str, type]:
    """Every registered drafter class by name."""
    load_builtin()
    return dict(_DRAFTERS)


# ------------------------------------------------------------------------------ verification rules
def register_rule(name: str, factory: Callable[[Any, int], Any]) -> None:
    """Makes the rule ``name`` available to methods; ``factory(config, vocab_size)`` builds it (an
    ``engine.speculative.verify.VerifyRule``)."""
    if name in _RULES or name == LOSSLESS_RULE:
        raise ValueError(f"verification rule {name!r} is registered twice")
    _RULES[name] = factory


def rule_factories() -> dict[str, Callable[[Any, int], Any]]:
    """Every registered (lossy) rule's factory by name."""
    load_builtin()
    return dict(_RULES)


# ------------------------------------------------------------------------------ drafters' settings
def drafter_settings(section: str):
    """Class decorator: registers a drafter's settings dataclass (``engine.config.DrafterSettings``)
    under ``section`` (an identifier: it prefixes the settings' names)."""
    if not section.isidentifier():
        raise ValueError(f"settings section {section!r} must be an identifier")

    def register(cls: type) -> type:
        if section in _SECTIONS and _SECTIONS[section] is not cls:
            raise ValueError(f"settings section {section!r} is registered twice")
        cls.section = section
        _SECTIONS[section] = cls
        return cls
    return register


def unregister(*, method: str = "", drafter: str = "", rule: str = "", section: str = "") -> None:
    """Removes what a test registered for its own drafter (names not registered are ignored)."""
    _METHODS.pop(method, None)
    _DRAFTERS.pop(drafter, None)
    _RULES.pop(rule, None)
    _SECTIONS.pop(section, None)


def sections() -> dict[str, type]:
    """Every registered drafter's settings class by section."""
    load_builtin()
    return dict(_SECTIONS)
