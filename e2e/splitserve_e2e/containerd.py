"""A private containerd for the kubelet node: its own config, root, state and socket.

The kubelet needs a CRI runtime. Debian's containerd 1.6 (CRI plugin, runc v2 shim) is started
with everything under the node's directory, never ``/var/lib/containerd``, ``/run/containerd``
or the system socket, so it cannot disturb (or be disturbed by) another containerd on the
machine. Cgroups are cgroupfs (cgroup v1 here, no systemd as PID 1); network namespaces are
mounted under its state directory (``netns_mounts_under_state_dir``) so that teardown finds
them there; the sandbox image is the locally built pause image, imported into the ``k8s.io``
namespace (the CRI plugin's) together with the test images: nothing outside the machine can
be pulled (the project's image comes from the loopback registry).

The root (content store, snapshots, metadata) may live elsewhere than the rest
(``ContainerdLayout(root_directory=...)``): the kubelet node keeps it in the cache, so the
project's image (several GB) is pulled and unpacked once, not once per cluster. Only one
containerd uses it at a time (the kubelet node's machine-wide lock); state, socket and
mounts stay per cluster. Before the kubelet starts, :meth:`Containerd.forget_containers`
removes what a killed run left in the shared metadata (:func:`start_containerd` does it).

Pulls from a loopback registry (``127.0.0.1:5000``) need no registry configuration: without
``registry.config_path`` the CRI plugin's default endpoint scheme is ``http`` for localhost
and loopback hosts, ``https`` for every other.

Shims (``containerd-shim-runc-v2``) start their own sessions, so stopping the containerd
process group does not end them: :meth:`Containerd.remove_all` kills and deletes every task
through ``ctr`` first, and the kubelet node kills whatever is left in its cgroup.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

from splitserve_e2e.process import ManagedProcess, start_process, wait_until

CRI_NAMESPACE = "k8s.io"
PINNED_LABEL = "io.cri-containerd.pinned"
"""containerd's CRI plugin reports an image carrying this label (value ``pinned``) as pinned."""


@dataclasses.dataclass(frozen=True)
class ContainerdLayout:
    """Where one private containerd keeps everything."""

    directory: Path
    root_directory: Path | None = None
    """Content store, snapshots and metadata; ``None``: ``directory/root``."""

    @property
    def config(self) -> Path:
        return self.directory / "config.toml"

    @property
    def socket(self) -> Path:
        return self.directory / "containerd.sock"

    @property
    def root(self) -> Path:
        return self.root_directory or self.directory / "root"

    @property
    def state(self) -> Path:
        return self.directory / "state"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.socket}"


