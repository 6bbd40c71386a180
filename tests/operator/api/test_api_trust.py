"""Admission against a hostile author with create rights on InferenceServices: what the operator
renders into the pods (env, serve flags) cannot be set again through runtime.env or
runtime.extraArgs, the hub endpoint cannot name the pod, the node or the cluster, paths and
revisions cannot climb out of where they point, and an operator serves only the hubs it allows.

Each rule is checked on both sides: the pydantic models (here, directly), and the CRD's CEL
rule or pattern, which is generated from the same table or regex (checked here by reading the
generated rule; the API server itself evaluates them in e2e/test_hostile_manifests.py)."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import crdgen
import pytest

import splitserve_contract as contract
from splitserve_contract import operator_owned
from splitserve_operator import api, main, operator_flags, render
from splitserve_operator.api import hub_policy, rules
from splitserve_operator.engines import splitserve as engine_splitserve


def _obj(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"uri": "hf://org/model"}, "prefill": {}, "decode": {}}
    for key, value in spec.items():
        body[key] = value
    return {
        "apiVersion": api.API_VERSION_STRING,
        "kind": contract.KIND,
        "metadata": {"name": "demo", "namespace": "ns"},
        "spec": body,
    }


def _errors(obj: dict[str, Any]) -> str:
    with pytest.raises(api.InvalidSpecError) as info:
        api.InferenceService.parse(obj)
    return "; ".join(info.value.errors)


def _crd_node(*path: str) -> dict[str, Any]:
    node: dict[str, Any] = crdgen.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for part in path:
        node = node["properties"][part]
    return node


# --------------------------------------------------------------------------- runtime.env
@pytest.mark.parametrize(
    ("name", "field"),
    [
        ("SPLITSERVE_API_KEY", "spec.runtime.apiKeySecretRef"),
        ("HF_TOKEN", "spec.model.hubTokenSecretRef"),
        ("HUGGING_FACE_HUB_TOKEN", "spec.model.hubTokenSecretRef"),
        ("HF_ENDPOINT", "spec.model.hubEndpoint"),
        ("SPLITSERVE_HUB_TOKEN_SOURCE", "spec.model.hubTokenSecretRef"),
        ("SPLITSERVE_MODEL_CACHE", "the operator"),
        ("POD_IP", "the downward API"),
        ("SPLITSERVE_TERMINATION_LOG", "splitserve"),
        ("LWS_LEADER_ADDRESS", "LeaderWorkerSet"),
    ],
)
def test_env_the_operator_renders_is_refused_naming_the_variable_and_its_field(name: str, field: str) -> None:
    # The defect: runtime.env [{name: SPLITSERVE_API_KEY, value: ""}] replaced the rendered
    # secretKeyRef and router and engine answered without a key.
    errors = _errors(_obj(runtime={"env": [{"name": "FOO", "value": "x"}, {"name": name, "value": ""}]}))
    assert f"spec.runtime.env[1].name: runtime.env must not set {name}" in errors
    assert field in errors


def test_env_of_the_users_own_is_admitted() -> None:
    isvc = api.InferenceService.parse(
        _obj(
            runtime={
                "env": [
                    {"name": "HF_HUB_OFFLINE", "value": "1"},
                    {"name": "NCCL_DEBUG", "value": "INFO"},
                    {"name": "SPLITSERVEX", "value": "1"},
                ]
            }
        )
    )
    assert [e.name for e in isvc.spec.runtime.env] == ["HF_HUB_OFFLINE", "NCCL_DEBUG", "SPLITSERVEX"]


def test_every_env_var_render_sets_is_reserved() -> None:
    """One table: whatever the operator renders into a runtime or router container is in it."""
    obj = _obj(
        model={
            "uri": "hf://org/model",
            "hubEndpoint": "https://hf-mirror.corp.example",
            "hubTokenSecretRef": {"name": "hf"},
        },
        runtime={"apiKeySecretRef": {"name": "keys", "key": "k"}},
    )
    children = render.render_children(
        isvc=api.InferenceService.parse(obj), runtime_image="img:1", router_service_account=""
    )
    rendered = {
        e["name"]
        for c in children
        if c["kind"] == "Deployment"
        for e in c["spec"]["template"]["spec"]["containers"][0].get("env", [])
    }
    assert len(rendered) >= 8
    assert {n for n in rendered if operator_owned.env_name_owner(n) is None} == set()


def test_env_cel_rule_is_generated_from_the_table() -> None:
    """The rule sits on each env entry: over the whole list, filtered again for its message, the
    API server estimated it at over 100x the CRD's cost budget and refused the CRD."""
    env_item = _crd_node("spec", "runtime")["properties"]["env"]["items"]
    rule = env_item["x-kubernetes-validations"][0]  # the next: no control characters in the value
    assert rule in [dict(r) for r in api.ENV_VAR_CEL_RULES] and rule["fieldPath"] == ".name"
    for name in operator_owned.RESERVED_ENV_NAMES:
        assert f"'{name}'" in rule["rule"], name
        assert name in rule["messageExpression"]
    for prefix in operator_owned.RESERVED_ENV_PREFIXES:
        assert f"self.name.startsWith('{prefix}')" in rule["rule"]
    assert rule["message"] == api.rules.RESERVED_ENV_SHORT_MESSAGE


