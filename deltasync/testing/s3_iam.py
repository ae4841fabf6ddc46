"""A real S3 API that checks who asks: moto's server with its IAM enforcement on, for a store that several hosts
share and only one may write.

    python -m deltasync.testing.s3_iam --host 10.77.0.10 --port 9000 --bucket wordle-run \\
        --grant trainer=write --grant inference=read --credentials credentials

Before it listens, the server makes the bucket and, for each ``--grant USER=ACCESS``, an IAM user whose inline
policy allows ``ACCESS`` (``read``, ``delete``, ``write``; comma-separated) on that bucket and nothing else, and an
access key, written to ``CREDENTIALS/USER.env`` (mode 0600, ``AWS_ACCESS_KEY_ID=...`` lines): the operator hands each
file to the one host it is for. From the first request on, moto checks every signature and every policy: an
unknown access key is ``InvalidAccessKeyId``, a wrong secret ``SignatureDoesNotMatch``, an action the user's policy
does not allow ``AccessDenied`` (all 403).

moto leaves some requests to no check at all, so a guard in front of it (same process, WSGI) refuses them first,
with 403 ``AccessDenied`` and a message that says why:

* a request with no ``Authorization: AWS4-HMAC-SHA256`` header: anonymous (moto fails on most of them with a 500,
  which clients retry, and judges an object's read by its ACL) or presigned in its query (not used by deltasync);
  or one whose header does not sign ``host`` and ``x-amz-date`` (moto fails on it with a 500 too);
* a request signed for another service than ``s3``, or for a path outside the bucket (moto serves every AWS
  service on one port, and its fake instance metadata under ``/latest/``);
* moto's administrative API, ``/moto-api/...``: one anonymous POST to ``/moto-api/reset-auth`` turns every check
  off, another resets every bucket.

moto 5 names some S3 actions by their operation (``s3:ListObjectsV2``, ``s3:HeadObject``) where AWS checks
``s3:ListBucket`` and ``s3:GetObject``: ``read`` allows ``s3:Get*``, ``s3:List*`` and ``s3:Head*``, which covers both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

__all__ = ["ACCESS", "GUARD_MESSAGES", "main", "policy", "read_credentials"]

ACCESS = {
    "read": ["s3:Get*", "s3:List*", "s3:Head*"],
    "delete": ["s3:DeleteObject", "s3:DeleteObjects"],
    "write": [
        "s3:PutObject",
        "s3:CreateMultipartUpload",
        "s3:UploadPart",
        "s3:UploadPartCopy",
        "s3:CompleteMultipartUpload",
        "s3:AbortMultipartUpload",
        "s3:CopyObject",
        "s3:DeleteObject",
        "s3:DeleteObjects",
    ],
}
"""What each access word allows on the bucket (``write`` and ``delete`` include ``read``). AWS checks
``s3:PutObject`` for every step of a multipart upload or copy, and ``s3:DeleteObject`` for each key of a batch
delete; moto checks each step's own name, and ``s3:DeleteObjects`` on the bucket: both are listed."""

GUARD_MESSAGES = {
    "anonymous": "This store refuses anonymous and presigned requests: sign each request (AWS Signature Version 4, "
    "in the Authorization header) with the access key the store's operator gave your host",
    "service": "This endpoint serves S3 only; the request was signed for {service!r}",
    "malformed": "The Authorization header is not a whole AWS Signature Version 4: it names a Credential, "
    "SignedHeaders (host and x-amz-date among them, with an X-Amz-Date header) and a Signature",
    "bucket": "This endpoint serves the bucket {bucket!r} only (path-style: /{bucket}/KEY), not {path!r}",
    "admin": "moto's administrative API (/moto-api) is not served on this endpoint",
}
"""What the guard in front of moto answers, by reason (the ``Message`` of a 403 ``AccessDenied``)."""


