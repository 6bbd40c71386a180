"""Measured performance profiles: a versioned data file of step timings, and a model fitted to it.

A profile is written by ``splitserve_planner.runtime_profile`` from our runtime's engine (``LLMEngine``)
on a real device: prefill steps (``numSeqs`` prompts of ``numTokens`` new tokens after
``numCachedTokens`` cached ones) and decode steps (``batchSize`` sequences holding
``numContextTokens`` KV tokens in total), optionally general ``steps`` recorded in a serving run
(tokens, sequences, attention pairs, KV tokens held), each with the measured ``seconds``. The file is JSON
(or YAML) with ``schemaVersion: 1``; it is validated with pydantic on load and every problem
is reported as ``path: message``.

:class:`ProfileModel` turns the samples into a :class:`~.perf_model.StepCost` by a
non-negative least-squares fit of ``seconds = c0 + c_token·tokens + c_seq·sequences +
c_pair·attention_pairs + c_kv·kv_tokens_held`` over all samples: one linear model for prefill, decode and mixed
steps, which interpolates between the samples and extrapolates linearly beyond them.
:meth:`ProfileModel.fit_errors` reports how well it reproduces its own samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from .perf_model import prefill_attention_pairs

SCHEMA_VERSION = 1
PROFILES_DIR = Path(__file__).parent / "profiles"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class ModelInfo(_Model):
    name: str = Field(min_length=1)
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    vocab_size: int = Field(ge=1)


class EngineInfo(_Model):
    max_num_seqs: int = Field(ge=1)
    max_batched_tokens: int = Field(ge=1)
    block_size: int = Field(ge=1)


class PrefillSample(_Model):
    num_seqs: int = Field(ge=1)
    num_tokens: int = Field(ge=1, description="New tokens per sequence.")
    num_cached_tokens: int = Field(default=0, ge=0)
    seconds: float = Field(gt=0)


class DecodeSample(_Model):
    batch_size: int = Field(ge=1)
    num_context_tokens: int = Field(ge=0, description="KV tokens held by the batch before the step.")
    seconds: float = Field(gt=0)


class StepSample(_Model):
    """A general (mixed) engine step, as recorded during a serving run."""

    num_tokens: int = Field(ge=1)
    num_seqs: int = Field(ge=1)
    num_attention_pairs: int = Field(ge=1)
    num_kv_tokens: int = Field(ge=0)
    seconds: float = Field(gt=0)


class Profile(_Model):
    """The profile file (camelCase keys)."""

    schema_version: Literal[1]
    kind: Literal["PerfProfile"] = "PerfProfile"
    model: ModelInfo
    device: str = Field(min_length=1, description="e.g. cpu, NVIDIA H200")
    dtype: str
    tensor_parallel: int = Field(default=1, ge=1)
    kv_bytes_per_token: int = Field(ge=1)
    kv_capacity_tokens: int = Field(ge=1)
    engine: EngineInfo
    measured_at: str = ""
    tool: str = ""
    notes: str = ""
    prefill: list[PrefillSample] = Field(min_length=2)
    decode: list[DecodeSample] = Field(min_length=2)
    steps: list[StepSample] = Field(default_factory=list, description="Mixed steps from a serving run.")


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and each problem."""


def load_profile(*, path: Path) -> Profile:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ProfileError(f"cannot read profile {path}: {exc}") from exc
    try:
        raw: Any = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ProfileError(
            f"profile {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {exc}"
        ) from exc
    if not isinstance(raw, dict):
        raise ProfileError(f"profile {path} must hold an object")
    version = raw.get("schemaVersion")
    if version != SCHEMA_VERSION:
        raise ProfileError(f"profile {path}: schemaVersion must be {SCHEMA_VERSION}, got {version!r}")
    try:
        return Profile.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors(include_url=False):
            where = ".".join(str(p) for p in err["loc"])
            problems.append(f"{where}: {'unknown field' if err['type'] == 'extra_forbidden' else err['msg']}")
        raise ProfileError(f"profile {path} is invalid: " + "; ".join(problems)) from None