# --------------------------------------------------------------------------- runtime.extraArgs
@pytest.mark.parametrize(
    ("arg", "flag", "field"),
    [
        ("--role", "role", "spec.mode"),
        ("--role=decode", "role", "spec.mode"),
        ("--port=9000", "port", "the operator"),
        ("--model", "model", "spec.model.uri"),
        ("--compat-hash", "compat-hash", "the operator"),
        ("--compat-hash=x", "compat-hash", "the operator"),
        ("--handoff-key-file", "handoff-key-file", "the operator"),
        ("--no-prefill-headers", "prefill-headers", "spec.router.mode"),
        ("--prefill-headers", "prefill-headers", "spec.router.mode"),
        ("--no-prefix-caching", "prefix-caching", "spec.kvCache.prefixCaching"),
        ("--speculative-method=ngram", "speculative-method", "spec.scheduling.speculative.method"),
        ("--host", "host", "the operator"),
    ],
)
def test_extra_args_that_override_a_rendered_flag_are_refused(arg: str, flag: str, field: str) -> None:
    errors = _errors(_obj(runtime={"extraArgs": ["--device", "cpu", arg, "x"]}))
    assert f"spec.runtime.extraArgs[2]: runtime.extraArgs must not set --{flag}" in errors
    assert field in errors


def test_extra_args_the_operator_does_not_render_are_admitted() -> None:
    args = [
        "--device",
        "cpu",
        "--num-kv-blocks",
        "64",
        "--max-queue-len=8",
        "--cuda-graphs",
        "--seed",
        "3",
        "--attention-backend",
        "torch",
        "-h",
        "--",
    ]
    assert api.InferenceService.parse(_obj(runtime={"extraArgs": args})).spec.runtime.extra_args == args


def _flags_in(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0].removeprefix("--no-").removeprefix("--") for a in argv if a.startswith("--")}


def test_every_flag_render_emits_is_reserved() -> None:
    """The table covers what render emits for specs that use every feature (speculation with a
    draft model, multi-node pools, InferencePool mode, every non-default model and cache setting)."""
    specs = [
        _obj(
            mode="Disaggregated",
            model={
                "uri": "pvc://models/llama",
                "revision": "v1",
                "servedName": "x",
                "dtype": "bfloat16",
                "quantization": "fp8",
                "maxModelLen": 4096,
            },
            kvCache={"blockSize": 32, "memoryFraction": 0.5, "prefixCaching": False, "dtype": "fp8"},
            engine={
                "maxNumSeqs": 8,
                "maxBatchedTokens": 1024,
                "chunkedPrefill": False,
                "speculative": {"method": "ngram", "numTokens": 2, "maxNumSeqs": 4},
            },
            prefill={"resources": {"gpus": 2}, "parallelism": {"tensor": 2}},
            decode={"resources": {"gpus": 4, "gpusPerNode": 2}, "parallelism": {"tensor": 2, "pipeline": 2}},
            router={"mode": "InferencePool"},
        ),
        _obj(
            mode="Aggregated",
            prefill=None,
            decode=None,
            aggregated={"resources": {"gpus": 0}},
            engine={"speculative": {"method": "draft", "draftModel": "pvc://drafts/small"}},
        ),
    ]
    emitted: set[str] = set()
    for obj in specs:
        obj["spec"] = {k: v for k, v in obj["spec"].items() if v is not None}
        isvc = api.InferenceService.parse(obj)
        for component in render.components(isvc.spec):
            if component.pool is not None:
                emitted |= _flags_in(
                    contract.serve_argv(
                        engine_splitserve.serve_args(
                            isvc=isvc, role=component.role, pool=component.pool, compat_hash="c0ffee"
                        )
                    )
                )
    assert {
        "role",
        "compat-hash",
        "handoff-key-file",
        "prefill-headers",
        "nnodes",
        "speculative-draft-model",
        "prefix-caching",
    } <= emitted
    assert emitted - {"device"} <= set(operator_owned.OPERATOR_SERVE_FLAGS)
    assert set(operator_owned.OPERATOR_SERVE_FLAGS) <= {f.name for f in contract.SERVE_FLAGS}


