"""The container image as a node runs it: pulled by name from the loopback registry and run with
runc as its non-root user on a read-only root file system, with tmpfs volumes for what it writes.

The session builds the image when its inputs changed (``splitserve_e2e.image``; the first build
on a fresh machine downloads several GB of CUDA wheels and takes many minutes, later ones reuse
the layers), pushes it to the loopback registry, pulls it back with skopeo and unpacks it with
umoci (cached by digest). The container shares the host's network namespace, so its server is
reached on 127.0.0.1 like a pod's.
"""

from __future__ import annotations

import copy
import json
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from splitserve_e2e import image
from splitserve_e2e.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

RUN_AS = 65532
TRITON_CACHE = "/var/cache/splitserve/triton"
MODEL_CACHE = "/var/cache/splitserve/models"
MODEL_MOUNT = "/mnt/models/tiny"  # where the operator mounts a pvc:// model
MODEL_NAME = "tiny"


@pytest.fixture(scope="session")
def reference() -> str:
    return image.ensure_image()


@pytest.fixture(scope="session")
def tag(reference: str) -> str:
    return reference.rsplit(":", 1)[1]


@pytest.fixture(scope="session")
def config(tag: str) -> dict[str, Any]:
    return image.registry_config(tag)


@pytest.fixture(scope="session")
def bundle(reference: str) -> Path:
    return image.pull_bundle(reference)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("image-model") / "tiny"
    subprocess.run(["splitserve", "make-tiny-model", str(model)], check=True, capture_output=True, timeout=300)
    for path in model.iterdir():  # safetensors writes 0600: make it readable by the pod's user
        path.chmod(0o644)
    return model


def _tmpfs(destination: str, *, mode: str, owner: int = 0) -> dict[str, Any]:
    return {
        "destination": destination,
        "type": "tmpfs",
        "source": "tmpfs",
        "options": ["nosuid", "nodev", f"mode={mode}", f"uid={owner}", f"gid={owner}", "size=1g"],
    }


