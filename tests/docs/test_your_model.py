"""docs/your-model.md, walked as a new user walks it: the page's own command lines, as it shows them, run in
order in a shell (`$ dgr ...` and `$ python chat.py`, read from its console blocks), with its deployment
file and its `chat.py`. A command of the page that no longer works as written, or prints another run
folder, route or exit status than the page shows, fails this test.

Only what must differ is replaced, in one visible table (`_substitutions`): the page's model is a GGUF we
cannot ship in a test, so here it is a tiny synthetic llama quantized to Q4_K by llama.cpp's own
quantizer, with no chat template; the page's folder `/tmp/yd` is a temporary one; its fixed ports are free
ones; its bundle id is the one this model builds to; and its deployment file's layer ranges are the ones
this model's recipe places. Where such a model behaves differently, the page says so, and so does the test
(the quantization rule switched on; the chat template given to `dgr serve`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import gguf
import openai
import pytest

from dgr.runtime.engine import quantize

from support.deploy import private_engine
from support.engine import synth_model
from support.paths import REPO

pytestmark = [pytest.mark.slow]

PAGE = REPO / "docs" / "your-model.md"
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


def page_commands(text: str) -> list[tuple[str, str]]:
    """Each `$ ` line of the page's console blocks, in order, with the output the page shows under it."""
    out: list[tuple[str, str]] = []
    for block in re.findall(r"^```console\n(.*?)^```", text, re.M | re.S):
        for line in block.splitlines():
            if line.startswith("$ "):
                out.append((line[2:], ""))
            elif out:
                out[-1] = (out[-1][0], out[-1][1] + line + "\n")
    return out


def page_block(text: str, after: str, lang: str) -> str:
    """The first ```lang block after the line that starts with `after` (the page's file of that name)."""
    tail = text[text.index("\n" + after):]
    return re.search(rf"^```{lang}\n(.*?)^```", tail, re.M | re.S).group(1)


def same(pattern: str, shown: str, real: str) -> None:
    """What `pattern` picks out of the page's shown output is what it picks out of the real output."""
    want, got = re.search(pattern, shown, re.M), re.search(pattern, real, re.M)
    assert want, f"the page no longer shows {pattern!r}:\n{shown}"
    assert got and got.groups() == want.groups(), \
        f"the page shows {want.group(0)!r}, the command printed:\n{real[-3000:]}"


class Page:
    """The page's commands, taken in order: `take(start)` returns the next one, failing when it does not
    start as the test expects (so a command added, dropped or reordered on the page is noticed), with
    `subst` applied to it and to its shown output."""

    def __init__(self, text: str, subst: list[tuple[str, str]]):
        self.commands = page_commands(text)
        self.subst = subst
        self.next = 0

    def apply(self, text: str) -> str:
        for old, new in self.subst:
            text = re.sub(rf"(?<![\w.]){re.escape(old)}(?![\w])", new.replace("\\", "\\\\"), text)
        return text

    def take(self, start: str) -> tuple[str, str]:
        assert self.next < len(self.commands), f"the page has no more commands; the test expects `{start} ...`"
        line, shown = self.commands[self.next]
        assert line.startswith(start), f"the page's command {self.next + 1} is `{line}`; the test expects `{start} ...`"
        self.next += 1
        return self.apply(line), self.apply(shown)


