"""docs/your-model.md, walked as a new user walks it: a GGUF from outside the project (here a tiny
synthetic llama quantized to Q4_K by llama.cpp's own quantizer, with no chat template) through inspect,
recipe, build, verify, parity, certify, deploy, up, generate, serve with the official `openai` client,
status and down. Every step is the real CLI in its own process, as the page shows it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import gguf
import openai
import pytest

from dgr.runtime.engine import quantize

from support.deploy import private_engine
from support.engine import b3, synth_model

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture(scope="module")
def walk(tmp_path_factory, engine_lib):
    root = tmp_path_factory.mktemp("your-model")
    env = {**os.environ, **private_engine(engine_lib, root / "engine"), "DGR_WORKSPACE": str(root / "workspace")}

    def dgr(*args: str, cwd: Path = root, timeout: float = 300, ok: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run([sys.executable, "-m", "dgr.cli.main", *args], cwd=cwd, env=env, capture_output=True,
                           text=True, timeout=timeout)
        if ok:
            assert p.returncode == 0, f"dgr {' '.join(args)}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p

    # "The model you have": K-quant weights (a width of 256: whole Q4_K blocks) and no chat template.
    f32 = synth_model(root / "src", "llama", layers=6, embd=256)
    (root / "downloads").mkdir()
    model = quantize(f32, root / "downloads" / "base-model-Q4_K.gguf", "Q4_K", lib=env["DGR_ENGINE_LIB"])
    return {"root": root, "model": model, "env": env, "dgr": dgr}


def test_a_model_from_outside_walks_from_inspect_to_the_openai_client(walk):
    root, model, dgr = walk["root"], walk["model"], walk["dgr"]
    reader = gguf.GGUFReader(model)
    assert gguf.Keys.Tokenizer.CHAT_TEMPLATE not in reader.fields
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q4_K"}

    # 1. inspect: what the model is, its template (none) and where generation ends
    out = dgr("inspect", str(model)).stdout
    assert "chat template:   none" in out, out
    info = json.loads(dgr("inspect", str(model), "--json").stdout)
    eos = reader.fields[gguf.Keys.Tokenizer.EOS_ID].parts[-1][0]
    assert info["chat_template"]["present"] is False
    assert int(eos) in [t["id"] for t in info["special_tokens"]["eog"]], info["special_tokens"]

    # 2. a recipe scaffolded from the model: 3 stages, the example quantization rules switched on
    dgr("recipe", "new", "--from-model", str(model), "--name", "my-model", "--stages", "3", "-o", "recipes")
    recipe = root / "recipes" / "my-model" / "recipe.toml"
    text = recipe.read_text()
    assert "\n# rules = [" in text
    recipe.write_text(text.replace("\n# rules = [", "\nrules = ["))
    plan = dgr("recipe", "plan", str(recipe)).stdout
    assert "3 stages" in plan and "llama.cpp never quantizes" in plan, plan

    # 3. build, verify by the id's 12 digits a listing shows
    built = dgr("recipe", "build", str(recipe), "--store", str(root / "store")).stdout
    bundle_id = re.search(r"^bundle ([0-9a-f]{64})$", built, re.M).group(1)
    bundle = root / "store" / f"my-model-{bundle_id[:12]}"
    assert bundle.is_dir(), built
    dgr("bundle", "verify", str(bundle), "--expect-id", bundle_id[:12])

    # 4. parity (against the same recipe as one stage: the bundle is quantized) and certify
    parity = dgr("parity", str(bundle), "--threads", "1")
    assert "parity: EXACT" in parity.stdout and "the recipe built as one stage" in parity.stdout, parity.stdout
    cert = root / "cert.json"
    dgr("certify", "--bundle", str(bundle), "--out", str(cert), "--threads", "1", cwd=REPO)
    assert json.loads(cert.read_text())["passed"] is True

    # 5. a deployment of it on this machine: up, generate, status
    ports = _free_ports(4)
    deployment = root / "deploy" / "my-model.toml"
    deployment.parent.mkdir()
    deployment.write_text(f"""name = "my-model"
[bundle]
recipe = "../recipes/my-model"
[[hosts]]
name = "here"
address = "127.0.0.1"
store = "{root / 'store'}"
lane = "cpu"
capacity = {{ memory = "1GiB", workers = 3 }}
""" + "".join(f"""[[stages]]
layers = [{a}, {b}]
host = "here"
port = {port}
""" for (a, b), port in zip(((0, 2), (2, 4), (4, 6)), ports)) + """[worker]
threads = 1
""")
    route = ",".join(f"127.0.0.1:{p}" for p in ports[:3])
    run = root / "run"
    plan = dgr("deploy", "plan", str(deployment)).stdout
    assert f"route: {route}" in plan, plan
    try:
        up = dgr("up", str(deployment), "--run-dir", str(run))
        assert f"route: {route}" in up.stdout
        status = dgr("status", str(deployment), "--run-dir", str(run), "--json")
        assert json.loads(status.stdout)["state"] == "up", status.stdout
        gen = dgr("generate", "--route", route, "--max-tokens", "8", "--ignore-eos", "--stats", "Hello")
        assert gen.stdout.strip(), gen.stderr

        # 6. the gateway: completions at once; chat only with a template (this model has none)
        for template, chat_ok in ((None, False), (CHATML, True)):
            args = ["serve", "--route", route, "--listen", f"127.0.0.1:{ports[3]}"]
            if template:
                (root / "chatml.jinja").write_text(template)
                args += ["--chat-template", str(root / "chatml.jinja")]
            serve = subprocess.Popen([sys.executable, "-m", "dgr.cli.main", *args], cwd=root, env=walk["env"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                client = openai.OpenAI(base_url=f"http://127.0.0.1:{ports[3]}/v1", api_key="none", max_retries=0)
                deadline = time.monotonic() + 120
                while True:
                    try:
                        models = [m.id for m in client.models.list()]
                        break
                    except openai.APIConnectionError:
                        assert serve.poll() is None, serve.communicate()[1][-3000:]
                        assert time.monotonic() < deadline, "dgr serve did not answer"
                        time.sleep(0.2)
                assert models == ["my-model"]
                done = client.completions.create(model="my-model", prompt="Hello", max_tokens=8,
                                                 extra_body={"ignore_eos": True})
                assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
                if chat_ok:
                    chat = client.chat.completions.create(model="my-model", max_tokens=4,
                                                          messages=[{"role": "user", "content": "Hi"}])
                    assert chat.choices[0].finish_reason in ("stop", "length")
                else:
                    with pytest.raises(openai.BadRequestError, match="chat template"):
                        client.chat.completions.create(model="my-model", max_tokens=4,
                                                       messages=[{"role": "user", "content": "Hi"}])
            finally:
                serve.terminate()
                _, err = serve.communicate(timeout=60)
            where = "--chat-template" if template else "no chat template"
            assert where in err, err[-3000:]
    finally:
        down = dgr("down", str(deployment), "--run-dir", str(run), ok=False)
    assert down.returncode == 0, down.stderr
    gone = dgr("status", str(deployment), "--run-dir", str(run), "--json", ok=False)
    assert gone.returncode != 0 and json.loads(gone.stdout)["state"] == "down", gone.stdout
