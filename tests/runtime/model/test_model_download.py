"""hf:// models reach the runtime as in production: downloaded by the real ``huggingface_hub``
client from a hub (:class:`splitserve_e2e.hub.LocalHub` on loopback, through ``HF_ENDPOINT``)
into the model cache, then loaded by the engine.

Covers: only the files the runtime reads are fetched; revisions (branch, tag, commit) are
honoured; a refused token, a missing repository or revision and an unreachable endpoint are
``ModelLoadError`` messages that say so; ``HF_HUB_OFFLINE=1`` never touches the hub; two
processes downloading into one cache at once both end with intact files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve_contract import (
    ENV_HUB_ENDPOINT,
    ENV_HUB_OFFLINE,
    ENV_HUB_TOKEN,
    ENV_HUB_TOKEN_SOURCE,
    ENV_MODEL_CACHE,
    ServeArgs,
)
from splitserve_e2e.hub import LocalHub
from splitserve_runtime.model import ModelLoadError
from splitserve_runtime.model.download import wanted
from splitserve_runtime.model.uri import resolve_model_uri

TOKEN = "hf_test_token_0123456789"
REPO = "org/tiny"
NOT_FOR_THE_RUNTIME = {
    "pytorch_model.bin": b"\0" * 4096,
    "model.gguf": b"GGUF" + b"\0" * 4096,
    "model.onnx": b"\0" * 1024,
    "original/consolidated.safetensors": b"\0" * 1024,
    "README.md": b"# tiny\n",
}
RUNTIME_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
}


@dataclasses.dataclass(frozen=True)
class Published:
    hub: LocalHub
    v1: str
    """Commit tagged ``v1`` (also on branch ``dev``)."""
    main: str
    """The later commit on ``main``: a different generation_config.json."""
    source: Path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def published(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[Published]:
    with LocalHub(tmp_path / "hub", token=TOKEN) as hub:
        v1 = hub.publish(REPO, tiny_llama_dir, tags=("v1",), extra_files=NOT_FOR_THE_RUNTIME)
        hub.publish(REPO, tiny_llama_dir, branch="dev", extra_files=NOT_FOR_THE_RUNTIME)
        generation = json.loads((tiny_llama_dir / "generation_config.json").read_text())
        main = hub.publish(
            REPO,
            tiny_llama_dir,
            extra_files={
                **NOT_FOR_THE_RUNTIME,
                "generation_config.json": json.dumps({**generation, "temperature": 0.25}).encode(),
            },
        )
        yield Published(hub=hub, v1=v1, main=main, source=tiny_llama_dir)


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch, published: Published, tmp_path: Path) -> Path:
    """The hub's endpoint and token in the env, offline mode off; returns the model cache."""
    import huggingface_hub.constants

    monkeypatch.delenv(ENV_HUB_OFFLINE, raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # read at its import
    monkeypatch.setenv(ENV_HUB_ENDPOINT, published.hub.endpoint)
    monkeypatch.setenv(ENV_HUB_TOKEN, TOKEN)
    monkeypatch.setenv(ENV_HUB_TOKEN_SOURCE, "Secret hf-token, key HF_TOKEN")
    cache = tmp_path / "cache"
    monkeypatch.setenv(ENV_MODEL_CACHE, str(cache))
    return cache


def test_only_root_config_tokenizer_and_safetensors_files_are_wanted() -> None:
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "special_tokens_map.json",
        "tokenizer.model",
    ):
        assert wanted(name), name
    for name in (
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "model.gguf",
        "model.onnx",
        "consolidated.pth",
        "original/model.safetensors",
        "README.md",
        ".gitattributes",
    ):
        assert not wanted(name), name


def test_engine_downloads_the_model_then_serves_it(
    online: Path,
    published: Published,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from splitserve_runtime.engine.llm_engine import LLMEngine
    from splitserve_runtime.engine.sampling_params import SamplingParams

    caplog.set_level(logging.INFO, logger="splitserve_runtime.model.download")
    started = time.monotonic()
    engine = LLMEngine.from_args(
        ServeArgs(
            model=f"hf://{REPO}",
            device="cpu",
            block_size=4,
            num_kv_blocks=64,
            max_model_len=64,
            max_num_batched_tokens=64,
            prefix_caching=False,
            chunked_prefill=False,
        )
    )
    seconds = time.monotonic() - started

    snapshot = online / "models--org--tiny" / "snapshots" / published.main
    assert {p.name for p in snapshot.iterdir()} == RUNTIME_FILES
    assert (online / "models--org--tiny" / "refs" / "main").read_text() == published.main
    assert _sha256(snapshot / "model.safetensors") == _sha256(published.source / "model.safetensors")
    fetched = published.hub.downloaded(REPO)
    assert sorted(fetched) == sorted(RUNTIME_FILES)  # each once, nothing the runtime does not read
    assert fetched[-1] == "config.json"  # last: a snapshot with config.json is complete
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("fetched ") for line in lines) == len(RUNTIME_FILES), lines
    total = sum(p.stat().st_size for p in snapshot.iterdir())
    assert any(line.startswith("downloaded org/tiny@main") and f"{total} bytes in " in line for line in lines), lines
    assert any(
        "not fetched: README.md, model.gguf, model.onnx, original/consolidated.safetensors, pytorch_model.bin" in line
        for line in lines
    ), lines
    print(f"\ndownload + load of hf://{REPO}: {total} bytes, {seconds:.2f} s")

    engine.add_request(
        request_id="r", prompt_token_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    )
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert len(tokens) == 4

    # A second start finds the cache filled and does not ask the hub again.
    before = len(published.hub.requests)
    assert resolve_model_uri(f"hf://{REPO}", cache_dir=None, offline=False) == snapshot
    assert len(published.hub.requests) == before