def policy(bucket: str, access: Iterable[str]) -> dict[str, Any]:
    """The IAM policy document of a user with ``access`` (words of :data:`ACCESS`) on ``bucket`` alone."""
    words = list(access)
    unknown = [w for w in words if w not in ACCESS]
    if unknown or not words:
        raise ValueError(f"access {','.join(words)!r}: expected words among {sorted(ACCESS)}, comma-separated")
    actions = list(ACCESS["read"])
    for word in words:
        actions += [a for a in ACCESS[word] if a not in actions]
    resources = [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]
    return {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": resources}]}


def _refuse(start_response: Callable[..., Any], message: str) -> list[bytes]:
    from xml.sax.saxutils import escape

    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>AccessDenied</Code><Message>{escape(message)}</Message></Error>"
    ).encode()
    start_response("403 Forbidden", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
    return [body]


def guard(app: Callable[..., Any], bucket: str) -> Callable[..., Any]:
    """``app`` behind the checks moto leaves out (see the module): only signed S3 requests for ``bucket``."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO", "")
        if path == "/moto-api" or path.startswith("/moto-api/"):
            return _refuse(start_response, GUARD_MESSAGES["admin"])
        if path != f"/{bucket}" and not path.startswith(f"/{bucket}/"):
            return _refuse(start_response, GUARD_MESSAGES["bucket"].format(bucket=bucket, path=path))
        authorization = environ.get("HTTP_AUTHORIZATION", "")
        if not authorization.startswith("AWS4-HMAC-SHA256 "):
            return _refuse(start_response, GUARD_MESSAGES["anonymous"])
        # the credential scope as moto reads it to choose the service that answers
        words = authorization.split(",")[0].split()
        scope = words[1].split("/") if len(words) > 1 else []
        service = scope[3].lower() if len(scope) == 5 else ""
        if service != "s3":
            return _refuse(start_response, GUARD_MESSAGES["service"].format(service=service))
        # moto fails (500: clients retry) on a signature without these; refused as S3 would
        fields = dict(f.strip().partition("=")[::2] for f in authorization.split(" ", 1)[1].split(","))
        signed = fields.get("SignedHeaders", "").split(";")
        if not (
            "host" in signed and "x-amz-date" in signed and environ.get("HTTP_X_AMZ_DATE") and fields.get("Signature")
        ):
            return _refuse(start_response, GUARD_MESSAGES["malformed"])
        return app(environ, start_response)

    return guarded


def _grants(values: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for value in values:
        user, sep, access = value.partition("=")
        if not sep or not user.isidentifier() or user in out:
            raise SystemExit(f"--grant {value!r}: expected USER=ACCESS, one per user (e.g. trainer=write)")
        out[user] = access.split(",")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", required=True)
    parser.add_argument("--grant", action="append", default=[], help="USER=ACCESS (read, delete, write)")
    parser.add_argument("--credentials", type=Path, required=True, help="where each user's USER.env goes")
    args = parser.parse_args(argv)
    grants = _grants(args.grant)
    documents = {user: json.dumps(policy(args.bucket, access)) for user, access in grants.items()}

    os.environ.setdefault("AWS_REGION", "us-east-1")
    from moto import settings
    from moto.core.models import DEFAULT_ACCOUNT_ID
    from moto.iam.models import iam_backends
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from moto.s3.models import s3_backends
    from werkzeug.serving import run_simple

    region = os.environ["AWS_REGION"]
    iam = iam_backends[DEFAULT_ACCOUNT_ID]["aws"]
    s3_backends[DEFAULT_ACCOUNT_ID]["aws"].create_bucket(args.bucket, region)
    args.credentials.mkdir(mode=0o700, exist_ok=True)
    for user, document in documents.items():
        iam.create_user(region, user)
        iam.put_user_policy(user, "store", document)
        key = iam.create_access_key(user)
        path = args.credentials / f"{user}.env"
        with contextlib.suppress(FileNotFoundError):  # an earlier server's: replaced, never written through
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"AWS_ACCESS_KEY_ID={key.access_key_id}\nAWS_SECRET_ACCESS_KEY={key.secret_access_key}\n")
    # from the first request on: no request goes unchecked (moto's default lets every request through)
    settings.INITIAL_NO_AUTH_ACTION_COUNT = 0

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(args.host, args.port, guard(app, args.bucket), threaded=True, request_handler=MotoRequestHandler)


def read_credentials(path: Path) -> dict[str, str]:
    """A ``USER.env`` file written by the server, as environment variables."""
    out = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep:
            out[name] = value
    return out


if __name__ == "__main__":
    main()