def save_profile(*, profile: Profile, path: Path) -> None:
    data = profile.model_dump(by_alias=True, mode="json")
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _features(*, tokens: float, seqs: float, pairs: float, kv_tokens: float) -> list[float]:
    return [1.0, tokens, seqs, pairs, kv_tokens]


def _sample_rows(profile: Profile) -> tuple[np.ndarray, np.ndarray]:
    rows: list[list[float]] = []
    seconds: list[float] = []
    for p in profile.prefill:
        pairs = p.num_seqs * prefill_attention_pairs(
            num_new_tokens=p.num_tokens, num_computed_tokens=p.num_cached_tokens
        )
        rows.append(
            _features(
                tokens=p.num_seqs * p.num_tokens,
                seqs=p.num_seqs,
                pairs=pairs,
                kv_tokens=p.num_seqs * p.num_cached_tokens,
            )
        )
        seconds.append(p.seconds)
    for d in profile.decode:
        rows.append(
            _features(
                tokens=d.batch_size,
                seqs=d.batch_size,
                pairs=d.num_context_tokens + d.batch_size,
                kv_tokens=d.num_context_tokens,
            )
        )
        seconds.append(d.seconds)
    for st in profile.steps:
        rows.append(
            _features(tokens=st.num_tokens, seqs=st.num_seqs, pairs=st.num_attention_pairs, kv_tokens=st.num_kv_tokens)
        )
        seconds.append(st.seconds)
    return np.asarray(rows), np.asarray(seconds)


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0 (drop the most negative one and refit).

    Absolute, not relative, error: the mean step time is what queueing depends on.
    """
    weights = np.ones_like(b)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sub, *_ = np.linalg.lstsq(a[:, active] * weights[:, None], b * weights, rcond=None)
        if (sub >= 0).all():
            coef[:] = 0.0
            coef[active] = sub
            return coef
        active.pop(int(np.argmin(sub)))
    return coef


class ProfileModel:
    """A :class:`~.perf_model.StepCost` fitted to a measured :class:`Profile`."""

    def __init__(self, *, profile: Profile, name: str = "", jitter_seed: int | None = None) -> None:
        """``jitter_seed``: multiply each step by a ratio (measured / fitted) drawn from the
        profile's own samples, so the simulated steps vary as the measured ones did (CPU
        steps on a shared machine do, a lot); None: the deterministic fit."""
        self.profile = profile
        self.name = name or f"{profile.model.name} on {profile.device} (profile)"
        self.kv_capacity_tokens = profile.kv_capacity_tokens
        self.kv_bytes_per_token = profile.kv_bytes_per_token
        rows, seconds = _sample_rows(profile)
        self.coefficients = _nonnegative_least_squares(rows, seconds)
        c0, c_tok, c_seq, c_pair, c_kv = (float(c) for c in self.coefficients)
        self._c0, self._c_tok, self._c_seq, self._c_pair, self._c_kv = c0, c_tok, c_seq, c_pair, c_kv
        self._jitter: list[float] = []
        self._jitter_index = 0
        if jitter_seed is not None:
            ratios = seconds / np.maximum(rows @ self.coefficients, 1e-12)
            ratios = ratios / ratios.mean()  # keep the fitted mean
            self._jitter = [float(x) for x in np.random.default_rng(jitter_seed).choice(ratios, size=1 << 16)]

    def step_seconds(self, *, num_tokens: int, num_seqs: int, num_attention_pairs: int, num_kv_tokens: int) -> float:
        seconds = (
            self._c0
            + self._c_tok * num_tokens
            + self._c_seq * num_seqs
            + self._c_pair * num_attention_pairs
            + self._c_kv * num_kv_tokens
        )
        if self._jitter:
            self._jitter_index = (self._jitter_index + 1) & 0xFFFF
            return seconds * self._jitter[self._jitter_index]
        return seconds

    def fit_errors(self) -> dict[str, float]:
        """Median and max relative error of the fit on its own samples."""
        rows, seconds = _sample_rows(self.profile)
        predicted = rows @ self.coefficients
        rel = np.abs(predicted - seconds) / seconds
        return {"median_relative_error": float(np.median(rel)), "max_relative_error": float(rel.max())}


def shipped_profiles() -> list[Path]:
    return sorted(PROFILES_DIR.glob("*.json"))
