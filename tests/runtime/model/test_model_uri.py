"""Offline model URI resolution: hf:// against a fake hub cache, pvc://, file://, paths."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve_contract import ENV_MODEL_CACHE
from splitserve_runtime.model import ModelLoadError
from splitserve_runtime.model.uri import resolve_model_uri

COMMIT_A = "a" * 40
COMMIT_B = "b" * 40


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


@pytest.fixture
def hub(tmp_path: Path) -> Path:
    """HF hub cache layout: two snapshots, refs/main -> A, refs/dev -> B."""
    repo = tmp_path / "hub" / "models--org--name"
    _model_dir(repo / "snapshots" / COMMIT_A)
    _model_dir(repo / "snapshots" / COMMIT_B)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT_A)
    (repo / "refs" / "dev").write_text(COMMIT_B + "\n")
    return tmp_path / "hub"


def test_hf_uri_in_hub_cache_layout(hub: Path) -> None:
    snapshots = hub / "models--org--name" / "snapshots"
    assert resolve_model_uri("hf://org/name", cache_dir=hub) == snapshots / COMMIT_A
    assert resolve_model_uri("hf://org/name@dev", cache_dir=hub) == snapshots / COMMIT_B
    assert resolve_model_uri(f"hf://org/name@{COMMIT_B}", cache_dir=hub) == snapshots / COMMIT_B
    assert resolve_model_uri("hf://org/name", cache_dir=hub, revision="dev") == snapshots / COMMIT_B
    with pytest.raises(ModelLoadError, match="revision 'v2' not found"):
        resolve_model_uri("hf://org/name@v2", cache_dir=hub)
    with pytest.raises(ModelLoadError, match="conflicts"):
        resolve_model_uri("hf://org/name@dev", cache_dir=hub, revision="main")


def test_hf_uri_from_env_and_plain_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _model_dir(tmp_path / "cache" / "org" / "other")
    monkeypatch.setenv(ENV_MODEL_CACHE, str(tmp_path / "cache"))
    assert resolve_model_uri("hf://org/other", cache_dir=None) == plain


def test_hf_uri_single_snapshot_without_refs(tmp_path: Path) -> None:
    snapshot = _model_dir(tmp_path / "models--org--solo" / "snapshots" / COMMIT_A)
    assert resolve_model_uri("hf://org/solo", cache_dir=tmp_path) == snapshot


def test_hf_uri_absent_says_where_it_looked(tmp_path: Path) -> None:
    with pytest.raises(
        ModelLoadError,
        match=r"not in the local cache .*models--org--missing.*HF_HUB_OFFLINE is set, so nothing is downloaded",
    ):
        resolve_model_uri("hf://org/missing", cache_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="expected hf://org/name"):
        resolve_model_uri("hf://just-a-name", cache_dir=tmp_path)


def test_pvc_file_and_plain_paths(tmp_path: Path) -> None:
    target = _model_dir(tmp_path / "mnt" / "claim-1" / "llama" / "8b")
    assert resolve_model_uri("pvc://claim-1/llama/8b", cache_dir=None, pvc_mount_root=tmp_path / "mnt") == target
    assert resolve_model_uri(f"file://{target}", cache_dir=None) == target
    assert resolve_model_uri(str(target), cache_dir=None) == target
    with pytest.raises(ModelLoadError, match="without '..'"):
        resolve_model_uri("pvc://claim-1/../etc", cache_dir=None, pvc_mount_root=tmp_path / "mnt")
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_uri("pvc://claim-2/x", cache_dir=None, pvc_mount_root=tmp_path / "mnt")


def test_bad_uris(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_uri(str(tmp_path / "empty"), cache_dir=None)
    with pytest.raises(ModelLoadError, match="unsupported scheme"):
        resolve_model_uri("s3://bucket/model", cache_dir=None)
    with pytest.raises(ModelLoadError, match="absolute path"):
        resolve_model_uri("file://relative/path", cache_dir=None)
    with pytest.raises(ModelLoadError, match="only applies to hf://"):
        resolve_model_uri(str(tmp_path), cache_dir=None, revision="main")
    with pytest.raises(ModelLoadError, match="no model given"):
        resolve_model_uri("", cache_dir=None)