def _toml_string(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def write_config(
    *, layout: ContainerdLayout, sandbox_image: str, cni_bin_dir: Path, cni_conf_dir: Path, runc: Path
) -> Path:
    """containerd 1.6 config (version 2) with the CRI plugin, runc v2 and cgroupfs."""
    values = {
        "root": layout.root,
        "state": layout.state,
        "socket": layout.socket,
        "ttrpc": layout.directory / "containerd.sock.ttrpc",
        "opt": layout.directory / "opt",
        "cni_bin": cni_bin_dir,
        "cni_conf": cni_conf_dir,
        "runc_root": layout.directory / "runc",
        "runc": runc,
    }
    q = {key: _toml_string(str(value)) for key, value in values.items()}
    text = f"""version = 2
root = {q["root"]}
state = {q["state"]}
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = {q["socket"]}

[ttrpc]
  address = {q["ttrpc"]}

[debug]
  level = "warn"

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = {q["opt"]}

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = {_toml_string(sandbox_image)}
  netns_mounts_under_state_dir = true
  enable_selinux = false
  disable_apparmor = true
  # no CAP_SYS_RESOURCE here (CapEff lacks bit 24): lowering oom_score_adj below
  # containerd's own fails in runc ("failed to update /proc/self/oom_score_adj"), which
  # kills every sandbox (pause asks for -998); clamp instead, as rootless setups do
  restrict_oom_score_adj = true
  tolerate_missing_hugetlb_controller = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = {q["cni_bin"]}
    conf_dir = {q["cni_conf"]}
    max_conf_num = 1

  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"

    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = {q["runc"]}
        Root = {q["runc_root"]}
"""
    layout.directory.mkdir(parents=True, exist_ok=True)
    layout.config.write_text(text)
    return layout.config


@dataclasses.dataclass
class CtrClient:
    """The ``ctr`` client bound to one private containerd's socket."""

    layout: ContainerdLayout
    ctr_binary: Path

    def ctr(self, *args: str, timeout_seconds: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ctr --address <our socket> --namespace k8s.io ARGS``."""
        result = subprocess.run(
            [str(self.ctr_binary), "--address", str(self.layout.socket), "--namespace", CRI_NAMESPACE, *args],
            capture_output=True,
            text=True,
            timeout=timeout_seconds,
            check=False,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"ctr {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def import_image(self, archive: Path) -> None:
        """Import an OCI archive into the CRI namespace and unpack it for the snapshotter."""
        self.ctr("images", "import", str(archive), timeout_seconds=120.0)

    def pin_image(self, reference: str) -> None:
        """Mark an image pinned for the CRI plugin, which reports it to the kubelet as such: the
        kubelet's image garbage collection never removes a pinned image. Imported images need it:
        the kubelet does not count the sandbox (pause) image as used by any container, and
        nothing can pull these back (they are made here, not served by a registry)."""
        self.ctr("images", "label", reference, f"{PINNED_LABEL}=pinned")

    def tasks(self) -> dict[str, int]:
        """Container id → pid of its live task (``ctr tasks ls``)."""
        out: dict[str, int] = {}
        for line in self.ctr("tasks", "ls").stdout.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 3 and fields[1].isdigit():
                out[fields[0]] = int(fields[1])
        return out

    def images(self) -> dict[str, str]:
        """Image reference → target digest in the CRI namespace."""
        out: dict[str, str] = {}
        for line in self.ctr("images", "ls").stdout.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 3:
                out[fields[0]] = fields[2]
        return out

    def remove_images(self, *, prefix: str, keep: str) -> list[str]:
        """Remove the images whose reference starts with ``prefix``, except ``keep``, with
        every other reference to them (the CRI plugin adds ``name@sha256:<manifest>`` and the
        image id ``sha256:<config>``), then collect garbage synchronously (the shared root
        keeps every image ever pulled otherwise; each new build adds its changed layers)."""
        images = self.images()
        kept_digest = images.get(keep)
        doomed_digests = {
            digest for ref, digest in images.items() if ref.startswith(prefix) and ref != keep and digest != kept_digest
        }
        doomed = [ref for ref, digest in images.items() if digest in doomed_digests]
        if doomed:
            self.ctr("images", "rm", "--sync", *doomed, timeout_seconds=300.0)
        return doomed

    def forget_containers(self) -> list[str]:
        """Remove every container (and its task) the metadata still lists, e.g. after a
        killed run on a shared root; returns their ids."""
        listing = self.ctr("containers", "ls", "--quiet", check=False).stdout.split()
        if listing:
            self.remove_all()
        return listing

    def remove_all(self) -> None:
        """Kill and delete every task and container (ends their shims cleanly)."""
        for container_id in self.tasks():
            self.ctr("tasks", "kill", "--all", "--signal", "SIGKILL", container_id, check=False, timeout_seconds=10.0)
        for container_id in self.tasks():
            self.ctr("tasks", "delete", "--force", container_id, check=False, timeout_seconds=10.0)
        listing = self.ctr("containers", "ls", "--quiet", check=False).stdout.split()
        if listing:
            self.ctr("containers", "delete", *listing, check=False, timeout_seconds=30.0)


@dataclasses.dataclass
class Containerd(CtrClient):
    """A running private containerd (started by this process) and its ``ctr`` client."""

    process: ManagedProcess = dataclasses.field(kw_only=True)


def attached_containerd(*, directory: Path, root: Path) -> CtrClient:
    """A ``ctr`` client for the containerd another process runs in ``directory`` (the
    ``python -m splitserve_e2e up`` daemon's kubelet node)."""
    ctr_binary = shutil.which("ctr")
    if ctr_binary is None:
        raise RuntimeError("ctr not found (Debian package `containerd`)")
    return CtrClient(layout=ContainerdLayout(directory, root_directory=root), ctr_binary=Path(ctr_binary))


def start_containerd(
    *, layout: ContainerdLayout, log_dir: Path, pid_dir: Path, cgroup_wrapper: list[str], timeout_seconds: float = 60.0
) -> Containerd:
    """Start containerd on ``layout`` (already configured) and wait until ``ctr`` answers.

    ``cgroup_wrapper`` is a command prefix that moves the process into the node's cgroup
    before it execs containerd (shims inherit it, so teardown finds them there).
    """
    binary = shutil.which("containerd")
    ctr_binary = shutil.which("ctr")
    if binary is None or ctr_binary is None:
        raise RuntimeError("containerd/ctr not found (Debian package `containerd`)")
    layout.socket.unlink(missing_ok=True)
    process = start_process(
        name="containerd",
        argv=[*cgroup_wrapper, binary, "--config", str(layout.config)],
        log_path=log_dir / "containerd.log",
        pid_dir=pid_dir,
    )
    runtime = Containerd(layout=layout, process=process, ctr_binary=Path(ctr_binary))

    def answers() -> bool:
        return runtime.ctr("version", timeout_seconds=5.0, check=False).returncode == 0

    wait_until(answers, timeout_seconds=timeout_seconds, what="containerd socket", alive=process, interval_seconds=0.2)
    if runtime.forget_containers():
        # the CRI plugin loaded them into memory at start: restart it on the cleaned metadata
        runtime.process = process = process.restart()
        wait_until(
            answers, timeout_seconds=timeout_seconds, what="containerd socket", alive=process, interval_seconds=0.2
        )
    return runtime