def test_no_open_flag_is_refused_as_an_abbreviation() -> None:
    for form in operator_owned.OPEN_FLAG_FORMS:
        assert operator_owned.reserved_flag_of(form) is None, form
        assert operator_owned.reserved_flag_of(f"{form}=1") is None, form


def test_extra_args_cel_rule_is_generated_from_the_table() -> None:
    item = _crd_node("spec", "runtime")["properties"]["extraArgs"]["items"]
    rule = item["x-kubernetes-validations"][0]  # the next: no control characters
    assert rule in [dict(r) for r in api.EXTRA_ARG_CEL_RULES]
    listed = re.findall(r"'(--[a-z-]+)'", rule["rule"].split(".exists(f,")[0])
    assert set(listed) == set(operator_owned.RESERVED_FLAG_FORMS)
    assert "self.startsWith(f + '=')" in rule["rule"]  # --flag=value
    # The owners are too long to repeat on every extraArgs list: the models' message names them.
    assert "docs/operator.md" in rule["messageExpression"]
    for flag, owner in operator_owned.OPERATOR_SERVE_FLAGS.items():
        problem = operator_owned.extra_arg_problem(f"--{flag}")
        assert problem is not None and owner in problem


@pytest.mark.parametrize("abbreviated", ["--rol", "--compat-h=x", "--handoff-key"])
def test_an_abbreviated_rendered_flag_is_an_unknown_argument_to_the_runtime(abbreviated: str) -> None:
    """Admission takes a flag's full spellings only; the runtime's parser takes nothing else, so
    an abbreviation can never set a rendered flag (argparse's default would expand it)."""
    from splitserve_runtime.server.app import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--model", "m", *abbreviated.split("=", 1)[:1], "x"])


# --------------------------------------------------------------------------- model.hubEndpoint
BAD_HUBS = [
    "http://169.254.169.254/latest/meta-data",
    "http://169.254.169.254:80",
    "https://kubernetes.default.svc",
    "https://KUBERNETES.DEFAULT",
    "https://api.ns.svc.cluster.local:443",
    "https://evil.cluster.local",
    "http://localhost:8080",
    "http://hub.localhost",
    "http://127.0.0.1:9000",
    "http://0.0.0.0",
    "http://[::1]:80",
    "http://[0:0:0:0:0:0:0:1]",
    "http://[::]",
    "http://[fe80::1]",
    "http://[::ffff:169.254.169.254]",
    "http://[::ffff:a9fe:a9fe]",
    "http://2852039166",  # 169.254.169.254 as one number
    "http://0xa9fea9fe",
    "http://0251.0376.0251.0376",  # octal
    "http://10.0.0.010",
    "http://metadata",
    "http://metadata.google.internal",
    "https://hub.example:99999",
    "https://hub.example:0",
]
MALFORMED_HUBS = [
    "https://user:pass@hub.example",
    "https://token@hub.example/x",
    "https://hub.example/a\x00b",
    "https://hub.example/\x1b[31mred",
    "https://hub.example/a\\b",
    "https://hub.example/a b",
    "https://hub.example/x?token=1",
    "https://hub.example:123456",
]
GOOD_HUBS = [
    "https://huggingface.co",
    "https://hf-mirror.corp.example/api/hf",
    "http://10.213.0.1:8765",
    "http://[2001:db8::1]:8080",
    "https://hub.example:65535",
    "https://1hub.example",
]


