"""The output store (serving.storage) on a local folder and on an S3-compatible server (moto,
started here), and the jobs database (serving.job_store.JobStore): links serve the stored bytes
until they expire; a writer killed mid-write leaves nothing that is served or linked; the
sweep removes expired and unfinished objects; jobs of a stopped owner end failed with the
reason, their webhooks are taken over once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import requests

from serving.job_store import OWNER_TIMEOUT_S, JobStore
from serving.jobs import key_secret, sign, webhook_problem
from serving.storage import OutputStore

ROOT = Path(__file__).resolve().parents[1]
BLOB = b"\x89PNG\r\n\x1a\n" + os.urandom(1000)


def test_a_local_store_serves_until_expiry(tmp_path):
    store = OutputStore(str(tmp_path / "out"), ttl_s=60)
    one = store.put(BLOB, "png", {"seed": 7})
    assert store.read(one.name) == (BLOB, "image/png")
    assert store.link(one, "http://host:8000/app") == f"http://host:8000/app/v1/files/{one.name}"
    assert store.read(one.name, now=one.expires_at + 1) is None
    assert store.read(one.name.replace(".png", ".webp")) is None  # the name must match
    assert store.read("../" + one.name) is None
    other = store.put(BLOB, "webp")
    assert store.sweep(now=time.time() + 30) == 0  # nothing expired yet
    assert store.sweep(now=one.expires_at + 1) == 4  # both images and their metadata
    assert sorted(os.listdir(tmp_path / "out")) == []
    assert store.read(other.name) is None
    forever = OutputStore(str(tmp_path / "out"), ttl_s=None).put(BLOB, "jpeg")
    assert forever.expires_at is None and store.sweep(now=time.time() + 10**9) == 0


def test_a_writer_killed_mid_write_leaves_nothing_served(tmp_path):
    """A process killed while it writes a large image: no object under the image's name, nothing
    served; the sweep removes the piece once it is old."""
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from serving.storage import OutputStore
        store = OutputStore({str(out)!r})
        print("writing", flush=True)
        store.put(b"x" * (3 * 2**29), "png")
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"writing"
    deadline = time.monotonic() + 60
    while not any(p.name.endswith(".partial") and p.stat().st_size > 2**20
                  for p in out.iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    names = os.listdir(out)
    assert len(names) == 1 and names[0].endswith(".partial"), names
    store = OutputStore(str(out))
    assert store.sweep() == 0  # young: maybe another writer's
    assert store.sweep(now=time.time() + 7200) == 1 and os.listdir(out) == []


def test_an_image_without_its_metadata_is_never_served(tmp_path):
    store = OutputStore(str(tmp_path))
    one = store.put(BLOB, "png")
    (tmp_path / one.name.replace(".png", ".json")).unlink()  # as if the writer died between
    assert store.read(one.name) is None
    assert store.sweep(now=time.time() + 7200) == 1 and os.listdir(tmp_path) == []


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """An S3-compatible server (moto) on a free port with a bucket; its endpoint."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    import boto3

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="images")
    yield endpoint
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_an_s3_store_answers_presigned_links(s3):
    options = {"endpoint_url": s3}
    store = OutputStore("s3://images/maxdiff", ttl_s=600, options=options)
    one = store.put(BLOB, "png", {"seed": 1})
    link = store.link(one, "http://unused")
    assert link.startswith(f"{s3}/images/maxdiff/{one.name}?") and "Signature" in link, link
    r = requests.get(link, timeout=30)
    assert r.status_code == 200 and r.content == BLOB
    assert store.read(one.name) == (BLOB, "image/png")
    unsigned = OutputStore("s3://images/maxdiff", ttl_s=600, sign=False, options=options)
    assert unsigned.link(one, "http://host") == f"http://host/v1/files/{one.name}"
    assert store.sweep(now=one.expires_at + 1) == 2
    assert store.read(one.name) is None and store.fs.find("images/maxdiff") == []


def test_jobs_of_a_stopped_owner_fail_with_the_reason(tmp_path):
    db = JobStore(str(tmp_path / "jobs.sqlite"))
    db.beat("alive")
    a = db.create(app="x", key_id=None, owner="alive", endpoint="/v1/generate",
                  request_id="r1", webhook=None, metadata=None)
    b = db.create(app="x", key_id="key_1", owner="gone", endpoint="/v1/generate",
                  request_id="r2", webhook="http://h/hook", metadata={"k": "v"})
    assert db.reap() == 1  # "gone" never beat
    assert db.get(b["id"])["status"] == "failed"
    assert '"job_interrupted"' in db.get(b["id"])["error"]
    assert db.get(a["id"])["status"] == "queued"
    assert db.get(b["id"], app="x", key_id=None, check_key=True) is None  # another key's
    assert db.get(b["id"], app="y") is None  # another application's
    # its pending webhook goes to one live owner, once
    assert db.orphaned_webhooks("alive") == [b["id"]]
    assert db.orphaned_webhooks("alive") == []
    # an owner silent past the timeout is stopped too; leaving fails its jobs at once
    assert db.reap(now=time.time() + OWNER_TIMEOUT_S + 1) == 1
    c = db.create(app="x", key_id=None, owner="alive", endpoint="/v1/edit", request_id=None,
                  webhook=None, metadata=None)
    db.beat("alive")
    assert db.start(c["id"]) and not db.start(c["id"])
    assert db.leave("alive") == 1 and db.get(c["id"])["status"] == "failed"
    assert not db.cancel(c["id"])  # ended: nothing to cancel
    assert db.active("x", None) == 0
    # a second connection (another ingress process) sees the same rows
    assert JobStore(db.path).get(c["id"])["status"] == "failed"


def test_webhook_signatures_and_urls():
    from standardwebhooks.webhooks import Webhook

    secret = key_secret(b"s" * 32, "key_abc")
    assert secret != key_secret(b"s" * 32, "key_abd") != key_secret(b"t" * 32, "key_abc")
    body, ts = b'{"id": "job_1"}', int(time.time())
    headers = {"webhook-id": "job_1", "webhook-timestamp": str(ts),
               "webhook-signature": sign(secret, "job_1", ts, body)}
    assert Webhook(secret).verify(body, headers) == {"id": "job_1"}
    for bad in ("ftp://h/x", "http://", "/relative", 5, "javascript:alert(1)"):
        assert webhook_problem(bad) is not None, bad
    assert webhook_problem("https://hooks.example.com/x?y=1") is None
