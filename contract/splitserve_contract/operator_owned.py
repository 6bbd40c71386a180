"""What the operator itself renders into a runtime pod, so that an InferenceService must not set
it a second time: environment variable names and ``splitserve serve`` flags.

Why a table: ``spec.runtime.env`` entries replace the operator's variables of the same name
(server-side apply keys a container's env by name), and ``spec.runtime.extraArgs`` come after
the rendered flags (argparse keeps the last value; the runtime's parsers take no
abbreviations, so only a flag's full spellings can set it). Without a refusal an author could
switch the API key off (``SPLITSERVE_API_KEY=""``), send the hub token elsewhere
(``HF_ENDPOINT``, ``HF_TOKEN``), or give a pod another role, port, compat hash or handoff key
file (``--role``, ``--compat-hash=x``), bypassing the fields that own those settings and the
admission rules on them. The operator's CRD rules are generated from
these tables (``splitserve_operator.api.rules``), and its models apply the same checks in
Python (:func:`env_name_problem`, :func:`extra_arg_problem`).

``--device`` stays open on purpose: a pool may be scheduled on GPU nodes while the runtime
computes on the CPU (the local demo does), and nothing else in the service depends on it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from .flags import SERVE_FLAGS
from .wire import (
    ENV_API_KEY,
    ENV_HUB_ENDPOINT,
    ENV_HUB_TOKEN,
    ENV_HUB_TOKEN_SOURCE,
    ENV_MODEL_CACHE,
    ENV_POD_IP,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
)

_POD_IDENTITY: Final = "the downward API"

RESERVED_ENV_NAMES: Final[Mapping[str, str]] = {
    ENV_API_KEY: "spec.runtime.apiKeySecretRef",
    "VLLM_API_KEY": "spec.runtime.apiKeySecretRef",  # vLLM pods' name for it
    ENV_HUB_TOKEN: "spec.model.hubTokenSecretRef",
    "HUGGING_FACE_HUB_TOKEN": "spec.model.hubTokenSecretRef",  # the hub client's older name for HF_TOKEN
    ENV_HUB_TOKEN_SOURCE: "spec.model.hubTokenSecretRef",
    ENV_HUB_ENDPOINT: "spec.model.hubEndpoint",
    ENV_MODEL_CACHE: "the operator",
    ENV_POD_NAME: _POD_IDENTITY,
    ENV_POD_NAMESPACE: _POD_IDENTITY,
    ENV_POD_IP: _POD_IDENTITY,
}
"""Variables the operator renders (or the hub client reads in their place), and the field or
party that sets each."""

RESERVED_ENV_PREFIXES: Final[Mapping[str, str]] = {
    "SPLITSERVE_": "splitserve",
    "LWS_": "the LeaderWorkerSet of a multi-node pool",
}
"""Name prefixes reserved as a whole: splitserve's own variables, and those the LeaderWorkerSet
webhook injects into a multi-node pool's pods (the runtime reads its placement from them)."""


def env_name_owner(name: str) -> str | None:
    """Who sets the variable ``name`` (a field of the spec, or a party), or None when it is the
    user's to set."""
    if name in RESERVED_ENV_NAMES:
        return RESERVED_ENV_NAMES[name]
    return next((owner for prefix, owner in RESERVED_ENV_PREFIXES.items() if name.startswith(prefix)), None)


def _instead(owner: str) -> str:
    """What to do instead of setting something ``owner`` sets."""
    if owner.startswith(("spec.", "the pool's")):
        return f"set {owner} instead"
    return f"it comes from {owner}"


def env_name_problem(name: str) -> str | None:
    """Why ``runtime.env`` must not set ``name``, or None."""
    owner = env_name_owner(name)
    if owner is None:
        return None
    return f"runtime.env must not set {name}, which the operator renders: {_instead(owner)}"


