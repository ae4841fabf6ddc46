"""Publisher signatures over manifests (Ed25519, through the ``cryptography`` package).

A manifest binds every shard by size and sha256, so signing the manifest's exact bytes authenticates the
whole object. The signature is a small JSON file beside the manifest (``manifest.sig``), written before the
manifest (the commit marker)::

    {"alg": "ed25519", "key_id": "sha256:<hex of the raw public key>", "signature": "<base64>"}

The signed message is ``b"deltasync-manifest-v1\\n" + manifest bytes`` (``b"deltasync-run-v1\\n" + record
bytes`` for a store's run records, :mod:`deltasync.runrecord`), so a signature can never be replayed as a
signature over anything else. Keys are PEM files: ``deltasync keygen PATH`` writes ``PATH`` (private,
mode 0600) and ``PATH.pub``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import FormatError, SignatureError

__all__ = [
    "MAX_SIGNATURE_BYTES",
    "RUN_CONTEXT",
    "SigningKey",
    "VerifyKey",
    "generate_key_files",
]

MAX_SIGNATURE_BYTES = 4096
"""Readers refuse larger signature files (checked before reading)."""

_CONTEXT = b"deltasync-manifest-v1\n"
RUN_CONTEXT = b"deltasync-run-v1\n"
"""The signing context of a store's run records (a manifest's signature never verifies one, nor the reverse)."""


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as exc:  # pragma: no cover - cryptography is a dependency
        raise ImportError("manifest signatures need cryptography: pip install cryptography") from exc
    return ed25519


def _key_id(raw_public: bytes) -> str:
    return "sha256:" + hashlib.sha256(raw_public).hexdigest()


@dataclass(frozen=True, slots=True)
class VerifyKey:
    """A publisher's public key: verifies manifest signatures."""

    raw: bytes
    """The 32 raw bytes of the Ed25519 public key."""

    @property
    def key_id(self) -> str:
        """``sha256:`` of the raw public key, as written in each signature."""
        return _key_id(self.raw)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> VerifyKey:
        """Load a PEM public key (``deltasync keygen`` writes ``PATH.pub``).

        Raises:
            FormatError: the file is not an Ed25519 public key.
        """
        from cryptography.hazmat.primitives import serialization

        data = Path(path).read_bytes()
        try:
            key = serialization.load_pem_public_key(data)
        except ValueError as exc:
            raise FormatError(f"{path}: not a PEM public key ({exc})") from None
        if not isinstance(key, _crypto().Ed25519PublicKey):
            raise FormatError(f"{path}: the public key is {type(key).__name__}, expected Ed25519")
        return cls(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))

    def verify(
        self,
        manifest_bytes: bytes,
        signature_file: bytes | None,
        *,
        name: str,
        context: bytes = _CONTEXT,
        what: str = "manifest",
    ) -> None:
        """Check ``signature_file`` over ``manifest_bytes``.

        Args:
            manifest_bytes: the signed bytes.
            signature_file: the signature file's bytes (``None``: there is none).
            name: the signed object, for messages.
            context: the signing context (:data:`RUN_CONTEXT` for a store's run records).
            what: what the signed bytes are, for messages (``"manifest"``, ``"run record"``).

        Raises:
            SignatureError: no signature, a malformed one, another key's, or a wrong one.
        """
        if signature_file is None:
            raise SignatureError(
                f"{name}: the {what} is not signed, and a public key was given; refusing it (a forged object, "
                "or a publisher started without --signing-key)"
            )
        try:
            obj = json.loads(signature_file)
            alg, key_id, sig = obj["alg"], obj["key_id"], base64.b64decode(obj["signature"], validate=True)
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise SignatureError(f"{name}: the signature file is malformed ({type(exc).__name__})") from None
        if alg != "ed25519":
            raise SignatureError(f"{name}: signature algorithm {alg!r} is not supported (expected ed25519)")
        if key_id != self.key_id:
            raise SignatureError(f"{name}: signed by key {key_id}, the trusted key is {self.key_id}; refusing it")
        from cryptography.exceptions import InvalidSignature

        try:
            _crypto().Ed25519PublicKey.from_public_bytes(self.raw).verify(sig, context + manifest_bytes)
        except InvalidSignature:
            raise SignatureError(
                f"{name}: the signature does not match the {what}'s bytes (a modified or forged {what})"
            ) from None


class SigningKey:
    """A publisher's private key: signs manifests.

    Args:
        private_key: a ``cryptography`` Ed25519PrivateKey.
    """

    def __init__(self, private_key: Any) -> None:
        self._key = private_key
        from cryptography.hazmat.primitives import serialization

        raw = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.verify_key = VerifyKey(raw)

    def __repr__(self) -> str:  # never show key material
        return f"SigningKey({self.verify_key.key_id})"

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> SigningKey:
        """Load a PEM private key (unencrypted; ``deltasync keygen`` writes one)."""
        from cryptography.hazmat.primitives import serialization

        try:
            key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise FormatError(f"{path}: not an unencrypted PEM private key ({exc})") from None
        if not isinstance(key, _crypto().Ed25519PrivateKey):
            raise FormatError(f"{path}: the private key is {type(key).__name__}, expected Ed25519")
        return cls(key)

    @classmethod
    def generate(cls) -> SigningKey:
        """A new random key."""
        return cls(_crypto().Ed25519PrivateKey.generate())

    def sign(self, manifest_bytes: bytes, *, context: bytes = _CONTEXT) -> bytes:
        """The signature file (JSON) over ``manifest_bytes`` (or a run record's, with :data:`RUN_CONTEXT`)."""
        sig = self._key.sign(context + manifest_bytes)
        obj = {"alg": "ed25519", "key_id": self.verify_key.key_id, "signature": base64.b64encode(sig).decode()}
        return (json.dumps(obj, sort_keys=True) + "\n").encode()

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the private key (mode 0600, create-only) and its public key to ``path`` and ``path.pub``."""
        from cryptography.hazmat.primitives import serialization

        private = self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        public = self._key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private)
        Path(f"{os.fspath(path)}.pub").write_bytes(public)


def generate_key_files(path: str | os.PathLike[str]) -> VerifyKey:
    """Generate a key pair into ``path`` (private) and ``path.pub`` (public); returns the public key."""
    key = SigningKey.generate()
    key.write(path)
    return key.verify_key
