from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltasync import LocalStore, ObjectWriter, SigningKey, VerifyKey, compute_delta, write_anchor, write_delta
from deltasync.cli import main
from deltasync.testing.stream import UpdateStream
from deltasync.tokens import agent_id_of
from tests.conftest import PUBLISHER_TOKEN, ServerThread, coordinator_settings, overwrite


@pytest.fixture
def published(local_store: LocalStore, update_stream: UpdateStream) -> LocalStore:
    prev = update_stream.bf16()
    base = write_anchor(local_store, prev, version=0, encoding="packed")
    prev = {k: v.clone() for k, v in prev.items()}
    for v in (1, 2, 3):
        curr = update_stream.step()
        base = write_delta(local_store, compute_delta(prev, curr, update_prev=True), state=curr, version=v, base=base)
    write_anchor(local_store, curr, version=3, encoding="raw")
    return local_store


def test_ls(published: LocalStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", str(published.root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["kind"], r["base_version"]) for r in rows] == [
        (0, "anchor", None),
        (1, "delta", 0),
        (2, "delta", 1),
        (3, "delta", 2),
        (3, "anchor", None),
    ]
    assert all(0 < r["changed_fraction"] < 0.1 for r in rows if r["kind"] == "delta")
    assert main(["ls", published.uri]) == 0
    out = capsys.readouterr().out
    assert "5 objects in file://" in out and "packed" in out


def test_inspect_store_version_and_file(published: LocalStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(published.root), "--version", "2", "--json"]) == 0
    (report,) = json.loads(capsys.readouterr().out)
    assert report["kind"] == "delta" and report["encoding"] == "packed" and report["base_version"] == 1
    nnz = sum(t["nnz"] for t in report["tensors"])
    stored = sum(t["bytes"] for t in report["tensors"])
    assert nnz > 0 and stored / nnz < 3 and sum(t["raw_bytes"] for t in report["tensors"]) == 6 * nnz
    shard = published.root / "v00000003" / "anchor" / "shard-00000.safetensors"
    assert main(["inspect", str(shard)]) == 0
    out = capsys.readouterr().out
    assert "anchor v3, raw" in out and "model.embed_tokens.weight" in out and "100.00%" in out


def test_verify(published: LocalStore, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(published.root), "--version", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) | {"elements": 0} == {
        "version": 2,
        "ok": True,
        "anchor": 0,
        "deltas": [1, 2],
        "tensors": 24,
        "elements": 0,
        "signed": False,
        "ledger": False,
        "run_id": None,
    }
    assert main(["verify", str(published.root), "--version", "3"]) == 0
    assert "v3: ok, 24 tensors" in capsys.readouterr().out


