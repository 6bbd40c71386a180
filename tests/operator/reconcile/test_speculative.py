"""spec.scheduling.speculative: the API serves the methods of the capabilities table (refusing the
others with its message), a draft model exactly with method draft, numTokens within bounds;
the CRD carries the same rules as CEL; the operator passes the flags (and a draft model's
volume) to decode and aggregated pods only, and the compat hash ignores the setting."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import crdgen
import pytest

import splitserve_contract as contract
from splitserve_contract import capabilities as caps
from splitserve_operator import api, render

IMAGE = "registry.example/splitserve:1.2.3"
FLAGS = ("--speculative-method", "--num-speculative-tokens", "--speculative-max-num-seqs")


def _isvc(speculative: dict[str, Any] | None = None, *, mode: str = "Disaggregated") -> api.InferenceService:
    spec: dict[str, Any] = {"model": {"uri": "hf://meta/llama-3"}, "mode": mode}
    if mode == "Disaggregated":
        spec.update(prefill={}, decode={})
    else:
        spec["aggregated"] = {}
    if speculative is not None:
        spec["scheduling"] = {"speculative": speculative}
    return api.InferenceService.parse(
        {
            "apiVersion": api.API_VERSION_STRING,
            "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "ns"},
            "spec": spec,
        }
    )


def _errors(speculative: dict[str, Any]) -> list[str]:
    with pytest.raises(api.InvalidSpecError) as info:
        _isvc(speculative)
    return info.value.errors


# ------------------------------------------------------------------------------ API


def test_defaults_are_no_speculation_and_the_runtime_defaults() -> None:
    speculative = _isvc().spec.scheduling_settings.speculative
    assert (speculative.method, speculative.num_tokens, speculative.max_num_seqs) == ("none", 4, 16)
    assert speculative.draft_model is None and not speculative.enabled
    serve = contract.ServeArgs()
    assert (serve.speculative_method, serve.num_speculative_tokens, serve.speculative_max_num_seqs) == ("none", 4, 16)


def test_ngram_is_accepted_and_round_trips() -> None:
    isvc = _isvc({"method": "ngram", "numTokens": 16, "maxNumSeqs": 1})
    speculative = isvc.spec.scheduling_settings.speculative
    assert (speculative.method, speculative.num_tokens, speculative.max_num_seqs) == ("ngram", 16, 1)
    dumped = isvc.dump()["spec"]["scheduling"]["speculative"]
    assert dumped == {"method": "ngram", "numTokens": 16, "maxNumSeqs": 1}
    assert api.InferenceService.parse(isvc.dump()) == isvc


@pytest.mark.parametrize("method", caps.SPECULATIVE_METHOD.known)
def test_methods_follow_the_capabilities_table(method: str) -> None:
    speculative = {"method": method, **({"draftModel": "hf://meta/llama-3-tiny"} if method == "draft" else {})}
    if caps.SPECULATIVE_METHOD.is_supported(method):
        assert _isvc(speculative).spec.scheduling_settings.speculative.method == method
    else:
        assert _errors(speculative) == [
            f"spec.scheduling.speculative.method: {caps.SPECULATIVE_METHOD.unsupported_message(method)}"
        ]


@pytest.mark.parametrize(
    ("speculative", "expected"),
    [
        ({"method": "eagle"}, "spec.scheduling.speculative.method: Input should be none, ngram or draft"),
        (
            {"method": "ngram", "draftModel": "hf://meta/small"},
            f"spec.scheduling.speculative: {api.DRAFT_MODEL_RULE_MESSAGE}",
        ),
        ({"draftModel": "hf://meta/small"}, f"spec.scheduling.speculative: {api.DRAFT_MODEL_RULE_MESSAGE}"),
        ({"method": "draft"}, f"spec.scheduling.speculative: {api.DRAFT_METHOD_RULE_MESSAGE}"),
        (
            {"method": "draft", "draftModel": "s3://bucket/small"},
            "spec.scheduling.speculative.draftModel: must be hf://org/name",
        ),
        ({"numTokens": 0}, "spec.scheduling.speculative.numTokens: Input should be greater than or equal to 1"),
        ({"numTokens": 17}, "spec.scheduling.speculative.numTokens: Input should be less than or equal to 16"),
        ({"maxNumSeqs": 0}, "spec.scheduling.speculative.maxNumSeqs: Input should be greater than or equal to 1"),
        ({"method": "ngram", "numTokns": 2}, "spec.scheduling.speculative.numTokns: unknown field"),
    ],
)
def test_invalid_settings_have_readable_errors(speculative: dict[str, Any], expected: str) -> None:
    errors = _errors(speculative)
    assert any(line.startswith(expected) for line in errors), errors


# ------------------------------------------------------------------------------ CRD


def _crd_speculative() -> dict[str, Any]:
    schema = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    node: dict[str, Any] = schema["properties"]["spec"]["properties"]["scheduling"]["properties"]["speculative"]
    return node


def test_crd_schema_has_the_enum_bounds_and_defaults() -> None:
    node = _crd_speculative()
    props = node["properties"]
    assert node["default"] == {"method": "none", "numTokens": 4, "maxNumSeqs": 16}
    assert props["method"]["enum"] == ["none", "ngram", "draft"] and props["method"]["default"] == "none"
    assert (props["numTokens"]["minimum"], props["numTokens"]["maximum"]) == (1, api.MAX_SPECULATIVE_TOKENS)
    assert props["maxNumSeqs"]["minimum"] == 1
    assert props["draftModel"]["pattern"] == api.MODEL_URI_PATTERN and "default" not in props["draftModel"]
    for field in ("method", "numTokens", "maxNumSeqs", "draftModel"):
        assert props[field]["description"], field
    method = props["method"]["description"]
    for words in (
        "greedy output is token for token the same",
        "keeps the model's distribution",
        "decode and aggregated pods",
        "prefill pods never speculate",
        "inter-token latency",
    ):
        assert words in method, words


def test_crd_rules_refuse_unsupported_methods_and_a_draft_model_without_draft() -> None:
    rules = _crd_speculative()["x-kubernetes-validations"]
    capability_rule = caps.cel_rule(caps.SPECULATIVE_METHOD)
    assert (capability_rule in rules) == (caps.SPECULATIVE_METHOD.supported != caps.SPECULATIVE_METHOD.known)
    assert {
        "rule": "!has(self.draftModel) || (has(self.method) && self.method == 'draft')",
        "message": api.DRAFT_MODEL_RULE_MESSAGE,
    } in rules
    assert {
        "rule": "!has(self.method) || self.method != 'draft' || has(self.draftModel)",
        "message": api.DRAFT_METHOD_RULE_MESSAGE,
    } in rules
    # The rules are listed with the other cross-field rules in the generated reference.
    reference = crdgen.api_reference()
    assert api.DRAFT_MODEL_RULE_MESSAGE in reference and api.DRAFT_METHOD_RULE_MESSAGE in reference
    supported = ", ".join(map(str, caps.SPECULATIVE_METHOD.supported))
    assert f"| speculative decoding method | none, ngram, draft | {supported} |" in reference


def test_a_method_the_table_does_not_serve_is_refused_by_cel_on_the_method_field() -> None:
    """The generator's rule for this field when a method is known but not served (as draft was
    before its issue landed): the standard message, naming the value."""
    without_draft = dataclasses.replace(caps.SPECULATIVE_METHOD, supported=("none", "ngram"))
    rule = caps.cel_rule(without_draft)
    assert rule["rule"] == "!has(self.method) || self.method in ['none', 'ngram']"
    assert rule["messageExpression"] == (
        "'speculative decoding method ' + self.method + ' is not supported by this version of "
        "splitserve (supported: none, ngram)'"
    )
    assert without_draft.unsupported_message("draft") == (
        "speculative decoding method draft is not supported by this version of splitserve (supported: none, ngram)"
    )


# ------------------------------------------------------------------------------ render


def _children(isvc: api.InferenceService) -> list[dict[str, Any]]:
    return render.render_children(isvc=isvc, runtime_image=IMAGE, router_service_account="sa")


def _deployment(objs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == name]
    return found


def _args(objs: list[dict[str, Any]], name: str) -> list[str]:
    containers = _deployment(objs, name)["spec"]["template"]["spec"]["containers"]
    return list(containers[0]["args"])


def _parse_serve(argv: list[str]) -> contract.ServeArgs:
    assert argv[:2] == ["splitserve", "serve"]
    parser = argparse.ArgumentParser()
    contract.add_serve_arguments(parser)
    return contract.serve_args_from_namespace(parser.parse_args(argv[2:]))


def test_decode_gets_the_flags_prefill_and_router_do_not() -> None:
    objs = _children(_isvc({"method": "ngram", "numTokens": 6, "maxNumSeqs": 8}))
    decode = _parse_serve(_args(objs, "llama-decode"))
    assert (decode.speculative_method, decode.num_speculative_tokens, decode.speculative_max_num_seqs) == (
        "ngram",
        6,
        8,
    )
    prefill_argv = _args(objs, "llama-prefill")
    assert not [a for a in prefill_argv if a in FLAGS]
    assert _parse_serve(prefill_argv).speculative_method == "none"
    assert not [a for a in _args(objs, "llama-router") if a.startswith("--speculative") or a in FLAGS]


def test_aggregated_pods_get_the_flags() -> None:
    objs = _children(_isvc({"method": "ngram"}, mode="Aggregated"))
    engine = _parse_serve(_args(objs, "llama-engine"))
    assert (engine.speculative_method, engine.num_speculative_tokens, engine.speculative_max_num_seqs) == (
        "ngram",
        4,
        16,
    )
    argv = _args(objs, "llama-engine")
    assert argv[argv.index("--speculative-method") + 1] == "ngram"


def test_method_none_renders_no_flags_whatever_the_other_fields() -> None:
    plain, tuned = _children(_isvc()), _children(_isvc({"method": "none", "numTokens": 8, "maxNumSeqs": 2}))
    for name in ("llama-prefill", "llama-decode", "llama-router"):
        assert not [a for a in _args(tuned, name) if a in FLAGS]
        # identical pods: turning the knobs without a method rolls nothing
        assert _deployment(tuned, name) == _deployment(plain, name)


def _compat(objs: list[dict[str, Any]], name: str) -> str:
    return str(_deployment(objs, name)["metadata"]["labels"][contract.LABEL_COMPAT_HASH])


def test_compat_hash_ignores_speculation_so_prefill_and_decode_still_pair() -> None:
    plain, spec = _children(_isvc()), _children(_isvc({"method": "ngram", "numTokens": 8}))
    compat = render.compat_hash_of(isvc=_isvc(), runtime_image=IMAGE)
    assert render.compat_hash_of(isvc=_isvc({"method": "ngram", "numTokens": 8}), runtime_image=IMAGE) == compat
    for name in ("llama-prefill", "llama-decode"):
        assert _compat(spec, name) == _compat(plain, name) == compat
    assert (
        _parse_serve(_args(spec, "llama-decode")).compat_hash == _parse_serve(_args(spec, "llama-prefill")).compat_hash
    )
    # Only the decode pods roll: the prefill pod template (and its config hash) is unchanged.
    assert _deployment(spec, "llama-prefill") == _deployment(plain, "llama-prefill")
    assert _deployment(spec, "llama-decode") != _deployment(plain, "llama-decode")


def _volumes(objs: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = _deployment(objs, name)["spec"]["template"]["spec"]
    return ({v["name"]: v for v in pod["volumes"]}, {m["name"]: m for m in pod["containers"][0]["volumeMounts"]})


def test_a_hub_draft_model_reaches_decode_pods_only() -> None:
    objs = _children(_isvc({"method": "draft", "draftModel": "hf://meta/llama-3-tiny", "numTokens": 3}))
    decode = _parse_serve(_args(objs, "llama-decode"))
    assert (decode.speculative_method, decode.speculative_draft_model, decode.num_speculative_tokens) == (
        "draft",
        "hf://meta/llama-3-tiny",
        3,
    )
    assert "--speculative-draft-model" not in _args(objs, "llama-prefill")
    assert "draft-model-pvc" not in _volumes(objs, "llama-decode")[0]


def test_a_draft_model_on_its_own_claim_is_mounted_read_only_on_decode_pods() -> None:
    objs = _children(_isvc({"method": "draft", "draftModel": "pvc://drafts/small/v1"}))
    decode = _parse_serve(_args(objs, "llama-decode"))
    assert decode.speculative_draft_model == "file:///mnt/models/drafts/small/v1"
    volumes, mounts = _volumes(objs, "llama-decode")
    assert volumes["draft-model-pvc"]["persistentVolumeClaim"] == {"claimName": "drafts", "readOnly": True}
    assert mounts["draft-model-pvc"] == {"name": "draft-model-pvc", "mountPath": "/mnt/models/drafts", "readOnly": True}
    for other in ("llama-prefill", "llama-router"):
        assert "draft-model-pvc" not in _volumes(objs, other)[0], other


def test_a_draft_model_on_the_models_claim_uses_the_models_mount() -> None:
    isvc = api.InferenceService.parse(
        {
            "apiVersion": api.API_VERSION_STRING,
            "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "ns"},
            "spec": {
                "model": {"uri": "pvc://models/llama/8b"},
                "mode": "Aggregated",
                "aggregated": {},
                "engine": {"speculative": {"method": "draft", "draftModel": "pvc://models/llama/1b"}},
            },
        }
    )
    objs = _children(isvc)
    engine = _parse_serve(_args(objs, "llama-engine"))
    assert (engine.model, engine.speculative_draft_model) == (
        "file:///mnt/models/models/llama/8b",
        "file:///mnt/models/models/llama/1b",
    )
    volumes, mounts = _volumes(objs, "llama-engine")
    assert "model-pvc" in volumes and "draft-model-pvc" not in volumes
    assert len({m["mountPath"] for m in mounts.values()}) == len(mounts)  # no path mounted twice


def test_a_draft_model_leaves_the_compat_hash_and_prefill_pods_alone() -> None:
    plain = _children(_isvc())
    draft = _children(_isvc({"method": "draft", "draftModel": "pvc://drafts/small"}))
    assert _compat(draft, "llama-decode") == _compat(plain, "llama-decode")
    assert _deployment(draft, "llama-prefill") == _deployment(plain, "llama-prefill")