@pytest.mark.parametrize("endpoint", BAD_HUBS)
def test_hub_endpoint_naming_the_pod_the_node_or_the_cluster_is_refused(endpoint: str) -> None:
    errors = _errors(_obj(model={"uri": "hf://org/model", "hubEndpoint": endpoint}))
    assert "spec.model.hubEndpoint: model.hubEndpoint must" in errors
    assert (api.HUB_ENDPOINT_HOST_RULE_MESSAGE in errors) or (api.HUB_ENDPOINT_AUTHORITY_RULE_MESSAGE in errors)


@pytest.mark.parametrize("endpoint", MALFORMED_HUBS)
def test_hub_endpoint_with_credentials_controls_or_escapes_does_not_match_the_pattern(endpoint: str) -> None:
    errors = _errors(_obj(model={"uri": "hf://org/model", "hubEndpoint": endpoint}))
    assert "spec.model.hubEndpoint: must be an http:// or https:// URL" in errors
    assert not re.match(_crd_node("spec", "model", "hubEndpoint")["pattern"], endpoint)


@pytest.mark.parametrize("endpoint", GOOD_HUBS)
def test_hub_endpoint_of_a_hub_is_admitted(endpoint: str) -> None:
    assert api.InferenceService.parse(_obj(model={"uri": "hf://org/model", "hubEndpoint": endpoint}))


def test_hub_cel_rules_use_the_models_regexes() -> None:
    model = _crd_node("spec", "model")
    cel = [r for r in model["x-kubernetes-validations"] if r["fieldPath"] == ".hubEndpoint"]
    assert [r["message"] for r in cel] == [api.HUB_ENDPOINT_AUTHORITY_RULE_MESSAGE, api.HUB_ENDPOINT_HOST_RULE_MESSAGE]
    text = " ".join(r["rule"] for r in cel)
    for regex in (
        rules.HUB_ENDPOINT_AUTHORITY_REGEX,
        rules.HUB_ENDPOINT_INTERNAL_REGEX,
        rules.HUB_ENDPOINT_NUMERIC_REGEX,
        rules.HUB_ENDPOINT_DOTTED_QUAD_REGEX,
    ):
        assert rules.cel_string(regex) in text
    # CEL's string literal keeps the regex's backslashes: \\[ in CEL is \[ for RE2.
    assert "\\\\[" in text and "\\[" not in text.replace("\\\\[", "")


# --------------------------------------------------------------------------- revision and uri
@pytest.mark.parametrize(
    "revision",
    ["..", "../../etc/passwd", "main/../../x", "/abs", "a\\b", "a\x00b", "a\x1b[0m", "a b", "main/", "a//b", "-rf"],
)
def test_revision_that_could_be_a_path_is_refused(revision: str) -> None:
    errors = _errors(_obj(model={"uri": "hf://org/model", "revision": revision}))
    assert "spec.model.revision: must be a git branch, tag or commit" in errors
    assert not re.match(_crd_node("spec", "model", "revision")["pattern"], revision)


@pytest.mark.parametrize("revision", ["main", "v1.0", "refs/pr/1", "a" * 40, "release/2024-06"])
def test_revision_names_are_admitted(revision: str) -> None:
    assert api.InferenceService.parse(_obj(model={"uri": "hf://org/model", "revision": revision}))


@pytest.mark.parametrize(
    "uri",
    [
        "pvc://claim/../..",
        "pvc://claim/a/../../etc",
        "pvc://claim/.",
        "pvc://claim//x",
        "file:///models/../etc/shadow",
        "file:///a\x00b",
        "file:///a\x1b[31m",
        "file:///a\\..\\b",
        "hf://org/name/../../x.gguf",
        "file://",
    ],
)
def test_model_uri_that_climbs_out_is_refused(uri: str) -> None:
    assert "spec.model.uri: must be hf://org/name" in _errors(_obj(model={"uri": uri}))
    engine = {"speculative": {"method": "draft", "draftModel": uri}}
    assert "spec.engine.speculative.draftModel: must be" in _errors(_obj(engine=engine))


