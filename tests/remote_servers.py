"""Real servers on 127.0.0.1 for the remote-I/O tests: an HTTP server that answers range
requests (with byte counting and injected faults), moto's S3-compatible server, and a server for
the subset of Google Cloud Storage's JSON API that olmax's ``gs://`` client uses."""

from __future__ import annotations

import os
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class RangeServer:
    """Serves files under ``root`` with HEAD and single-range GET (``Range: bytes=a-b``).

    ``served[path]`` counts body bytes sent; ``requests`` lists ``(method, path, range)``;
    ``faults[path]`` is a list of statuses to answer first (e.g. ``[503]`` fails once);
    ``deny`` holds paths answered with 403.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.served: Counter[str] = Counter()
        self.requests: list[tuple[str, str, str | None]] = []
        self.faults: dict[str, list[int]] = {}
        self.deny: set[str] = set()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _file(self):
                path = self.path.split("?", 1)[0]
                with server._lock:
                    server.requests.append((self.command, path, self.headers.get("Range")))
                    queued = server.faults.get(path)
                    status = queued.pop(0) if queued else None
                if status is None and path in server.deny:
                    status = 403
                if status is not None:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                f = server.root / path.lstrip("/")
                if not f.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                return path, f.read_bytes()

            def do_HEAD(self):
                got = self._file()
                if got:
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(got[1])))
                    self.send_header("Accept-Ranges", "bytes")
                    self.end_headers()

            def do_GET(self):
                got = self._file()
                if not got:
                    return
                path, data = got
                rng = self.headers.get("Range")
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
                if m:
                    a = int(m.group(1))
                    b = min(int(m.group(2)) + 1 if m.group(2) else len(data), len(data))
                    body = data[a:b]
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {a}-{b - 1}/{len(data)}")
                else:
                    body = data
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Accept-Ranges", "bytes")
                with server._lock:  # counted before sending: the client may look as soon as it has the bytes
                    server.served[path] += len(body)
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> RangeServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)


class S3Server:
    """moto's S3-compatible server on a free loopback port, with the AWS_* variables set for it."""

    BUCKET = "olmax-test"

    def __init__(self):
        import portpicker
        from moto.server import ThreadedMotoServer
        self.port = portpicker.pick_unused_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
        self._old: dict[str, str | None] = {}

    def __enter__(self) -> S3Server:
        self.server.start()
        for k, v in self.env.items():
            self._old[k] = os.environ.get(k)
            os.environ[k] = v
        self.client().create_bucket(Bucket=self.BUCKET)
        return self

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def upload(self, local: str | os.PathLike, key: str) -> str:
        self.client().upload_file(str(local), self.BUCKET, key)
        return f"s3://{self.BUCKET}/{key}"

    def keys(self, prefix: str = "") -> list[str]:
        out = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=self.BUCKET, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return out

    def __exit__(self, *exc) -> None:
        for k, v in self._old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        self.server.stop()


