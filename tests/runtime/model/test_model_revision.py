"""A model revision is a branch, tag or commit hash, never a path: the defect this pins was
``--revision ../../../../../../proc/self/environ`` making the runtime read the pod's
environment (hub token, API key) through ``refs/<revision>`` in the hub cache and quote it in
the load error, i.e. in the pod's termination message and the InferenceService's conditions.

The rule is the contract's (:mod:`splitserve_contract.model_revision`, which the operator's
CRD pattern uses too); here it is checked against git's own ``check-ref-format`` and then
through the runtime's real resolver, with a secret planted where the traversal leads.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from splitserve_contract.model_revision import (
    MAX_REVISION_LENGTH,
    REVISION_PATTERN,
    is_valid_revision,
    revision_problem,
)
from splitserve_runtime.model import ModelLoadError
from splitserve_runtime.model.uri import resolve_model_uri

COMMIT = "0123456789abcdef0123456789abcdef01234567"
SECRET = "hf_SECRET_TOKEN_must_never_leak_0123456789"

ACCEPTED = [
    "main",
    "v1.0",
    "v1.0.0-rc1",
    "release/2024-06",
    "refs/pr/1",
    "refs/convert/parquet",
    COMMIT,
    "abc1234",
    "feature_x+y",
    "_private",
    "a" * MAX_REVISION_LENGTH,
]
REFUSED = {
    "../../../../../../proc/self/environ": "'..' path segment",
    "refs/../../../etc/passwd": "'..' path segment",
    "..": "'..' path segment",
    "/etc/passwd": "starts with '/'",
    "main\\..\\x": "backslash",
    "main\nx": "control character",
    "main\x00": "control character",
    "main\x7f": "control character",
    "a" * (MAX_REVISION_LENGTH + 1): "longer than 255",
    "./main": "'.' path segment",
    "main/": "empty '/'-separated part",
    "a//b": "empty '/'-separated part",
    "a..b": "contains '..'",
    ".hidden": "starts with '.' or '-'",
    "-n": "starts with '.' or '-'",
    "main.": "ends with '.'",
    "main@{1}": "'@'",
    "ma in": "' '",
    "HEAD~1": "'~'",
    "a:b": "':'",
    "a*b": "'*'",
    "naïve": "'ï'",
}


@pytest.mark.parametrize("revision", ACCEPTED)
def test_branches_tags_and_commits_are_accepted(revision: str) -> None:
    assert revision_problem(revision) is None
    assert is_valid_revision(revision)
    assert re.fullmatch(REVISION_PATTERN, revision)


@pytest.mark.parametrize(("revision", "rule"), list(REFUSED.items()))
def test_paths_and_odd_characters_are_refused_naming_the_rule(revision: str, rule: str) -> None:
    problem = revision_problem(revision)
    assert problem is not None and rule in problem, problem
    assert "a revision is a git branch, tag or commit hash" in problem  # the rule, in words
    # the CRD's pattern and maxLength agree
    assert len(revision) > MAX_REVISION_LENGTH or not re.fullmatch(REVISION_PATTERN, revision)


def test_empty_means_the_default_revision() -> None:
    assert revision_problem("") is None


def test_the_pattern_has_no_constructs_re2_lacks() -> None:
    """The CRD's OpenAPI ``pattern`` is evaluated by the API server's RE2: no look-around,
    no back-references."""
    assert not re.search(r"\(\?[=!<]|\\[1-9]", REVISION_PATTERN)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
@pytest.mark.parametrize("revision", ACCEPTED[:-1])
def test_every_accepted_revision_is_a_valid_git_ref_name(revision: str) -> None:
    """The rule is a subset of what git (and so the hub) accepts as a branch or tag name."""
    result = subprocess.run(["git", "check-ref-format", "--allow-onelevel", revision], capture_output=True, check=False)
    assert result.returncode == 0, revision


@pytest.fixture
def cache_with_a_secret(tmp_path: Path) -> Path:
    """A hub cache with one snapshot of org/name, and a secret file where
    ``refs/../../../secret`` leads (what /proc/self/environ was in the defect)."""
    cache = tmp_path / "cache"
    repo = cache / "models--org--name"
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (tmp_path / "secret").write_text(f"HF_TOKEN={SECRET}\n")
    return cache


def test_a_traversing_revision_is_refused_before_any_file_is_read(cache_with_a_secret: Path) -> None:
    for uri, revision in (
        ("hf://org/name", "../../../secret"),
        ("hf://org/name@../../../secret", ""),
        ("hf://org/name/model.gguf@../../../secret", ""),
    ):
        with pytest.raises(ModelLoadError) as caught:
            resolve_model_uri(uri, cache_dir=cache_with_a_secret, revision=revision, offline=True)
        message = str(caught.value)
        assert SECRET not in message
        assert "'..' path segment" in message


def test_a_ref_file_that_holds_no_commit_is_refused_without_quoting_it(cache_with_a_secret: Path) -> None:
    """A ref is read only as a commit hash: whatever else a ref file holds (a link planted to
    a secret, a corrupt cache) is refused by name, its content never shown."""
    refs = cache_with_a_secret / "models--org--name" / "refs"
    (refs / "leaky").symlink_to(cache_with_a_secret.parent / "secret")
    with pytest.raises(ModelLoadError, match=r"refs/leaky does not hold a 40-digit commit hash") as caught:
        resolve_model_uri("hf://org/name", cache_dir=cache_with_a_secret, revision="leaky", offline=True)
    assert SECRET not in str(caught.value)
    assert (
        resolve_model_uri("hf://org/name", cache_dir=cache_with_a_secret, revision="main", offline=True).name == COMMIT
    )


def test_a_gguf_path_in_a_repository_may_not_climb_out_of_it(cache_with_a_secret: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"may not contain '\.' or '\.\.' segments"):
        resolve_model_uri("hf://org/name/../../x.gguf", cache_dir=cache_with_a_secret, offline=True)


def test_a_revision_is_checked_by_the_downloader_too(tmp_path: Path) -> None:
    """:func:`download_hf_model` is public: it refuses the revision before it names a URL or
    writes ``refs/<revision>``, whoever calls it."""
    from splitserve_runtime.model.download import HubSettings, download_hf_file, download_hf_model

    hub = HubSettings(endpoint="http://127.0.0.1:9")  # never dialled
    with pytest.raises(ModelLoadError, match="'..' path segment"):
        download_hf_model(uri="hf://org/name", repo_id="org/name", revision="../../x", cache_root=tmp_path, hub=hub)
    with pytest.raises(ModelLoadError, match="starts with '/'"):
        download_hf_file(
            uri="hf://org/name/m.gguf",
            repo_id="org/name",
            filename="m.gguf",
            revision="/abs",
            cache_root=tmp_path,
            hub=hub,
        )
    assert not any(tmp_path.iterdir())