@pytest.mark.parametrize(
    "uri",
    [
        "pvc://claim",
        "pvc://claim/",
        "pvc://claim/llama/v1",
        "pvc://c/..gguf-dir/x",
        "file:///",
        "file:///models/llama-3/",
        "hf://org/name/sub/m.Q4_0.gguf",
    ],
)
def test_model_uris_are_admitted(uri: str) -> None:
    assert api.InferenceService.parse(_obj(model={"uri": uri}))


# --------------------------------------------------------------------------- allowed hubs
@pytest.fixture
def enforced() -> Iterator[None]:
    hub_policy.enforce(
        hub_policy.HubAllowList(
            entries=("https://huggingface.co", "http://10.213.0.1", "https://mirror.example:8443/hf")
        )
    )
    try:
        yield
    finally:
        hub_policy.enforce(None)


@pytest.mark.parametrize(
    ("endpoint", "allowed"),
    [
        ("https://huggingface.co", True),
        ("https://HuggingFace.co/", True),
        ("https://huggingface.co:443", True),
        ("http://huggingface.co", False),  # another scheme
        ("https://huggingface.co.evil.example", False),
        ("http://10.213.0.1:8765", True),  # an entry without a port allows every port of the host
        ("http://10.213.0.12", False),
        ("https://mirror.example:8443/hf", True),
        ("https://mirror.example:8443/hf/org", True),
        ("https://mirror.example:8443/hfx", False),  # below the path, not beside it
        ("https://mirror.example/hf", False),  # the entry names its port
    ],
)
def test_allow_list_matching(endpoint: str, allowed: bool, enforced: None) -> None:
    assert hub_policy.enforced() is not None and hub_policy.enforced().allows(endpoint) is allowed  # type: ignore[union-attr]
    obj = _obj(model={"uri": "hf://org/model", "hubEndpoint": endpoint})
    if allowed:
        api.InferenceService.parse(obj)
    else:
        errors = _errors(obj)
        assert f"model hub {endpoint} is not on this operator's list of allowed hubs" in errors
        assert "hub.allowedEndpoints" in errors


def test_a_hub_off_the_list_is_stalled_and_nothing_is_rendered(enforced: None) -> None:
    """What the reconciler does with it: the parse fails (Stalled/InvalidSpec with this message,
    reconcile._parse), so render is never reached."""
    with pytest.raises(api.InvalidSpecError, match="https://attacker.example is not on this operator's list"):
        api.InferenceService.parse(_obj(model={"uri": "hf://org/model", "hubEndpoint": "https://attacker.example"}))


def test_the_default_hub_must_be_allowed_too_when_hf_models_use_it() -> None:
    hub_policy.enforce(hub_policy.HubAllowList(entries=("https://mirror.example",)))
    try:
        assert "hf:// models come from https://huggingface.co" in _errors(_obj())
        assert api.InferenceService.parse(_obj(model={"uri": "pvc://models/x"}))
        assert api.InferenceService.parse(
            _obj(model={"uri": "hf://org/model", "hubEndpoint": "https://mirror.example"})
        )
    finally:
        hub_policy.enforce(None)


def test_allow_all_and_allow_none() -> None:
    assert hub_policy.HubAllowList.parse("*").allows("https://anything.example")
    nothing = hub_policy.HubAllowList.parse("")
    assert nothing.entries == () and not nothing.allows("https://huggingface.co")


@pytest.mark.parametrize("entry", ["huggingface.co", "ftp://x.example", "https://x.example:99999", "https://"])
def test_bad_allow_list_entries_stop_the_operator_at_start(entry: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="is not scheme://host"):
        hub_policy.HubAllowList.parse(entry)
    with pytest.raises(SystemExit) as info:
        main.main([f"--allowed-hub-endpoints={entry}"])
    assert info.value.code == 2
    assert "--allowed-hub-endpoints" in capsys.readouterr().err


def test_the_operator_default_allows_only_huggingface() -> None:
    args = operator_flags.operator_args_from_namespace(main.build_parser().parse_args([]))
    assert hub_policy.HubAllowList.parse(args.allowed_hub_endpoints).entries == hub_policy.DEFAULT_ALLOWED_HUB_ENDPOINTS


def test_models_parse_without_a_list_outside_the_operator() -> None:
    assert hub_policy.enforced() is None
    obj = _obj(model={"uri": "hf://org/model", "hubEndpoint": "https://hf-mirror.corp.example"})
    assert api.InferenceService.parse(copy.deepcopy(obj))
