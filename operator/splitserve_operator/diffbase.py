"""kopf's diff-base as a digest, so that an InferenceService of any size can be handled.

kopf remembers the last handled state of each object (its "essence": spec, labels and the
annotations that are not kopf's own) to tell a change from a resume, and by default keeps it
as JSON in an annotation. All annotations of an object share 256 KiB, so a spec of that size
(a pool's affinity is a list of strings without a bound) made every kopf bookkeeping patch
fail with 422 after the handlers ran, and kopf handled the object again and again, forever.

The handlers never read kopf's diff (every reconcile recomputes everything from the object),
so all kopf needs is whether the essence changed. :class:`DigestDiffBaseStorage` keeps one
SHA-256 of it, under the same annotation key: about 100 bytes whatever the spec.

Upgrade: an object last handled by a version that stored the whole essence still carries
it; :meth:`DigestDiffBaseStorage.fetch` turns that into its digest, so an unchanged object
does not look changed after the upgrade (and a changed one does), and the next store replaces
it with the digest. The digest is taken after the progress storage's own cleaning of the
essence (what kopf compares), so annotations under the operator's prefix (``paused``) stay
out of it as before: pausing or unpausing is not a spec change to kopf.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, Final, cast

import kopf

DIGEST_FIELD: Final = "essenceDigest"
"""The only key of a digest essence (a key no InferenceService essence has)."""


def digest_of(essence: Mapping[str, Any]) -> str:
    """``sha256:<hex>`` of ``essence`` as canonical JSON (sorted keys, no spaces)."""
    encoded = json.dumps(essence, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "sha256:" + hashlib.sha256(encoded.encode()).hexdigest()


def is_digest(essence: Mapping[str, Any]) -> bool:
    return set(essence) == {DIGEST_FIELD}


class DigestDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotation diff-base storage, holding the essence's digest instead of the essence."""

    def __init__(self, *, prefix: str, key: str, progress: kopf.ProgressStorage) -> None:
        super().__init__(prefix=prefix, key=key)
        self._progress = progress

    def _digest(self, essence: kopf.BodyEssence) -> kopf.BodyEssence:
        cleaned = self._progress.clear(essence=essence)
        return cast(kopf.BodyEssence, {DIGEST_FIELD: digest_of(cleaned)})

    def build(self, *, body: kopf.Body, extra_fields: Iterable[kopf.FieldSpec] | None = None) -> kopf.BodyEssence:
        return self._digest(super().build(body=body, extra_fields=extra_fields))

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        stored = super().fetch(body=body)
        if stored is None or not isinstance(stored, Mapping) or is_digest(stored):
            return stored
        return self._digest(stored)  # a whole essence, stored by an earlier version