class GcsServer:
    """The part of Google Cloud Storage's JSON API that ``google-cloud-storage`` uses for olmax's
    ``gs://`` (object metadata, ranged media downloads, listing with prefix/delimiter, multipart and
    resumable uploads, deletes), in memory on a free loopback port; sets ``OLMAX_GCS_ENDPOINT``.

    No emulator from PyPI is used: ``gcp-storage-emulator`` answers ranged reads, but these tests
    also need byte counts and injected faults on the server side, as ``RangeServer`` has.
    ``served[name]`` counts media bytes sent; ``requests`` lists ``(method, kind, name, range)``;
    ``faults[name]`` is a list of statuses to answer first for any request on that object;
    ``deny`` holds object names answered with 403. ``hold_writes(prefix, after)`` lets ``after``
    uploads under ``prefix`` through, then parks the next one (``held`` is set) until ``release``
    is set, and answers it 503 without storing it: a client killed mid-upload.
    """

    BUCKET = "olmax-test"

    def __init__(self):
        import base64
        import hashlib
        import json
        from urllib.parse import parse_qs, quote, unquote, urlsplit

        import google_crc32c

        self.objects: dict[tuple[str, str], tuple[bytes, int]] = {}  # (bucket, name) -> (data, generation)
        self.buckets = {self.BUCKET}
        self.served: Counter[str] = Counter()
        self.requests: list[tuple[str, str, str, str | None]] = []
        self.faults: dict[str, list[int]] = {}
        self.deny: set[str] = set()
        self.held, self.release = threading.Event(), threading.Event()
        self._hold: tuple[str, int] | None = None
        self._uploads: dict[str, dict] = {}
        self._generation = 0
        self._lock = threading.Lock()
        server = self

        def b64(raw: bytes) -> str:
            return base64.b64encode(raw).decode()

        def resource(bucket: str, name: str) -> dict:
            data, gen = server.objects[(bucket, name)]
            return {"kind": "storage#object", "id": f"{bucket}/{name}/{gen}", "name": name, "bucket": bucket,
                    "generation": str(gen), "metageneration": "1", "contentType": "application/octet-stream",
                    "size": str(len(data)), "md5Hash": b64(hashlib.md5(data).digest()),
                    "crc32c": b64(google_crc32c.value(data).to_bytes(4, "big")), "storageClass": "STANDARD",
                    "timeCreated": "2026-01-01T00:00:00.000Z", "updated": "2026-01-01T00:00:00.000Z",
                    "etag": f"g{gen}", "selfLink": f"{server.url}/storage/v1/b/{bucket}/o/{quote(name, safe='')}"}

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client's session expects
            disable_nagle_algorithm = True  # headers and body go out as separate writes

            def log_message(self, *a):  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        n = int(self.rfile.readline().split(b";")[0], 16)
                        chunk = self.rfile.read(n + 2)[:n]
                        if n == 0:
                            return out
                        out += chunk
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
                      ctype: str = "application/json; charset=UTF-8") -> None:
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                if body or status not in (204, 308):
                    self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _json(self, status: int, obj: dict) -> None:
                self._send(status, json.dumps(obj).encode())

            def _error(self, status: int, message: str) -> None:
                reason = {403: "forbidden", 404: "notFound", 416: "requestedRangeNotSatisfiable"}.get(
                    status, "backendError")
                self._json(status, {"error": {"code": status, "message": message,
                                              "errors": [{"message": message, "domain": "global", "reason": reason}]}})

            def _gate(self, name: str) -> bool:
                """Injected faults and refusals for object ``name``; True if answered."""
                with server._lock:
                    queued = server.faults.get(name)
                    status = queued.pop(0) if queued else None
                if status is None and name in server.deny:
                    status = 403
                if status is None:
                    return False
                self._error(status, {403: f"anonymous caller does not have storage.objects.get access to {name}"}
                            .get(status, "injected failure"))
                return True

            def _route(self) -> None:
                url = urlsplit(self.path)
                q = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
                body = self._body()
                parts = url.path.split("/")  # '', [download|upload,] storage, v1, b, BUCKET, o, NAME
                if len(parts) > 1 and parts[1] in ("download", "upload"):
                    api, parts = parts[1], parts[:1] + parts[2:]
                else:
                    api = "json"
                if parts[1:4] != ["storage", "v1", "b"] or len(parts) < 5:
                    return self._error(400, f"unsupported path {url.path}")
                bucket = unquote(parts[4])
                name = unquote("/".join(parts[6:])) if len(parts) > 6 and parts[5] == "o" else None
                kind = ("media" if api == "download" or q.get("alt") == "media" else
                        "upload" if api == "upload" else "list" if len(parts) == 6 else "bucket" if len(parts) == 5
                        else "object")
                with server._lock:
                    server.requests.append((self.command, kind, name or "", self.headers.get("Range")))
                if bucket not in server.buckets:
                    return self._error(404, "The specified bucket does not exist.")
                if kind == "upload":
                    return self._upload(bucket, q, body)
                if kind == "bucket":
                    return self._json(200, {"kind": "storage#bucket", "id": bucket, "name": bucket,
                                            "location": "US", "projectNumber": "0"})
                if kind == "list":
                    return self._list(bucket, q)
                if self._gate(name):
                    return None
                if (bucket, name) not in server.objects:
                    return self._error(404, f"No such object: {bucket}/{name}")
                if self.command == "DELETE":
                    with server._lock:
                        server.objects.pop((bucket, name), None)
                    return self._send(204)
                if kind == "object":
                    return self._json(200, resource(bucket, name))
                return self._media(bucket, name)

            def _media(self, bucket: str, name: str) -> None:
                data, gen = server.objects[(bucket, name)]
                headers = {"x-goog-generation": str(gen), "x-goog-stored-content-length": str(len(data)),
                           "Accept-Ranges": "bytes"}
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
                if m:
                    a = int(m.group(1))
                    b = min(int(m.group(2)) + 1 if m.group(2) else len(data), len(data))
                    if a >= len(data):
                        return self._error(416, "The requested range cannot be satisfied.")
                    body, status = data[a:b], 206
                    headers["Content-Range"] = f"bytes {a}-{b - 1}/{len(data)}"
                else:
                    body, status = data, 200
                    headers["x-goog-hash"] = (f"crc32c={b64(google_crc32c.value(data).to_bytes(4, 'big'))},"
                                              f"md5={b64(hashlib.md5(data).digest())}")
                with server._lock:  # counted before sending: the client may look as soon as it has the bytes
                    server.served[name] += len(body)
                self._send(status, body, headers, "application/octet-stream")

            def _list(self, bucket: str, q: dict) -> None:
                prefix, delim = q.get("prefix", ""), q.get("delimiter") or None
                entries: dict[str, str] = {}  # sort key -> "o" (object) / "p" (prefix)
                for (b, n) in server.objects:
                    if b != bucket or not n.startswith(prefix):
                        continue
                    cut = n.find(delim, len(prefix)) if delim else -1
                    entries[n[:cut + len(delim)] if cut >= 0 else n] = "p" if cut >= 0 else "o"
                keys = sorted(k for k in entries if k > q.get("pageToken", ""))
                page = keys[:int(q.get("maxResults") or 1000)]
                out: dict = {"kind": "storage#objects"}
                items = [resource(bucket, k) for k in page if entries[k] == "o"]
                prefixes = [k for k in page if entries[k] == "p"]
                if items:
                    out["items"] = items
                if prefixes:
                    out["prefixes"] = prefixes
                if len(keys) > len(page):
                    out["nextPageToken"] = page[-1]
                self._json(200, out)

            def _store(self, bucket: str, name: str, data: bytes) -> None:
                hold = server._hold
                if hold and name.startswith(hold[0]):
                    with server._lock:
                        server._hold = (hold[0], hold[1] - 1)
                    if hold[1] <= 0:
                        server.held.set()
                        server.release.wait(300)
                        return self._error(503, "held, then dropped (the client was killed)")
                if self._gate(name):
                    return None
                with server._lock:
                    server._generation += 1
                    server.objects[(bucket, name)] = (data, server._generation)
                self._json(200, resource(bucket, name))

            def _upload(self, bucket: str, q: dict, body: bytes) -> None:
                utype = q.get("uploadType")
                if self.command == "POST" and utype == "media":
                    return self._store(bucket, q["name"], body)
                if self.command == "POST" and utype == "multipart":
                    boundary = re.search(r'boundary="?([^";]+)"?', self.headers["Content-Type"]).group(1).encode()
                    parts = [p for p in body.split(b"--" + boundary) if p not in (b"", b"--", b"--\r\n")]
                    meta_part, data_part = (p.split(b"\r\n\r\n", 1)[1] for p in parts[:2])
                    meta = json.loads(meta_part.rstrip(b"\r\n"))
                    assert data_part.endswith(b"\r\n"), "multipart body without its closing CRLF"
                    return self._store(bucket, meta.get("name") or q["name"], data_part[:-2])
                if self.command == "POST" and utype == "resumable":
                    meta = json.loads(body or b"{}")
                    with server._lock:
                        server._generation += 1
                        uid = f"u{server._generation}"
                        server._uploads[uid] = {"name": meta.get("name") or q["name"], "data": b""}
                    loc = f"{server.url}/upload/storage/v1/b/{bucket}/o?uploadType=resumable&upload_id={uid}"
                    return self._send(200, b"", {"Location": loc})
                if self.command == "PUT" and q.get("upload_id") in server._uploads:
                    up = server._uploads[q["upload_id"]]
                    m = re.fullmatch(r"bytes (?:(\d+)-(\d+)|\*)/(\d+|\*)", self.headers.get("Content-Range", ""))
                    if not m:
                        return self._error(400, "bad Content-Range")
                    if m.group(1) is not None:
                        if int(m.group(1)) != len(up["data"]):
                            return self._error(400, "chunk does not continue the upload")
                        up["data"] += body
                    if m.group(3) != "*" and len(up["data"]) == int(m.group(3)):
                        del server._uploads[q["upload_id"]]
                        return self._store(bucket, up["name"], up["data"])
                    rng = {"Range": f"bytes=0-{len(up['data']) - 1}"} if up["data"] else {}
                    return self._send(308, b"", rng)
                return self._error(400, f"unsupported upload {self.command} {q}")

            def _answer(self) -> None:
                try:
                    self._route()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client went away (killed): nothing to answer

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _answer

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._old: str | None = None

    def hold_writes(self, prefix: str, after: int) -> None:
        self.held.clear()
        self.release.clear()
        self._hold = (prefix, after)

    def upload(self, local: str | os.PathLike, name: str) -> str:
        with self._lock:
            self._generation += 1
            self.objects[(self.BUCKET, name)] = (Path(local).read_bytes(), self._generation)
        return f"gs://{self.BUCKET}/{name}"

    def keys(self, prefix: str = "") -> list[str]:
        return sorted(n for b, n in self.objects if b == self.BUCKET and n.startswith(prefix))

    def __enter__(self) -> GcsServer:
        self._thread.start()
        self._old = os.environ.get("OLMAX_GCS_ENDPOINT")
        os.environ["OLMAX_GCS_ENDPOINT"] = self.url
        return self

    def __exit__(self, *exc) -> None:
        if self._old is None:
            os.environ.pop("OLMAX_GCS_ENDPOINT", None)
        else:
            os.environ["OLMAX_GCS_ENDPOINT"] = self._old
        self._hold = None
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(5)
