"""Real servers on 127.0.0.1 for the remote-I/O tests: an HTTP server that answers range
requests (with byte counting and injected faults) and moto's S3-compatible server."""

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
