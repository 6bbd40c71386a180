"""A model load error never carries a file's content: its message becomes the pod's
termination message and the InferenceService's condition. Found by the audit that followed
the ``--revision`` traversal (which quoted /proc/self/environ): the parsers' own messages
quote the values they reject (serde's "unknown variant `...`"), and a safetensors index could
name any file as a shard.

Each case plants a secret where the parser would quote it, and loads through the real code.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from splitserve_runtime.model import ModelLoadError
from splitserve_runtime.model.errors import parser_message
from splitserve_runtime.model.loader import load_model, weight_files
from splitserve_runtime.model.tokenizer import Tokenizer
from splitserve_runtime.ops import get_ops

SECRET = "hf_SECRET_never_in_a_message_0123456789"


def test_parser_messages_keep_what_and_where_but_not_the_value() -> None:
    message = parser_message(
        Exception(
            f"invalid JSON in header: unknown variant `{SECRET}`, expected one of `BOOL`, `F16` at line 1 column 60"
        )
    )
    assert message == "invalid JSON in header: unknown variant <...>, expected one of <...> at line 1 column 60"
    assert SECRET not in parser_message(Exception(f"odd `{SECRET}"))
    assert (
        parser_message(Exception(f'invalid type: string "{SECRET}", expected f32'))
        == "invalid type: string <...>, expected f32"
    )


def test_a_shard_outside_the_model_directory_is_refused_unquoted(tmp_path: Path) -> None:
    (tmp_path / "secret.safetensors").write_text(SECRET)
    model = tmp_path / "model"
    model.mkdir()
    for shard in ("../secret.safetensors", "/etc/passwd", "sub/x.safetensors", f"{SECRET}.bin"):
        (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
        with pytest.raises(ModelLoadError, match="not a plain \\*.safetensors file name") as caught:
            weight_files(model_dir=model)
        assert SECRET not in str(caught.value)


def test_a_safetensors_header_is_not_quoted(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    header = json.dumps({"w": {"dtype": SECRET, "shape": [1], "data_offsets": [0, 4]}}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(ModelLoadError, match="cannot read .*model.safetensors: .*unknown variant <...>") as caught:
        load_model(
            model_dir=model,
            ops=get_ops(name="torch", device=torch.device("cpu")),
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
    assert SECRET not in str(caught.value)


@pytest.mark.parametrize(
    ("where", "said"),
    [
        (("truncation",), "unknown variant <...>, expected one of <...>"),
        (("model", "dropout"), "invalid type: string <...>, expected f32"),
    ],
)
def test_a_tokenizer_file_is_not_quoted(
    tiny_llama_dir: Path, tmp_path: Path, where: tuple[str, ...], said: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    data = json.loads((model / "tokenizer.json").read_text())
    if where == ("truncation",):
        data["truncation"] = {"direction": "Right", "max_length": 8, "strategy": SECRET, "stride": 0}
    else:
        data["model"]["dropout"] = SECRET
    (model / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="cannot load .*tokenizer.json") as caught:
        Tokenizer.from_dir(model_dir=model)
    assert SECRET not in str(caught.value)
    assert said in str(caught.value)