def test_errors_exit_1_with_the_class_name(published: LocalStore, capsys: pytest.CaptureFixture[str]) -> None:
    key = "v00000002/shard-00000.safetensors"
    data = bytearray(published.get(key))
    data[-1] ^= 0xFF
    overwrite(published, key, bytes(data))
    assert main(["verify", str(published.root), "--version", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("IntegrityError: ") and "sha256" in err and "Traceback" not in err
    assert main(["verify", str(published.root), "--version", "9"]) == 1
    assert capsys.readouterr().err.startswith("ObjectNotFound: ")
    assert main(["inspect", str(published.root / "nope.safetensors")]) == 1
    assert "no such shard file" in capsys.readouterr().err


def test_usage_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["verify", str(tmp_path)])
    assert exc.value.code == 2
    assert main(["ls", "gopher://bucket"]) == 2
    assert "no store for scheme 'gopher'" in capsys.readouterr().err


def test_console_script_is_installed(published: LocalStore) -> None:
    exe = Path(sys.executable).with_name("deltasync")
    out = subprocess.run([str(exe), "ls", str(published.root), "--json"], capture_output=True, text=True, check=True)
    assert len(json.loads(out.stdout)) == 5


def test_verify_with_a_public_key_refuses_what_the_publisher_did_not_sign(
    tmp_path: Path, update_stream: UpdateStream, capsys: pytest.CaptureFixture[str]
) -> None:
    """A forged manifest + shard written into the store: checksums alone would match ("all checksums match");
    signed by the publisher, and checked with its public key, the forgery is refused."""
    assert main(["keygen", str(tmp_path / "key")]) == 0
    assert (tmp_path / "key").stat().st_mode & 0o777 == 0o600 and "key id sha256:" in capsys.readouterr().out
    store = LocalStore(tmp_path / "store")
    signed = ObjectWriter(store=store, signing_key=SigningKey.from_file(tmp_path / "key"))
    weights = update_stream.bf16()
    write_anchor(signed, weights, version=0)
    pub = str(tmp_path / "key.pub")
    assert main(["verify", str(store.root), "--version", "0", "--public-key", pub]) == 0
    assert "every manifest signed by sha256:" in capsys.readouterr().out
    forger = ObjectWriter(store=LocalStore(tmp_path / "evil"))  # unsigned, consistent, zeros
    write_anchor(forger, {k: v * 0 for k, v in weights.items()}, version=0)
    for k in forger.store.list():
        overwrite(store, k, forger.store.get(k))
    assert main(["verify", str(store.root), "--version", "0"]) == 0  # the store alone cannot tell
    assert "not that the publisher wrote it" in capsys.readouterr().err
    assert main(["verify", str(store.root), "--version", "0", "--public-key", pub]) == 1
    err = capsys.readouterr().err
    assert err.startswith("SignatureError: ") and "the signature does not match the manifest's bytes" in err
    assert VerifyKey.from_file(pub).key_id.startswith("sha256:")


def test_verify_against_the_coordinator_refuses_unregistered_bytes(
    tmp_path: Path, update_stream: UpdateStream, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    from deltasync_coordinator.app import create_app

    from deltasync.client import CoordinatorClient
    from deltasync.schemas import VersionCreate

    store = LocalStore(tmp_path / "store")
    with ServerThread(create_app(coordinator_settings(tmp_path))) as server:
        with CoordinatorClient(server.url, token=PUBLISHER_TOKEN) as client:
            lease = client.acquire_lease("cli-test", ttl_s=60)
            m = write_anchor(store, update_stream.bf16(), version=0)
            client.register_version(VersionCreate.for_manifest(m), lease=lease)
        monkeypatch.setenv("DELTASYNC_TOKEN", PUBLISHER_TOKEN)
        assert main(["verify", str(store.root), "--version", "0", "--coordinator", server.url]) == 0
        assert f"every manifest registered with {server.url}" in capsys.readouterr().out
        forger = LocalStore(tmp_path / "evil")
        write_anchor(forger, {k: v * 0 for k, v in update_stream.bf16().items()}, version=0)
        for k in forger.list():
            overwrite(store, k, forger.get(k))
        assert main(["verify", str(store.root), "--version", "0", "--coordinator", server.url]) == 1
        assert "the coordinator registered sha256:" in capsys.readouterr().err
        monkeypatch.setenv("DELTASYNC_PUBLISHER_TOKEN", PUBLISHER_TOKEN)
        assert main(["gc", "--coordinator", server.url, "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "problem: anchor v0: its manifest's sha256 is" in out and "0 objects would delete" in out


def test_verify_and_gc_take_several_coordinator_replicas(
    tmp_path: Path, update_stream: UpdateStream, capsys: pytest.CaptureFixture[str], monkeypatch
) -> None:
    """``--coordinator URL1,URL2``: a replica that is down is skipped; a bad list is a usage error."""
    from deltasync_coordinator.app import create_app

    from deltasync.client import CoordinatorClient, RetryPolicy
    from deltasync.schemas import VersionCreate
    from tests.support.replicas import refused_url

    store = LocalStore(tmp_path / "store")
    down = refused_url()
    with ServerThread(create_app(coordinator_settings(tmp_path))) as server:
        with CoordinatorClient([down, server.url], token=PUBLISHER_TOKEN, retry=RetryPolicy(backoff_s=0.01)) as client:
            lease = client.acquire_lease("cli-test", ttl_s=60)
            client.register_version(
                VersionCreate.for_manifest(write_anchor(store, update_stream.bf16(), version=0)), lease=lease
            )
        monkeypatch.setenv("DELTASYNC_TOKEN", PUBLISHER_TOKEN)
        monkeypatch.setenv("DELTASYNC_PUBLISHER_TOKEN", PUBLISHER_TOKEN)
        both = f"{down},{server.url}"
        assert main(["verify", str(store.root), "--version", "0", "--coordinator", both]) == 0
        assert f"every manifest registered with {both}" in capsys.readouterr().out
        assert main(["gc", "--coordinator", both, "--dry-run", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["kept_anchor"] == 0
        assert main(["gc", "--coordinator", f"{server.url},coord-b:8600", "--dry-run"]) == 2
        assert "'coord-b:8600' must start with http:// or https://" in capsys.readouterr().err
    assert main(["gc", "--coordinator", f"{down},{refused_url()}", "--dry-run"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the failover warnings
    assert err.startswith("CoordinatorError: POST /v1/gc: no coordinator replica answered in 4 rounds over 2 replicas")
    assert f"{down}: ConnectError(" in err


def test_token_prints_an_agent_token_bound_to_its_id(monkeypatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("DELTASYNC_AGENT_SECRET", "s" * 32)
    assert main(["token", "--agent-id", "vllm-3"]) == 0
    token = capsys.readouterr().out.strip()
    assert agent_id_of("s" * 32, token) == "vllm-3" and agent_id_of("t" * 32, token) is None
    monkeypatch.delenv("DELTASYNC_AGENT_SECRET")
    with pytest.raises(SystemExit, match="set DELTASYNC_AGENT_SECRET"):
        main(["token", "--agent-id", "vllm-3"])


def test_a_database_password_on_the_command_line_is_recognised() -> None:
    """The README never puts the PostgreSQL password in argv, and the CLI warns when it is there."""
    from deltasync._cli_run import password_in_url

    assert password_in_url("postgresql://deltasync:secret@db-host:5432/run1")
    assert not password_in_url("postgresql://deltasync@db-host:5432/run1")
    assert not password_in_url("postgresql://db-host:5432/run1")
    assert not password_in_url("ledger.db") and not password_in_url(None)
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert "--db postgresql://deltasync:PW@" not in readme


def test_version_is_the_installed_distributions_and_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    import deltasync

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"deltasync {version('deltasync')}\n"
    assert deltasync.__version__ == version("deltasync")
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "Bit-exact sparse weight sync" in out and ":mod:" not in out and "``" not in out


def test_keygen_onto_an_existing_key_or_into_a_missing_directory_says_so_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's promise for every command: an error is one line ``ErrorClass: message`` (exit 1), the traceback
    only with ``--debug``; and an existing key is never replaced."""
    key = tmp_path / "publisher.key"
    assert main(["keygen", str(key)]) == 0
    before = key.read_bytes()
    capsys.readouterr()
    assert main(["keygen", str(key)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"FileExistsError: {key} exists: keygen never replaces a key") and "Traceback" not in err
    assert key.read_bytes() == before
    assert main(["keygen", str(tmp_path / "missing" / "k.key")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("FileNotFoundError: ") and "Traceback" not in err, err
