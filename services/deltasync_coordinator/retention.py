"""Retention: which objects nothing can still need, proving the kept anchor first, and deleting the rest.

Kept: the newest anchor **that is proven present and intact** (its manifest's sha256 is the registered digest,
every shard is there with its size and sha256), every object above it, every delta above the lowest version a
live agent has applied, and every object of a plan issued within ``plan_lease_s`` (an agent may be fetching
it). Nothing is deleted while no anchor can be proven. Deletion goes through the store, which never follows a
link nor leaves its root; the manifest goes first, so an object stops being committed before its shards do.

**Squashes** (deltas over several versions, beside the chain) are kept while one may still be the cheapest
route of a live agent: a squash goes once no live agent holds its base, or once a newer squash from the same
base is registered (the publisher writes one per version from each base it tracks), unless a recent plan names
it. Deleting a delta never touches the squashes (nor the anchor) under its version's prefix.

**Leftovers**, objects the ledger never registered, go too: one committed under an older publisher lease epoch
than the live one (a fenced publisher's late write; readers already refuse it), and any unregistered object
below the newest registered version (a crashed publisher's shards). The live publisher only ever writes above
the newest registered version, so nothing it may still commit is touched.
"""

from __future__ import annotations

import hashlib
import json
import logging

from deltasync.errors import ObjectNotFound
from deltasync.layout import MANIFEST_FILE, manifest_key, object_prefix, parse_squash_key, version_of_key
from deltasync.manifest import MAX_MANIFEST_BYTES, DeltaManifest
from deltasync.reader import prove_object
from deltasync.schemas import GcPublic, VersionPublic
from deltasync.store import Store
from deltasync.vocab import ObjectKind

from .fleet import Fleet
from .ledger import LedgerDatabase
from .registry import SQUASH_ROWS, Registry, Row, public

__all__ = ["Retention"]

logger = logging.getLogger("deltasync.coordinator.gc")