def test_revision_branch_tag_and_commit_are_honoured(online: Path, published: Published) -> None:
    repo = online / "models--org--tiny"
    v1 = resolve_model_uri(f"hf://{REPO}@v1", cache_dir=None)
    assert v1 == repo / "snapshots" / published.v1
    assert (repo / "refs" / "v1").read_text() == published.v1
    assert "temperature" not in json.loads((v1 / "generation_config.json").read_text())
    main = resolve_model_uri(f"hf://{REPO}", cache_dir=None, revision="main")
    assert main == repo / "snapshots" / published.main
    assert json.loads((main / "generation_config.json").read_text())["temperature"] == 0.25
    # The same bytes are stored once: v1 and main share every blob but generation_config.json.
    assert len(list((repo / "blobs").iterdir())) == len(RUNTIME_FILES) + 1
    dev = resolve_model_uri(f"hf://{REPO}", cache_dir=online / "other", revision="dev")
    assert dev.name != published.main
    by_commit = resolve_model_uri(f"hf://{REPO}@{published.v1}", cache_dir=online / "pinned")
    assert by_commit.name == published.v1
    assert not (online / "pinned" / "models--org--tiny" / "refs").exists()  # a commit needs no ref


def test_a_refused_token_names_401_and_the_secret(
    online: Path,
    published: Published,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_HUB_TOKEN, "hf_wrong")
    with pytest.raises(ModelLoadError) as refused:
        resolve_model_uri(f"hf://{REPO}", cache_dir=None)
    message = str(refused.value)
    assert "HTTP 401" in message and published.hub.endpoint in message, message
    assert "the hub refused the token in HF_TOKEN from Secret hf-token, key HF_TOKEN" in message, message
    assert f"model 'hf://{REPO}' is not in the local cache {online}" in message
    monkeypatch.delenv(ENV_HUB_TOKEN)
    with pytest.raises(ModelLoadError, match=r"HTTP 401: .*no token was sent .*hubTokenSecretRef"):
        resolve_model_uri(f"hf://{REPO}", cache_dir=None)
    assert published.hub.downloaded(REPO) == []
    assert not (online / "models--org--tiny" / "snapshots").exists()


def test_missing_repository_revision_and_unreachable_endpoint(
    online: Path,
    published: Published,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ModelLoadError, match=r"HTTP 404: no repository org/absent on the hub"):
        resolve_model_uri("hf://org/absent", cache_dir=None)
    with pytest.raises(ModelLoadError, match=r"HTTP 404: repository org/tiny has no revision 'v9'"):
        resolve_model_uri(f"hf://{REPO}@v9", cache_dir=None)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv(ENV_HUB_ENDPOINT, closed)
    started = time.monotonic()
    with pytest.raises(ModelLoadError, match=rf"the hub endpoint {closed} is unreachable \(ConnectError"):
        resolve_model_uri(f"hf://{REPO}", cache_dir=None)
    assert time.monotonic() - started < 10  # no long retry loop before the pod reports it
    monkeypatch.setenv(ENV_HUB_ENDPOINT, "ftp://mirror")
    with pytest.raises(ModelLoadError, match="HF_ENDPOINT='ftp://mirror' is not an http"):
        resolve_model_uri(f"hf://{REPO}", cache_dir=None)


def test_offline_mode_only_reads_the_cache(online: Path, published: Published, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_HUB_OFFLINE, "1")
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set, so nothing is downloaded"):
        resolve_model_uri(f"hf://{REPO}", cache_dir=None)
    assert published.hub.requests == []
    snapshot = resolve_model_uri(f"hf://{REPO}", cache_dir=None, offline=False)
    assert resolve_model_uri(f"hf://{REPO}", cache_dir=None) == snapshot  # offline, from the cache


_DOWNLOADER = textwrap.dedent("""
    import hashlib, json, sys, time
    from pathlib import Path
    from safetensors import safe_open
    from splitserve_runtime.model.uri import resolve_model_uri

    go = Path(sys.argv[1])
    Path(sys.argv[2]).touch()  # imported, ready to start
    while not go.exists():
        time.sleep(0.01)
    snapshot = resolve_model_uri("hf://org/tiny", cache_dir=None)
    with safe_open(str(snapshot / "model.safetensors"), framework="pt") as weights:
        tensors = len(list(weights.keys()))
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in snapshot.iterdir()}
    print(json.dumps({"snapshot": str(snapshot), "tensors": tensors, "digests": digests}))
""")