OPERATOR_SERVE_FLAGS: Final[Mapping[str, str]] = {
    "model": "spec.model.uri",
    "served-model-name": "spec.model.servedName",
    "revision": "spec.model.revision",
    "role": "spec.mode",
    "host": "the operator",
    "port": "the operator",
    "kv-port": "the operator",
    "dtype": "spec.model.dtype",
    "quantization": "spec.model.quantization",
    "max-model-len": "spec.model.maxModelLen",
    "block-size": "spec.kvCache.blockSize",
    "kv-memory-fraction": "spec.kvCache.memoryFraction",
    "prefix-caching": "spec.kvCache.prefixCaching",
    "kv-cache-dtype": "spec.kvCache.dtype",
    "max-num-seqs": "spec.scheduling.maxNumSeqs",
    "max-num-batched-tokens": "spec.scheduling.maxBatchedTokens",
    "chunked-prefill": "spec.scheduling.chunkedPrefill",
    "tensor-parallel-size": "the pool's parallelism.tensor",
    "pipeline-parallel-size": "the pool's parallelism.pipeline",
    "nnodes": "the pool's resources.gpusPerNode",
    "speculative-method": "spec.scheduling.speculative.method",
    "num-speculative-tokens": "spec.scheduling.speculative.numTokens",
    "speculative-max-num-seqs": "spec.scheduling.speculative.maxNumSeqs",
    "speculative-draft-model": "spec.scheduling.speculative.draftModel",
    "compat-hash": "the operator",
    "handoff-key-file": "the operator",
    "rendezvous-key-file": "the operator",
    "prefill-headers": "spec.router.mode",
}
"""Every ``splitserve serve`` flag the operator may render (by name, without ``--``), and the
field or party that sets it."""


def owners_in_words(table: Mapping[str, str], *, spell: str = "{}") -> str:
    """``table`` (name -> owner) as one phrase, names grouped by owner in first-seen order:
    ``--model (spec.model.uri), --host, --port (the operator)``."""
    grouped: dict[str, list[str]] = {}
    for name, owner in table.items():
        grouped.setdefault(owner, []).append(spell.format(name))
    return ", ".join(f"{', '.join(names)} ({owner})" for owner, names in grouped.items())


def _forms(names: Mapping[str, str] | frozenset[str]) -> dict[str, str]:
    """Every spelling argparse accepts in full for the flags ``names`` (``--no-x`` for a
    boolean), mapped to the flag's name."""
    booleans = {f.name for f in SERVE_FLAGS if f.is_bool}
    out = {f"--{name}": name for name in names}
    out |= {f"--no-{name}": name for name in names if name in booleans}
    return out


RESERVED_FLAG_FORMS: Final[Mapping[str, str]] = _forms(OPERATOR_SERVE_FLAGS)
"""``--role``, ``--prefix-caching``, ``--no-prefix-caching``, ...: each mapped to its flag."""
OPEN_FLAG_FORMS: Final[frozenset[str]] = frozenset(
    _forms(frozenset(f.name for f in SERVE_FLAGS) - OPERATOR_SERVE_FLAGS.keys())
)
"""The full spellings of the serve flags an InferenceService may pass in ``extraArgs``."""


def extra_arg_option(arg: str) -> str | None:
    """The option ``arg`` names as argparse reads it (``--port=1`` -> ``--port``), or None when
    it names none (a value, a single-dash option, ``--`` alone)."""
    if not arg.startswith("--"):
        return None
    option = arg.split("=", 1)[0]
    return option if len(option) > 2 else None


def reserved_flag_of(arg: str) -> str | None:
    """The operator-rendered flag that ``arg`` would set: the flag in full, its ``--no-`` form
    or ``--flag=value``. None for anything else (the runtime's parsers take no abbreviations,
    so ``--rol`` is an unknown argument the pod refuses at start-up, not ``--role``)."""
    option = extra_arg_option(arg)
    return RESERVED_FLAG_FORMS.get(option) if option is not None else None


def extra_arg_problem(arg: str) -> str | None:
    """Why ``runtime.extraArgs`` must not hold ``arg``, or None."""
    flag = reserved_flag_of(arg)
    if flag is None:
        return None
    return (
        f"runtime.extraArgs must not set --{flag}, which the operator renders "
        f"(the last value would win): {_instead(OPERATOR_SERVE_FLAGS[flag])}"
    )