class Retention:
    """Garbage collection over the ledger and a store."""

    def __init__(
        self, db: LedgerDatabase, registry: Registry, fleet: Fleet, *, stale_after_s: float, plan_lease_s: float
    ):
        self.db, self.registry, self.fleet = db, registry, fleet
        self.stale_after_s, self.plan_lease_s = stale_after_s, plan_lease_s

    def _rows(self) -> list[Row]:
        with self.db.read() as c:
            rows: list[Row] = c.execute(
                "SELECT * FROM versions WHERE deleted_at IS NULL ORDER BY version, kind DESC"
            ).fetchall()
        return rows

    def candidates(self, kept_anchor: int | None = None) -> GcPublic:
        """What would go if ``kept_anchor`` (default: the newest anchor) is the anchor kept. A dry run."""
        rows = self._rows()
        anchors = [r["version"] for r in rows if r["kind"] == "anchor"]
        if kept_anchor is None:
            kept_anchor = max(anchors, default=None)
        if kept_anchor is None:
            return GcPublic(candidates=[], keep_from=None, problems=["no anchor is registered: nothing can go"])
        keep_from = kept_anchor
        live = self.fleet.live_applied(self.stale_after_s)
        if live:
            keep_from = min(keep_from, min(live))
        planned = self.registry.recent_plan_objects(self.plan_lease_s)
        candidates = [
            public(r)
            for r in rows
            if (r["version"], r["kind"]) not in planned
            and (
                (r["kind"] == "anchor" and r["version"] < kept_anchor)
                or (r["kind"] == "delta" and r["version"] <= keep_from)
            )
        ]
        candidates += self._squash_candidates(set(live))
        return GcPublic(candidates=candidates, keep_from=keep_from, kept_anchor=kept_anchor)

    def _squash_candidates(self, live: set[int]) -> list[VersionPublic]:
        """Squashes no live agent can still want: its base is held by none, or a newer squash from its base is
        registered (the publisher writes one per version while an agent stays there); a recent plan's stay."""
        with self.db.read() as c:
            rows = c.execute(f"{SQUASH_ROWS} WHERE deleted_at IS NULL ORDER BY base_version, version").fetchall()
        planned = self.registry.recent_plan_squashes(self.plan_lease_s)
        newest: dict[int, int] = {}
        for r in rows:
            newest[r["base_version"]] = max(newest.get(r["base_version"], -1), r["version"])
        return [
            public(r)
            for r in rows
            if (r["version"], r["base_version"]) not in planned
            and (r["base_version"] not in live or r["version"] < newest[r["base_version"]])
        ]

    def _prove(self, store: Store, row: Row) -> str | None:
        """``None`` if the anchor is present and intact in the store, else what is wrong."""
        name = f"anchor v{row['version']}"
        try:
            data = store.get(row["manifest_key"], max_bytes=MAX_MANIFEST_BYTES)
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            if digest != row["checksum"]:
                return f"{name}: its manifest's sha256 is {digest}, the ledger registered {row['checksum']}"
            prove_object(store, DeltaManifest.from_json(data, name=f"{store.uri}/{row['manifest_key']}"))
        except Exception as exc:  # noqa: BLE001 - any failure means "not proven": reported, nothing deleted
            return f"{name} cannot be proven intact ({type(exc).__name__}: {exc})"
        return None

    def collect(self, store: Store, *, dry_run: bool = False) -> GcPublic:
        """Prove an anchor, then delete every candidate (unless ``dry_run``), recording each deletion."""
        problems: list[str] = []
        anchors = sorted((r for r in self._rows() if r["kind"] == "anchor"), key=lambda r: -r["version"])
        kept = None
        for row in anchors:
            problem = self._prove(store, row)
            if problem is None:
                kept = row["version"]
                break
            problems.append(problem)
            logger.warning("gc: %s; keeping everything above an older anchor", problem)
        if kept is None:
            problems.append("no anchor is proven intact: nothing is deleted")
            return GcPublic(candidates=[], keep_from=None, problems=problems)
        plan = self.candidates(kept)
        leftovers = self._leftovers(store, problems)
        if dry_run:
            return plan.model_copy(update={"problems": problems, "leftovers": sorted(leftovers)})
        gone = []
        for prefix, (keys, why) in sorted(leftovers.items()):
            problem = self._delete_leftover(store, prefix, keys, why)
            if problem is None:
                gone.append(prefix)
            else:
                problems.append(problem)
        deleted = []
        for obj in plan.candidates:
            problem = self._delete(store, obj)
            if problem is None:
                deleted.append(obj)
            else:
                problems.append(problem)
        return GcPublic(
            candidates=plan.candidates,
            deleted=deleted,
            keep_from=plan.keep_from,
            kept_anchor=kept,
            problems=problems,
            leftovers=gone,
        )

    def _leftovers(self, store: Store, problems: list[str]) -> dict[str, tuple[list[str], str]]:
        """Unregistered objects no live publisher can still commit: object prefix -> (its keys, why)."""
        with self.db.read() as c:
            registered: set[tuple[int, ObjectKind, int | None]] = {
                (r["version"], r["kind"], None) for r in c.execute("SELECT version, kind FROM versions")
            }
            registered |= {
                (r["version"], "squash", r["base_version"])
                for r in c.execute("SELECT version, base_version FROM squashes")
            }
            top = c.execute("SELECT MAX(version) FROM versions").fetchone()[0]
            lease = c.execute("SELECT epoch FROM lease WHERE id=1").fetchone()
        epoch = None if lease is None else lease["epoch"]
        try:
            keys = store.list()
        except Exception as exc:  # noqa: BLE001 - a store we cannot list deletes nothing; reported, never a 500
            problems.append(f"leftovers not collected: {type(exc).__name__}: {exc}")
            return {}
        objects: dict[tuple[int, ObjectKind, int | None], list[str]] = {}
        for key in keys:
            version = version_of_key(key)
            if version is None:
                continue
            squash = parse_squash_key(key)
            if squash is not None:
                objects.setdefault((version, "squash", squash[1]), []).append(key)
                continue
            kind: ObjectKind = "anchor" if key.startswith(object_prefix(version, "anchor")) else "delta"
            objects.setdefault((version, kind, None), []).append(key)
        out: dict[str, tuple[list[str], str]] = {}
        for (version, kind, base), found in objects.items():
            if (version, kind, base) in registered:
                continue
            prefix, key, why = object_prefix(version, kind, base), manifest_key(version, kind, base), None
            manifest = self._manifest(store, key) if key in found else None
            if manifest is not None and manifest.lease_epoch is not None and epoch is not None:
                if manifest.lease_epoch < epoch:
                    why = f"committed under lease epoch {manifest.lease_epoch} after epoch {epoch} took the run"
            if why is None and top is not None and version < top:
                why = f"never registered, below the newest registered v{top}"
            if why is not None:
                out[prefix] = (found, why)
        return out

    @staticmethod
    def _manifest(store: Store, key: str) -> DeltaManifest | None:
        try:
            return DeltaManifest.from_json(store.get(key, max_bytes=MAX_MANIFEST_BYTES), name=f"{store.uri}/{key}")
        except Exception:  # noqa: BLE001 - unreadable: judged by its version alone
            return None

    def _delete_leftover(self, store: Store, prefix: str, keys: list[str], why: str) -> str | None:
        first = [k for k in keys if k.endswith("/" + MANIFEST_FILE)]  # uncommit first, as for registered objects
        for key in first + sorted(set(keys) - set(first)):
            try:
                store.delete(key)
            except ObjectNotFound:
                pass
            except Exception as exc:  # noqa: BLE001 - left where it is, reported
                return f"leftover {prefix} not deleted: {type(exc).__name__}: {exc}"
        logger.warning("gc: deleted the unregistered %s (%d files): %s", prefix, len(keys), why)
        return None

    def _delete(self, store: Store, obj: VersionPublic) -> str | None:
        prefix = object_prefix(obj.version, obj.kind, obj.base_version if obj.kind == "squash" else None)

        def own(k: str) -> bool:  # a delta's prefix holds the anchor's and the squashes' too: never theirs
            return obj.kind != "delta" or not (k.startswith(prefix + "anchor/") or parse_squash_key(k) is not None)

        try:
            keys = [k for k in store.list(prefix) if own(k)]
        except Exception as exc:  # noqa: BLE001 - a store we cannot list deletes nothing; reported, never a 500
            return f"{obj.kind} v{obj.version} not deleted: {type(exc).__name__}: {exc}"
        ordered = sorted(keys, key=lambda k: k != obj.manifest_key)  # the manifest first: uncommit, then delete
        done = []
        for key in ordered:
            try:
                store.delete(key)
                done.append(key)
            except ObjectNotFound:  # already gone (an earlier GC was interrupted): nothing to do
                logger.warning("gc: %s was already deleted", key)
            except Exception as exc:  # noqa: BLE001 - a symlink or another stranger: left where it is, reported
                logger.warning("gc: %s", exc)
                self._mark_deleted(obj, done, reason="gc (partial)")
                return f"{obj.kind} v{obj.version}: {exc}"
        self._mark_deleted(obj, done, reason="gc")
        logger.info("gc: deleted %s v%d (%d files)", obj.kind, obj.version, len(done))
        return None

    def _mark_deleted(self, obj: VersionPublic, keys: list[str], reason: str) -> None:
        now = self.db.clock()
        with self.db.tx() as c:
            if obj.kind == "squash":
                c.execute(
                    "UPDATE squashes SET deleted_at=? WHERE version=? AND base_version=?",
                    (now, obj.version, obj.base_version),
                )
            else:
                c.execute("UPDATE versions SET deleted_at=? WHERE version=? AND kind=?", (now, obj.version, obj.kind))
            c.execute(
                "INSERT INTO deletions (version, kind, keys, reason, deleted_at) VALUES (?, ?, ?, ?, ?)",
                (obj.version, obj.kind, json.dumps(keys), reason, now),
            )
            latest = c.execute("SELECT MAX(version) FROM versions WHERE deleted_at IS NULL").fetchone()[0]
            self.registry._latest = latest
            self.db.notify_versions(c, latest, exact=True)

    def deletions(self) -> list[dict[str, object]]:
        with self.db.read() as c:
            rows = c.execute("SELECT * FROM deletions ORDER BY id").fetchall()
        return [dict(r) | {"keys": json.loads(r["keys"])} for r in rows]
