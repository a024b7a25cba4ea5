"""`LoRAAdapterPusher` against a fake of vLLM 0.32's runtime LoRA routes (the real server is exercised in
tests/integration/test_lora.py): names per version, bounded adapters, the base weights once per setup, errors."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from async_grpo.transports.weights.lora import LoRAAdapterPusher, LoRASyncError, adapter_name
from async_grpo.transports.weights.push import PushReport


class FakeVLLM:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter with vLLM's answers (or 404 for both: routes off)."""

    def __init__(self, routes: bool = True):
        self.adapters: dict[str, str] = {}
        self.calls: list[tuple[str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.calls.append((self.path, body))
                code, text = fake.answer(self.path, body) if routes else (404, '{"detail":"Not Found"}')
                self.send_response(code)
                self.end_headers()
                self.wfile.write(text.encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, path: str, body: dict) -> tuple[int, str]:
        name = body["lora_name"]
        if path == "/v1/load_lora_adapter":
            if name in self.adapters and not body["load_inplace"]:
                return 400, f"The lora adapter '{name}' has already been loaded."
            if not (Path(body["lora_path"]) / "adapter_model.safetensors").is_file():
                return 404, '{"error": {"message": "Loading lora failed: No adapter found", "code": 404}}'
            self.adapters[name] = body["lora_path"]
            return 200, "Success"
        if name not in self.adapters:
            return 404, f"The lora adapter '{name}' cannot be found."
        del self.adapters[name]
        return 200, "Success"


class FakeBasePusher:
    def __init__(self):
        self.setups, self.pushes, self.last_report = 0, [], PushReport(wire_bytes=1000)

    def setup(self):
        self.setups += 1

    def push(self, version):
        self.pushes.append(version)
        return 0.0

    def close(self):
        pass


def _save(path: Path) -> int:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(b"x" * 100)
    return 102


@pytest.fixture
def fake():
    server = FakeVLLM()
    yield server
    server.server.shutdown()


def test_each_push_loads_its_version_and_keeps_only_the_previous_one(fake, tmp_path):
    base = FakeBasePusher()
    pusher = LoRAAdapterPusher(_save, fake.url, tmp_path / "lora", base_pusher=base)
    pusher.setup()
    pusher.push(0)
    assert (
        base.pushes == [0] and pusher.last_report.wire_bytes == 1000 + 102
    )  # base weights once, with the first adapter
    for version in (1, 2, 3):
        assert pusher.push(version) >= 0
    assert base.pushes == [0] and pusher.last_report.wire_bytes == 102  # adapter files only
    assert sorted(fake.adapters) == [adapter_name(2), adapter_name(3)]
    folders = sorted(p.name for p in (tmp_path / "lora").iterdir())
    assert folders == ["policy-v1-2", "policy-v2-3", "policy-v3-4"]  # v0's deleted; v1's one push after unloading
    pusher.setup()  # a restarted server: the base goes again
    pusher.push(3)  # same version again: in place
    assert base.pushes == [0, 3] and fake.calls[-1][1]["load_inplace"] is True


def test_an_adapter_name_a_previous_trainer_loaded_is_reloaded_in_place(fake, tmp_path):
    fake.adapters[adapter_name(5)] = "/old"
    pusher = LoRAAdapterPusher(_save, fake.url, tmp_path)
    pusher.setup()
    pusher.push(5)
    assert fake.adapters[adapter_name(5)] == str(tmp_path.resolve() / "policy-v5-1")


def test_a_server_without_runtime_lora_names_the_flags(tmp_path):
    server = FakeVLLM(routes=False)
    try:
        pusher = LoRAAdapterPusher(_save, server.url, tmp_path)
        pusher.setup()
        with pytest.raises(LoRASyncError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            pusher.push(1)
    finally:
        server.server.shutdown()


def test_a_refused_adapter_names_the_folder_and_the_fix(fake, tmp_path):
    pusher = LoRAAdapterPusher(lambda path: 0, fake.url, tmp_path)  # writes nothing: the server cannot read it
    pusher.setup()
    with pytest.raises(LoRASyncError, match="policy-v1.*same path"):
        pusher.push(1)