# --------------------------------------------------------------------------- vLLM pools
VLLM_OPERATOR_FLAGS: Final[Mapping[str, str]] = {
    "model": "spec.model.uri",
    "served-model-name": "spec.model.servedName",
    "revision": "spec.model.revision",
    "host": "the operator",
    "port": "the operator",
    "api-key": "spec.runtime.apiKeySecretRef",
    "config": "the operator",  # a YAML file of flags would set the others
    "dtype": "spec.model.dtype",
    "quantization": "spec.model.quantization",
    "max-model-len": "spec.model.maxModelLen",
    "block-size": "spec.kvCache.blockSize",
    "gpu-memory-utilization": "spec.kvCache.memoryFraction",
    "enable-prefix-caching": "spec.kvCache.prefixCaching",
    "no-enable-prefix-caching": "spec.kvCache.prefixCaching",
    "kv-cache-dtype": "spec.kvCache.dtype",
    "max-num-seqs": "spec.scheduling.maxNumSeqs",
    "max-num-batched-tokens": "spec.scheduling.maxBatchedTokens",
    "enable-chunked-prefill": "spec.scheduling.chunkedPrefill",
    "no-enable-chunked-prefill": "spec.scheduling.chunkedPrefill",
    "tensor-parallel-size": "the pool's parallelism.tensor",
    "pipeline-parallel-size": "the pool's parallelism.pipeline",
    "speculative-config": "spec.scheduling.speculative",
    "kv-transfer-config": "spec.mode",
    "shutdown-timeout": "the operator (the pod's drain on SIGTERM)",
}
"""Every ``vllm serve`` option the operator may render for a vLLM pool (by name, without
``--``), and the field or party that sets it. vLLM's parser is more forgiving than the
runtime's: it takes any unambiguous abbreviation (``--api-ke``), underscores for dashes
(``--api_key``) and dotted sub-keys of JSON options (``--speculative-config.method``), so
:func:`vllm_extra_arg_problem` refuses an option whose name, so spelled, starts any of these."""

VLLM_SHORT_OPTION_REGEX: Final = r"^-(q|tp($|=)|pp($|=))"
"""vLLM's single-dash aliases of options in :data:`VLLM_OPERATOR_FLAGS`: ``-q`` (quantization,
also with its value attached: ``-qfp8``), ``-tp`` and ``-pp`` (parallel sizes, ``-tp=2``)."""
_VLLM_SHORT_FLAGS: Final[Mapping[str, str]] = {
    "q": "quantization",
    "tp": "tensor-parallel-size",
    "pp": "pipeline-parallel-size",
}


def vllm_option_name(arg: str) -> str | None:
    """The long option ``arg`` spells as vLLM reads it (``--api_key=x`` -> ``api-key``,
    ``--speculative-config.method`` -> ``speculative-config``), or None for a value."""
    if not arg.startswith("--"):
        return None
    return arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")


def vllm_reserved_flag_of(arg: str) -> str | None:
    """The operator-rendered vLLM option ``arg`` would set, in full, or None."""
    short = re.match(VLLM_SHORT_OPTION_REGEX, arg)
    if short is not None:
        return _VLLM_SHORT_FLAGS[short.group(1)[:2].rstrip("=")]
    name = vllm_option_name(arg)
    if name is None:
        return None
    # An abbreviation argparse would expand: any prefix of a reserved name (the empty name, a
    # bare ``--``, ends vLLM's options, after which nothing the operator renders would parse).
    return next((flag for flag in VLLM_OPERATOR_FLAGS if flag.startswith(name)), None)


def vllm_extra_arg_problem(arg: str) -> str | None:
    """Why the extraArgs of a vLLM pool must not hold ``arg``, or None."""
    flag = vllm_reserved_flag_of(arg)
    if flag is None:
        return None
    return (
        f"extraArgs {arg.split('=', 1)[0]} sets --{flag}, an option the operator renders for engine vllm: "
        f"{_instead(VLLM_OPERATOR_FLAGS[flag])}"
    )


__all__ = [
    "OPEN_FLAG_FORMS",
    "OPERATOR_SERVE_FLAGS",
    "RESERVED_ENV_NAMES",
    "RESERVED_ENV_PREFIXES",
    "RESERVED_FLAG_FORMS",
    "env_name_owner",
    "env_name_problem",
    "extra_arg_option",
    "extra_arg_problem",
    "owners_in_words",
    "reserved_flag_of",
    "VLLM_OPERATOR_FLAGS",
    "VLLM_SHORT_OPTION_REGEX",
    "vllm_extra_arg_problem",
    "vllm_option_name",
    "vllm_reserved_flag_of",
]