def test_two_processes_download_into_one_cache_at_once(
    tiny_llama_dir: Path,
    tmp_path: Path,
) -> None:
    with LocalHub(tmp_path / "hub", token=TOKEN, chunk_delay_seconds=0.05) as hub:
        commit = hub.publish(REPO, tiny_llama_dir, extra_files=NOT_FOR_THE_RUNTIME)
        env = {k: v for k, v in os.environ.items() if k not in (ENV_HUB_OFFLINE, "TRANSFORMERS_OFFLINE")}
        env.update(
            {ENV_HUB_ENDPOINT: hub.endpoint, ENV_HUB_TOKEN: TOKEN, ENV_MODEL_CACHE: str(tmp_path / "shared-cache")}
        )
        go = tmp_path / "go"
        ready = [tmp_path / f"ready-{i}" for i in range(2)]
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", _DOWNLOADER, str(go), str(flag)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for flag in ready
        ]
        deadline = time.monotonic() + 60
        while not all(flag.exists() for flag in ready) and time.monotonic() < deadline:
            assert all(proc.poll() is None for proc in procs), "a downloader exited before the start"
            time.sleep(0.05)
        go.touch()  # both start at once
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
        requests = hub.requests

    expected = {p.name: _sha256(p) for p in tiny_llama_dir.iterdir() if p.name in RUNTIME_FILES}
    for result in results:
        assert result["snapshot"].endswith(f"models--org--tiny/snapshots/{commit}")
        assert result["digests"] == expected
        assert result["tensors"] > 0
    infos = [r for r in requests if r.path.startswith("/api/models/org/tiny")]
    weights = [r for r in requests if r.method == "GET" and r.path.endswith("/model.safetensors")]
    assert len(infos) == 2, requests  # both processes went to the hub ...
    assert all(info.started < weights[0].finished for info in infos)  # ... while the weights were in flight
    assert len(weights) == 1, weights  # the second waited on the blob's lock and reused it


def test_the_router_fetches_the_tokenizer_only_and_never_a_half_snapshot(online: Path, published: Published) -> None:
    """The router reads only the tokenizer: its download skips the weights, in a root of its
    own, so a pod sharing the cache never takes that snapshot for a complete model."""
    from splitserve_runtime.model.tokenizer import Tokenizer
    from splitserve_runtime.model.uri import TOKENIZER_ONLY_DIR

    router_dir = resolve_model_uri(f"hf://{REPO}", cache_dir=None, weights=False)
    assert router_dir.is_relative_to(online / TOKENIZER_ONLY_DIR)
    assert {p.name for p in router_dir.iterdir()} == RUNTIME_FILES - {"model.safetensors"}
    assert Tokenizer.from_dir(model_dir=router_dir).encode("hello", add_special_tokens=False)
    full = resolve_model_uri(f"hf://{REPO}", cache_dir=None)  # a pod: downloads the weights
    assert not full.is_relative_to(online / TOKENIZER_ONLY_DIR)
    assert (full / "model.safetensors").is_file()
    fetched_before = len(published.hub.requests)
    assert resolve_model_uri(f"hf://{REPO}", cache_dir=None, weights=False) == full
    assert len(published.hub.requests) == fetched_before  # a full snapshot serves the router


def test_one_gguf_file_of_a_repository_is_downloaded_and_translated(online: Path, published: Published) -> None:
    """``hf://org/name/<file>.gguf``: exactly that file is fetched (not the repository's
    safetensors), at a commit, into the hub cache layout; its config and tokenizer are
    translated into a sidecar; the next resolve asks the hub nothing; a missing file is a
    ModelLoadError that lists the repository's GGUF files."""
    from splitserve_e2e import smollm2
    from splitserve_runtime.model.gguf import gguf_source

    data = smollm2.gguf_path().read_bytes()
    commit = published.hub.publish(
        "org/smol-gguf", published.source, extra_files={"gguf/smol.Q4_1.gguf": data, "README.md": b"# smol\n"}
    )
    uri = "hf://org/smol-gguf/gguf/smol.Q4_1.gguf"
    model_dir = resolve_model_uri(uri, cache_dir=None)
    fetched = online / "models--org--smol-gguf" / "snapshots" / commit / "gguf" / "smol.Q4_1.gguf"
    assert published.hub.downloaded("org/smol-gguf") == ["gguf/smol.Q4_1.gguf"]
    assert fetched.stat().st_size == len(data)
    assert gguf_source(model_dir) == fetched.resolve()
    assert json.loads((model_dir / "config.json").read_text())["num_hidden_layers"] == 30
    before = len(published.hub.requests)
    assert resolve_model_uri(uri, cache_dir=None) == model_dir
    assert len(published.hub.requests) == before
    with pytest.raises(ModelLoadError, match=r"has no file 'smol\.Q8_0\.gguf' \(GGUF files: gguf/smol\.Q4_1\.gguf\)"):
        resolve_model_uri("hf://org/smol-gguf/smol.Q8_0.gguf", cache_dir=None)