@pytest.fixture(scope="module")
def walk(tmp_path_factory, engine_lib):
    root = tmp_path_factory.mktemp("your-model")
    bin_dir = root / "bin"          # `dgr` and `python` as the page's shell finds them: this checkout's
    bin_dir.mkdir()
    for name, run in (("dgr", f'"{sys.executable}" -m dgr.cli.main'), ("python", f'"{sys.executable}"')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {run} "$@"\n')
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, **private_engine(engine_lib, root / "engine"), "DGR_WORKSPACE": str(root / "workspace"),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}

    def sh(line: str, *, ok: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        """One of the page's command lines, in a shell in the page's folder."""
        p = subprocess.run(["bash", "-c", line], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        if ok:
            assert p.returncode == 0, f"$ {line}\nrc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        return p

    # "The model you have": K-quant weights (a width of 256: whole Q4_K blocks) and no chat template.
    f32 = synth_model(root / "src", "llama", layers=6, embd=256)
    (root / "models").mkdir()
    model = quantize(f32, root / "models" / "base-model-Q4_K.gguf", "Q4_K", lib=env["DGR_ENGINE_LIB"])
    return {"root": root, "model": model, "env": env, "sh": sh}


def _substitutions(root: Path, model: Path, ports: list[int]) -> list[tuple[str, str]]:
    """What the page's commands name that must differ here (every other character runs as the page has it);
    the bundle id joins once this model is built."""
    return [("/tmp/yd", str(root)),
            ("models/SmolLM2-135M-Instruct.Q4_1.gguf", str(model.relative_to(root))),
            *((str(page_port), str(port)) for page_port, port in zip((7400, 7410, 7420, 8400), ports))]


def test_the_pages_commands_work_as_written_from_inspect_to_the_openai_client(walk):
    root, model, sh = walk["root"], walk["model"], walk["sh"]
    reader = gguf.GGUFReader(model)
    assert gguf.Keys.Tokenizer.CHAT_TEMPLATE not in reader.fields
    assert {t.tensor_type.name for t in reader.tensors} >= {"Q4_K"}
    text = PAGE.read_text()
    ports = _free_ports(4)
    page = Page(text, _substitutions(root, model, ports))

    # 1. inspect: what the model is, its template (none) and where generation ends
    line, shown = page.take("dgr inspect ")
    out = sh(line).stdout
    same(r"^(file: .*)$", shown, out)
    assert "chat template:   none" in out, out
    info = json.loads(sh(line + " --json").stdout)           # (the page mentions --json; not a console line)
    eos = reader.fields[gguf.Keys.Tokenizer.EOS_ID].parts[-1][0]
    assert info["chat_template"]["present"] is False
    assert int(eos) in [t["id"] for t in info["special_tokens"]["eog"]], info["special_tokens"]

    # 2. a recipe scaffolded from the model; the example quantization rule switched on (the page says so)
    line, shown = page.take("dgr recipe new ")
    same(r"^(\S+recipe\.toml)$", shown, sh(line).stdout)
    recipe = root / "recipes" / "smollm2-mine" / "recipe.toml"
    rtext = recipe.read_text()
    assert "\n# rules = [" in rtext
    recipe.write_text(rtext.replace("\n# rules = [", "\nrules = ["))
    # 3. plan
    line, shown = page.take("dgr recipe plan ")
    plan = sh(line).stdout
    assert "3 stages" in plan and "llama.cpp never quantizes" in plan, plan

    # 3. build (from here the page's bundle id is this model's), verify
    line, shown = page.take("dgr recipe build ")
    built = sh(line).stdout
    bundle_id = re.search(r"^bundle ([0-9a-f]{64})$", built, re.M).group(1)
    page_id = re.search(r"^bundle ([0-9a-f]{64})$", shown, re.M).group(1)
    page.subst += [(page_id, bundle_id), (page_id[:12], bundle_id[:12])]
    shown = page.apply(shown)
    same(r"^  at (\S+)$", shown, built)
    line, shown = page.take("dgr bundle verify ")
    same(r"^(ok: bundle \S+): ", shown, sh(line).stdout)

    # 4. parity (against the same recipe as one stage: the bundle is quantized)
    line, shown = page.take("dgr parity ")
    parity = sh(line).stdout
    assert "parity: EXACT" in parity and "the recipe built as one stage" in parity, parity
    # 5. certify
    line, shown = page.take("dgr certify ")
    cert = sh(line).stdout
    same(r"^(certificate: \S+ \(valid);", shown, cert)
    assert json.loads((root / "cert.json").read_text())["passed"] is True

    # 6. the page's deployment file (its folder, ports and layer ranges replaced, nothing else), up, status
    deployment = root / "deploy" / "smollm2-mine.toml"
    deployment.parent.mkdir()
    stages = tomllib.loads(recipe.read_text())["placement"]["stages"]
    dtext = page.apply(page_block(text, "**deploy/smollm2-mine.toml**", "toml"))
    page_layers = re.findall(r"^layers = \[\d+, \d+\]$", dtext, re.M)
    assert len(page_layers) == len(stages) == 3, (page_layers, stages)
    for old, (a, b) in zip(page_layers, stages):
        dtext = dtext.replace(old, f"layers = [{a}, {b}]", 1)
    deployment.write_text(dtext)
    route = ",".join(f"127.0.0.1:{p}" for p in ports[:3])

    line, shown = page.take("dgr deploy plan ")
    plan = sh(line).stdout
    same(r"^route: (\S+)$", shown, plan)
    assert f"route: {route}" in plan, plan
    try:
        line, shown = page.take("dgr up ")
        up = sh(line)
        same(r"supervised, logs in (\S+)$", shown, up.stdout)        # the run folder the page says
        same(r"^route: (\S+)$", shown, up.stdout)
        line, shown = page.take("dgr status ")
        status = sh(line).stdout
        same(r"^exit (\d+)$", shown, status)
        same(r"^(smollm2-mine: \w+ \(\d+ of \d+ local worker\(s\) up\))", shown, status)
        same(r"^(route \(\w+\): \S+)$", shown, status)

        # 7. generate
        line, shown = page.take("dgr generate ")
        sh(line)
        line, shown = page.take("dgr generate ")
        assert "decode" in sh(line).stderr

        # 8. the gateway: the page's line serves completions at once; chat only with a template (this model
        # has none): then the page's `dgr serve ... --chat-template chatml.jinja`
        serve_line, shown = page.take("dgr serve ")
        chat_line, chat_shown = page.take("python chat.py")
        (root / "chat.py").write_text(page.apply(page_block(text, "`chat.py`:", "python")))
        (root / "chatml.jinja").write_text(CHATML)
        for extra in ("", " --chat-template chatml.jinja"):
            serve = subprocess.Popen(["bash", "-c", serve_line + extra], cwd=root, env=walk["env"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
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
                assert models == ["smollm2-mine"]
                done = client.completions.create(model="smollm2-mine", prompt="Hello", max_tokens=8,
                                                 extra_body={"ignore_eos": True})
                assert done.usage.completion_tokens == 8 and done.choices[0].finish_reason == "length"
                chat = sh(chat_line, ok=False)
                if extra:
                    assert chat.returncode == 0, chat.stderr[-3000:]
                    same(r"^(?:stop|length) \d+ tokens$", chat_shown, chat.stdout)
                else:
                    assert chat.returncode != 0 and "Error code: 400" in chat.stderr, chat.stderr[-3000:]
                    assert "has no chat template" in chat.stderr, chat.stderr[-3000:]
            finally:
                os.killpg(serve.pid, signal.SIGTERM)
                _, err = serve.communicate(timeout=60)
            where = "--chat-template" if extra else "no chat template"
            assert where in err, err[-3000:]

        # 9. down, and status says so
        line, shown = page.take("dgr down ")
        same(r"(none left)$", shown, sh(line).stdout)
        line, shown = page.take("dgr status ")
        gone = sh(line).stdout
        same(r"^exit (\d+)$", shown, gone)
        same(r"not up \(run folder (\S+)\)", shown, gone)
    finally:
        # whatever the page says, leave nothing running (its run folder, and the default one)
        for where in (f" --run-dir {root / 'run'}", ""):
            sh(f"dgr down deploy/smollm2-mine.toml{where}", ok=False)
    assert page.next == len(page.commands), f"commands of the page this test does not run: {page.commands[page.next:]}"