class Container:
    """One runc container from the unpacked image: read-only root, no capabilities, the
    image's user, host network; /tmp and the image's VOLUMEs as tmpfs (as emptyDirs would be,
    owned by the pod's fsGroup), the model bind-mounted read-only."""

    def __init__(
        self,
        *,
        bundle: Path,
        config: dict[str, Any],
        workdir: Path,
        args: list[str] | None = None,
        model: Path | None = None,
    ) -> None:
        spec = copy.deepcopy(json.loads((bundle / "config.json").read_text()))
        spec["root"] = {"path": str(bundle / "rootfs"), "readonly": True}
        process = spec["process"]
        if args is not None:  # what a pod's `args` does: the image's ENTRYPOINT stays
            process["args"] = [*config["Entrypoint"], *args]
        process["terminal"] = False
        process["noNewPrivileges"] = True
        process["capabilities"] = {
            kind: [] for kind in ("bounding", "effective", "inheritable", "permitted", "ambient")
        }
        linux = spec["linux"]
        linux["namespaces"] = [ns for ns in linux["namespaces"] if ns["type"] != "network"]
        mounts = [_tmpfs("/tmp", mode="1777")]
        mounts += [_tmpfs(volume, mode="0775", owner=RUN_AS) for volume in config["Volumes"]]
        if model is not None:
            mounts.append(_tmpfs("/mnt", mode="0755"))
            mounts.append(
                {
                    "destination": MODEL_MOUNT,
                    "type": "bind",
                    "source": str(model),
                    "options": ["rbind", "ro", "nosuid", "nodev"],
                }
            )
        spec["mounts"] = [*spec["mounts"], *mounts]
        self.spec = spec
        self.workdir = workdir
        self.id = f"splitserve-image-test-{uuid.uuid4().hex[:10]}"
        self.log_path = workdir / "container.log"
        (workdir / "config.json").write_text(json.dumps(spec, indent=2))
        self._popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Container:
        with self.log_path.open("wb") as log:
            self._popen = subprocess.Popen(
                ["runc", "run", "--bundle", str(self.workdir), self.id],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return self

    def run(self, *, timeout: float = 300.0) -> tuple[int, str]:
        self.start()
        return self.wait(timeout=timeout), self.log()

    def wait(self, *, timeout: float) -> int:
        assert self._popen is not None
        return self._popen.wait(timeout=timeout)

    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def kill(self, signal_name: str) -> None:
        subprocess.run(["runc", "kill", self.id, signal_name], check=True, capture_output=True, timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        subprocess.run(["runc", "delete", "--force", self.id], capture_output=True, check=False, timeout=60)
        if self._popen is not None and self._popen.poll() is None:
            self._popen.kill()
            self._popen.wait(timeout=30)


@pytest.fixture()
def container_dir(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "bundle"
    directory.mkdir()
    yield directory


# --------------------------------------------------------------------------- the image


def test_image_config_has_labels_numeric_user_and_tini(config: dict[str, Any], tag: str) -> None:
    user, _, group = str(config.get("User", "")).partition(":")
    assert user.isdigit() and int(user) == RUN_AS and group == str(RUN_AS), config.get("User")
    labels = config["Labels"]
    version, _, revision = tag.partition("-")
    assert labels["org.opencontainers.image.title"] == "splitserve"
    assert labels["org.opencontainers.image.version"] == version == image.package_version()
    assert labels["org.opencontainers.image.revision"] == revision
    commit = revision.split("-")[0]  # a commit of this repository (HEAD when it was built)
    assert (
        subprocess.run(
            ["git", "-C", str(image.REPO_ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], check=False
        ).returncode
        == 0
    ), revision
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.source"].startswith("https://")
    assert labels["org.opencontainers.image.base.name"].startswith(image.BASE_REPOSITORY)
    # exec form only: tini is PID 1 and no shell sits between it and splitserve
    assert config["Entrypoint"] == ["/usr/bin/tini", "-s", "--"]
    assert config["Cmd"][0] == "splitserve"
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["TRITON_CACHE_DIR"] == TRITON_CACHE and env["HOME"] == "/tmp"
    assert set(config["Volumes"]) == {TRITON_CACHE, MODEL_CACHE}


def test_registry_lists_the_tags_and_serves_every_blob(tag: str) -> None:
    base = f"http://{image.registry_address()}/v2/{image.IMAGE_NAME}"
    tags = httpx.get(f"{base}/tags/list", timeout=10).json()["tags"]
    assert tag in tags, tags
    found = image.registry_manifest(tag)
    assert found is not None
    digest, manifest = found
    assert digest.startswith("sha256:")
    layers = manifest["layers"]
    assert isinstance(layers, list) and len(layers) >= 5  # base, system, torch, rest, wheel...
    for descriptor in [manifest["config"], *layers]:
        assert isinstance(descriptor, dict)
        head = httpx.head(f"{base}/blobs/{descriptor['digest']}", timeout=10)
        assert head.status_code == 200, descriptor
        assert int(head.headers["content-length"]) == descriptor["size"]


# --------------------------------------------------------------------------- running it

_PROBE = r"""
import json, os, subprocess, sysconfig
def writable(path):
    try:
        with open(os.path.join(path, ".probe"), "w") as handle:
            handle.write("x")
        os.unlink(os.path.join(path, ".probe"))
        return True
    except OSError:
        return False
# what Triton does on first use: compile a C launcher against Python's headers, then load it
with open("/tmp/probe.c", "w") as handle:
    handle.write('#include <Python.h>\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "probe"};\n'
                 'PyMODINIT_FUNC PyInit_probe(void) { return PyModule_Create(&m); }\n')
subprocess.run(["gcc", "-shared", "-fPIC", "-I", sysconfig.get_paths()["include"],
                "-o", "/tmp/probe.so", "/tmp/probe.c"], check=True)
import importlib.util
spec = importlib.util.spec_from_file_location("probe", "/tmp/probe.so")
importlib.util.module_from_spec(spec)
import torch, triton, kopf, splitserve_runtime, splitserve_operator
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "home": os.environ["HOME"],
                  "triton_cache": os.environ["TRITON_CACHE_DIR"],
                  "torch": torch.__version__, "triton": triton.__version__,
                  "writable": {p: writable(p) for p in ("/", "/opt/splitserve", "/etc", "/tmp",
                                                        os.environ["TRITON_CACHE_DIR"],
                                                        os.environ["SPLITSERVE_MODEL_CACHE"])}}))
"""


def test_default_command_is_help(bundle: Path, config: dict[str, Any], container_dir: Path) -> None:
    container = Container(bundle=bundle, config=config, workdir=container_dir)
    try:
        code, output = container.run()
    finally:
        container.close()
    assert container.spec["process"]["user"]["uid"] == RUN_AS
    assert code == 0, output
    for command in ("serve", "router", "operator", "make-tiny-model", "plan"):
        assert command in output, output


def test_runs_as_non_root_on_a_read_only_root(bundle: Path, config: dict[str, Any], container_dir: Path) -> None:
    container = Container(bundle=bundle, config=config, workdir=container_dir, args=["python3", "-c", _PROBE])
    try:
        code, output = container.run()
    finally:
        container.close()
    assert code == 0, output
    probe = json.loads(output.strip().splitlines()[-1])
    assert probe["uid"] == RUN_AS and probe["gid"] == RUN_AS
    assert probe["home"] == "/tmp" and probe["triton_cache"] == TRITON_CACHE
    assert probe["torch"].startswith("2.11.0") and probe["triton"] == "3.6.0"
    assert probe["writable"] == {
        "/": False,
        "/opt/splitserve": False,
        "/etc": False,
        "/tmp": True,
        TRITON_CACHE: True,
        MODEL_CACHE: True,
    }


def _wait_for(url: str, *, container: Container, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert container.running(), f"the container exited:\n{container.log()[-4000:]}"
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} not 200 after {timeout}s:\n{container.log()[-4000:]}")


class _Stream(threading.Thread):
    """One streamed completion; collects the SSE payloads."""

    def __init__(self, *, base: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base = base
        self.max_tokens = max_tokens
        self.events: list[str] = []
        self.first = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {
            "model": MODEL_NAME,
            "prompt": "a long answer",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with (
                httpx.Client(timeout=120) as http,
                http.stream("POST", f"{self.base}/v1/completions", json=body) as response,
            ):
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
                        self.first.set()
        except BaseException as error:  # reported by the test
            self.error = error
        finally:
            self.first.set()


def test_serve_answers_and_drains_on_sigterm(
    bundle: Path, config: dict[str, Any], container_dir: Path, tiny_model: Path
) -> None:
    port, kv_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    container = Container(
        bundle=bundle,
        config=config,
        workdir=container_dir,
        model=tiny_model,
        args=[
            "splitserve",
            "serve",
            "--model",
            f"file://{MODEL_MOUNT}",
            "--served-model-name",
            MODEL_NAME,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-port",
            str(kv_port),
            "--device",
            "cpu",
            "--attention-backend",
            "torch",
            "--dtype",
            "float32",
            "--max-model-len",
            "512",
            "--num-kv-blocks",
            "32",
            "--block-size",
            "16",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--drain-timeout-seconds",
            "60",
        ],
    )
    try:
        container.start()
        _wait_for(f"{base}/health", container=container, timeout=300)
        _wait_for(f"{base}/ready", container=container, timeout=300)
        answer = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 8, "ignore_eos": True},
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["usage"]["completion_tokens"] == 8 and isinstance(body["choices"][0]["text"], str)

        stream = _Stream(base=base, max_tokens=300)
        stream.start()
        assert stream.first.wait(60) and stream.error is None, stream.error
        container.kill("SIGTERM")  # what the kubelet sends first; tini passes it on
        stream.join(timeout=120)
        code = container.wait(timeout=120)
        log = container.log()
    finally:
        container.close()
    assert stream.error is None, f"{stream.error!r}\n{log[-4000:]}"
    # the server saw the signal with the request in flight, and let it finish
    assert "draining: 1 request(s) in flight" in log, log[-4000:]
    assert stream.events and stream.events[-1] == "[DONE]", stream.events[-3:]
    last = json.loads(stream.events[-2])
    assert last["choices"][0]["finish_reason"] == "length", f"cut short: {last}\n{log[-4000:]}"
    assert code == 0, f"exit {code} after SIGTERM:\n{log[-4000:]}"
