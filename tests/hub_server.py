"""A small Hugging Face Hub stand-in on 127.0.0.1 for the tests: the HTTP calls huggingface_hub's
client makes to create a repo, commit files (small ones inline, large and binary ones through
the git-LFS batch API, as the client uploads them with Xet disabled) and download them.

It answers what the client reads and nothing more; any request it does not know is recorded in
`unhandled` and answered 404, so a test can assert that the client asked for nothing else.
"""
from __future__ import annotations

import base64
import hashlib
import json
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
LFS_MIN_SIZE = 10 * 1024 * 1024


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes] = field(default_factory=dict)
    lfs: set[str] = field(default_factory=set)  # paths stored through LFS
    commits: list[str] = field(default_factory=list)  # newest last
    private: bool = False
    branches: set[str] = field(default_factory=lambda: {"main"})
    commit_revisions: list[str] = field(default_factory=list)  # the revision each commit was made to
    pull_requests: list[str] = field(default_factory=list)  # commits made with create_pr

    @property
    def head(self) -> str:
        return self.commits[-1]

    def oid(self, path: str) -> str:
        data = self.files[path]
        return hashlib.sha256(data).hexdigest() if path in self.lfs else git_blob_sha1(data)


class HubServer:
    def __init__(self, user: str = "user", token: str = "hf_local_test_token"):
        self.user = user
        self.token = token  # the one token whoami accepts
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}  # sha256 -> content, uploaded but maybe not committed
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.non_local_clients: list[str] = []
        self.lock = threading.Lock()
        handler = type("Handler", (_Handler,), {"hub": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="hub-server", daemon=True)

    def start(self) -> "HubServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # quiet
        pass

    # ------------------------------------------------------------------ plumbing
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj, headers: dict | None = None, content_type="application/json"):
        self._send(status, json.dumps(obj).encode(), headers, content_type)

    def _error(self, status: int, code: str, message: str):
        self._json(status, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})

    def _dispatch(self):
        hub = self.hub
        if self.client_address[0] != "127.0.0.1":
            hub.non_local_clients.append(self.client_address[0])
        path = urlsplit(self.path).path
        hub.requests.append((self.command, path))
        with hub.lock:
            for method, prefix, fn in _ROUTES:
                if self.command in method and path.startswith(prefix):
                    if fn(self, path) is not False:
                        return
            if self.command in ("GET", "HEAD") and "/resolve/" in path:
                return self._resolve(path)
            hub.unhandled.append((self.command, path))
            self._error(404, "NotFound", f"the test hub does not serve {self.command} {path}")

    do_GET = do_HEAD = do_POST = do_PUT = _dispatch

    def _repo(self, repo_id: str) -> Repo | None:
        return self.hub.repos.get(repo_id)

    # ------------------------------------------------------------------ repos
    def _create_repo(self, path):
        data = json.loads(self._body() or b"{}")
        if data.get("type", "model") != "model":
            return self._error(400, "BadRequest", "the test hub holds model repos only")
        repo_id = f"{data.get('organization') or self.hub.user}/{data['name']}"
        if repo_id in self.hub.repos:
            return self._json(409, {"error": "You already created this model repo", "url": f"{self.hub.url}/{repo_id}"})
        repo = Repo(private=data.get("visibility") == "private" or data.get("private") is True)
        repo.files[".gitattributes"] = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
        repo.commits.append(secrets.token_hex(20))
        self.hub.repos[repo_id] = repo
        self._json(200, {"url": f"{self.hub.url}/{repo_id}", "name": repo_id, "id": secrets.token_hex(12)})

    def _validate_yaml(self, path):
        content = json.loads(self._body())["content"]
        if content.startswith("---"):
            try:
                front = content.split("---", 2)[1]
                data = yaml.safe_load(front)
                if data is not None and not isinstance(data, dict):
                    raise ValueError("front matter is not a mapping")
            except Exception as e:
                return self._json(400, {"errors": [{"message": f"invalid YAML: {e}"}]}, {"X-Error-Code": "BadRequest"})
        self._json(200, {"errors": [], "warnings": []})

    def _api_models(self, path):
        # /api/models/{owner}/{name}/{preupload|commit|revision}/{rev} or /api/models/{owner}/{name}
        parts = path[len("/api/models/"):].split("/")
        repo_id = "/".join(parts[:2])
        action, rev = (parts[2], unquote("/".join(parts[3:]))) if len(parts) > 2 else (None, "main")
        repo = self._repo(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", f"Repository Not Found for url: {path}")
        if action == "preupload" and self.command == "POST":
            return self._preupload(repo, json.loads(self._body()))
        if action == "commit" and self.command == "POST":
            return self._commit(repo_id, repo, self._body(), rev)
        if action == "branch" and self.command == "POST":
            self._body()
            repo.branches.add(rev)
            return self._json(200, {})
        if action == "tree" and self.command == "GET":
            rev, _, folder = rev.partition("/")
            return self._tree(repo, rev, unquote(folder))
        if action in (None, "revision") and self.command == "GET":
            if rev not in (*repo.branches, *repo.commits):
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return self._json(200, {
                "id": repo_id, "modelId": repo_id, "sha": repo.head, "private": False,
                "siblings": [{"rfilename": p} for p in sorted(repo.files)],
            })
        return False

    def _tree(self, repo: Repo, rev: str, folder: str):
        if rev not in (*repo.branches, *repo.commits):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        recursive = "recursive=true" in urlsplit(self.path).query.lower()
        prefix = folder.rstrip("/") + "/" if folder else ""
        entries, folders = [], set()
        for p in sorted(repo.files):
            if not p.startswith(prefix):
                continue
            rest = p[len(prefix):]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/")[0])
                continue
            data = repo.files[p]
            entry = {"type": "file", "path": p, "size": len(data), "oid": git_blob_sha1(data)}
            if p in repo.lfs:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        entries += [{"type": "directory", "path": f, "oid": git_blob_sha1(f.encode())} for f in sorted(folders)]
        self._json(200, entries)

    def _preupload(self, repo: Repo, data):
        files = []
        for f in data["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] >= LFS_MIN_SIZE or b"\0" in sample
            oid = repo.oid(f["path"]) if f["path"] in repo.files else None
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid})
        self._json(200, {"files": files, "commitOid": repo.head})

    def _commit(self, repo_id: str, repo: Repo, body: bytes, rev: str = "main"):
        create_pr = "create_pr=1" in urlsplit(self.path).query
        if rev not in repo.branches and not create_pr:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            return self._error(400, "BadRequest", "a commit starts with a header line")
        changes: dict[str, tuple[bytes, bool] | None] = {}
        for item in lines[1:]:
            key, value = item["key"], item["value"]
            if key == "file":
                if value.get("encoding") != "base64":
                    return self._error(400, "BadRequest", "inline files must be base64")
                changes[value["path"]] = (base64.b64decode(value["content"]), False)
            elif key == "lfsFile":
                data = self.hub.lfs_objects.get(value["oid"])
                if data is None or len(data) != value.get("size", len(data)):
                    return self._error(400, "BadRequest", f"LFS object {value['oid']} of {value['path']} was not uploaded")
                changes[value["path"]] = (data, True)
            elif key == "deletedFile":
                changes[value["path"]] = None
            else:
                return self._error(400, "BadRequest", f"the test hub does not take {key!r} commit lines")
        for p, change in changes.items():
            if change is None:
                repo.files.pop(p, None)
                repo.lfs.discard(p)
            else:
                repo.files[p] = change[0]
                (repo.lfs.add if change[1] else repo.lfs.discard)(p)
        repo.commits.append(secrets.token_hex(20))
        repo.commit_revisions.append(rev)
        pr = None
        if create_pr:
            repo.pull_requests.append(repo.head)
            pr = f"{self.hub.url}/{repo_id}/discussions/{len(repo.pull_requests)}"
        self._json(200, {"commitUrl": f"{self.hub.url}/{repo_id}/commit/{repo.head}", "commitOid": repo.head,
                         "success": True, "pullRequestUrl": pr})

    # ------------------------------------------------------------------ LFS
    def _lfs_batch(self, path):
        repo_id = path[1:].removesuffix(".git/info/lfs/objects/batch")
        if self._repo(repo_id) is None:
            return self._error(404, "RepoNotFound", f"Repository Not Found: {repo_id}")
        data = json.loads(self._body())
        if data.get("operation") != "upload" or "basic" not in data.get("transfers", ["basic"]):
            return self._error(400, "BadRequest", "the test hub takes basic LFS uploads only")
        objects = []
        for o in data["objects"]:
            entry = {"oid": o["oid"], "size": o["size"], "authenticated": True}
            if o["oid"] not in self.hub.lfs_objects:
                entry["actions"] = {
                    "upload": {"href": f"{self.hub.url}/__lfs/{o['oid']}", "header": {}},
                    "verify": {"href": f"{self.hub.url}/__lfs/verify", "header": {}},
                }
            objects.append(entry)
        self._json(200, {"transfer": "basic", "objects": objects}, content_type="application/vnd.git-lfs+json")

    def _lfs_put(self, path):
        oid = path.rsplit("/", 1)[1]
        data = self._body()
        if hashlib.sha256(data).hexdigest() != oid:
            return self._error(400, "BadRequest", "content does not match its sha256")
        self.hub.lfs_objects[oid] = data
        self._send(200)

    def _lfs_verify(self, path):
        data = json.loads(self._body())
        if len(self.hub.lfs_objects.get(data["oid"], b"")) != data["size"] or data["oid"] not in self.hub.lfs_objects:
            return self._error(404, "NotFound", "object not uploaded")
        self._json(200, {"success": True})

    # ------------------------------------------------------------------ downloads
    def _resolve(self, path):
        head, _, rest = path[1:].partition("/resolve/")
        repo = self._repo(head)
        if repo is None:
            return self._error(404, "RepoNotFound", f"Repository Not Found: {head}")
        rev, _, filename = rest.partition("/")
        rev, filename = unquote(rev), unquote(filename)
        if rev not in (*repo.branches, *repo.commits):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        data = repo.files.get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", f"Entry not found: {filename}")
        headers = {"X-Repo-Commit": repo.head, "ETag": f'"{git_blob_sha1(data)}"', "Accept-Ranges": "bytes"}
        if filename in repo.lfs:
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(data))
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and self.command == "GET":
            start = int(rng[6:].split("-")[0] or 0)
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            return self._send(206, data[start:], headers, "application/octet-stream")
        self._send(200, data, headers, "application/octet-stream")


def _whoami(handler: _Handler, path):
    if handler.headers.get("Authorization") != f"Bearer {handler.hub.token}":
        return handler._error(401, "Unauthorized", "Invalid credentials in Authorization header")
    handler._json(200, {"type": "user", "name": handler.hub.user, "auth": {"type": "access_token"}})


_ROUTES = [
    (("GET",), "/api/whoami-v2", _whoami),
    (("POST",), "/api/repos/create", _Handler._create_repo),
    (("POST",), "/api/validate-yaml", _Handler._validate_yaml),
    (("GET", "POST"), "/api/models/", _Handler._api_models),
    (("PUT",), "/__lfs/", _Handler._lfs_put),
    (("POST",), "/__lfs/verify", _Handler._lfs_verify),
]
# LFS batch: POST /{owner}/{name}.git/info/lfs/objects/batch
_ROUTES.append((("POST",), "/", lambda h, p: h._lfs_batch(p) if p.endswith(".git/info/lfs/objects/batch") else False))
