"""The output folder of ``maxdiff generate``: created and checked writable, locked while a run
writes to it, each image written atomically with one fsynced ``metadata.jsonl`` line, and
what is done read back for resuming.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipelines.cli.jobs import ImageJob
from pipelines.cli.lines import InputError
from pipelines.image_files import encode_image

METADATA = "metadata.jsonl"


TMP_MARK = ".maxdiff-tmp"


LOCK = ".maxdiff.lock"  # held (flock) by the run writing to the folder


class OutputDir:
    """The output folder: image files plus ``metadata.jsonl`` (one JSON object per image, in the
    order written). Files appear atomically (temp file, fsync, rename) and a metadata line is
    appended and fsynced only after its image is in place, so a killed run loses at most the
    batch in flight and a rerun trusts every complete metadata line whose file exists."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.metadata = self.path / METADATA
        self.temp_files: set[Path] = set()

    def prepare(self) -> None:
        """Create the folder, prove it is writable, lock it against a second run (the lock goes
        with the process), and remove temp files a killed run left."""
        where = f"output folder {self.path}"
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise InputError([f"{where}: a file of that name exists; choose another --out"]
                             ) from None
        except NotADirectoryError:
            raise InputError([f"{where}: a part of that path is a file, not a folder; "
                              "choose another --out"]) from None
        except OSError as e:
            raise InputError([f"{where}: cannot create it ({e.strerror or e}); "
                              "choose another --out"]) from None
        probe = self.path / f"{TMP_MARK}-probe-{os.getpid()}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise InputError([f"{where}: not writable ({e.strerror or e}); choose another --out"]
                             ) from None
        import fcntl

        self._lock = open(self.path / LOCK, "a")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise InputError([f"{where}: another maxdiff run is writing there; wait for it or "
                              "choose another --out"]) from None
        for stale in self.path.glob(f"*{TMP_MARK}*"):  # ours alone now: left by a killed run
            stale.unlink(missing_ok=True)

    def records(self) -> list[dict]:
        """The complete metadata lines. A last line cut short by a kill is dropped from the file
        (so the next append starts on a fresh line); a damaged line elsewhere is skipped."""
        try:
            data = self.metadata.read_bytes()
        except FileNotFoundError:
            return []
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            print(f"maxdiff: {self.metadata}: dropping an incomplete last line (a run was killed "
                  "while writing it)", file=sys.stderr)
            os.truncate(self.metadata, keep)
            data = data[:keep]
        out = []
        for no, raw in enumerate(data.splitlines(), 1):
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                rec = None
            if isinstance(rec, dict) and isinstance(rec.get("id"), str) and isinstance(
                    rec.get("file"), str):
                out.append(rec)
            elif raw.strip():
                print(f"maxdiff: {self.metadata}:{no}: skipping an unreadable line",
                      file=sys.stderr)
        return out

    def done(self, records: list[dict] | None = None) -> set[str]:
        """Ids of the jobs already finished: a metadata record whose file exists."""
        records = self.records() if records is None else records
        return {r["id"] for r in records if (self.path / Path(r["file"]).name).is_file()}

    def write(self, job: ImageJob, image, **extra: Any) -> dict:
        """Write one image atomically, then append and fsync its metadata line."""
        data = encode_image(image, job.settings.format, job.image_info())
        final = self.path / job.file
        tmp = self.path / f".{job.file}{TMP_MARK}-{os.getpid()}"
        self.temp_files.add(tmp)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
            self.temp_files.discard(tmp)
        _fsync_dir(self.path)
        rec = job.record(time=datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra)
        with open(self.metadata, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return rec

    def remove_temp_files(self) -> None:
        for tmp in list(self.temp_files):
            tmp.unlink(missing_ok=True)
        self.temp_files.clear()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
