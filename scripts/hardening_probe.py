"""Hostile-input probe of the CLI, crafted .pte files and exports (issue 12's closing table).

Run from the checkout to measure: ``PYTHONPATH=. .venv/bin/python scripts/hardening_probe.py WORKDIR``.
Each case runs ``python -m mlx_pte ...`` in a subprocess and is classified:
clear = exit status 1 (or a documented quiet status) with one ``error:`` line and no traceback;
ok = the expected success; crash = a traceback or any other output shape; hang = past the time limit.
Prints one row per case and a per-category summary.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

TIMEOUT = 60


def cli(*args: str | bytes, stdin=None, timeout: float = TIMEOUT, cwd=None, env=None, shell: str | None = None):
    cmd = shell if shell else [sys.executable, "-m", "mlx_pte", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout, cwd=cwd, env=env, shell=bool(shell),
                              stdin=subprocess.DEVNULL if stdin is None else stdin)
    except subprocess.TimeoutExpired:
        return None
    return done


def classify(done, expect_ok: bool = False) -> str:
    if done is None:
        return "hang"
    err = done.stderr.decode("utf-8", "replace")
    if "Traceback" in err or "Warning" in err:
        return "crash"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    if expect_ok:
        return "ok" if done.returncode == 0 else ("clear" if done.returncode == 1 and len(lines) == 1 else "crash")
    if done.returncode in (1, 2) and len(lines) == 1 and lines[0].startswith("error: "):
        return "clear"
    return f"wrong(rc={done.returncode})"


def build_base(work: Path) -> Path:
    from mlx_pte.export.hf_export import export_hf
    from tests.fixtures.tiny_models import build_tiny_checkpoint

    ckpt = work / "llama"
    if not (ckpt / "config.json").exists():
        build_tiny_checkpoint("llama", ckpt)
    pte = work / "base.pte"
    if not pte.exists():
        export_hf(ckpt, pte, max_step=16, progress=False)
    return pte


def craft(base: Path, out: Path, manifest_edit=None, graph_edit=None) -> Path:
    """``base`` with its manifest and/or graph altered, the CRC recomputed (validation bypassed)."""
    import dataclasses

    from mlx_pte.ir.pte import read_pte
    from tests.fixtures.crafted_pte import craft_payload, write_pte

    p = read_pte(base)
    manifest = dict(p.manifest)
    graph = dataclasses.replace(p.graph, instructions=list(p.graph.instructions))
    if manifest_edit:
        manifest_edit(manifest)
    if graph_edit:
        graph_edit(graph)
    return write_pte(out, craft_payload(p, graph=graph, manifest=manifest))


def set_attr(op: str, name: str, value):
    def edit(graph):
        from mlx_pte.ir.graph import Instruction

        for i, instr in enumerate(graph.instructions):
            if instr.op == op:
                attrs = tuple((k, value if k == name else v) for k, v in instr.attrs)
                graph.instructions[i] = Instruction(instr.op, instr.inputs, instr.outputs, attrs)
                return
        raise SystemExit(f"the base graph has no {op}")

    return edit


def main() -> None:
    work = Path(sys.argv[1]).resolve()
    work.mkdir(parents=True, exist_ok=True)
    base = build_base(work)
    rows: list[tuple[str, str, str]] = []

    def record(category: str, name: str, outcome: str) -> None:
        rows.append((category, name, outcome))
        print(f"{category:10} {name:44} {outcome}", flush=True)

    def run(path: Path) -> list[str]:
        return ["run", str(path), "--max-new-tokens", "3"]

    # -- templates ------------------------------------------------------------------
    marker = work / "pwned.txt"
    payloads = {
        "cycler.__init__.__globals__": "{{ cycler.__init__.__globals__.os.popen('touch %s').read() }}",
        "joiner.__init__.__globals__": "{{ joiner.__init__.__globals__.os.popen('touch %s').read() }}",
        "namespace.__init__.__globals__": "{{ namespace.__init__.__globals__.os.popen('touch %s').read() }}",
        "lipsum.__globals__": "{{ lipsum.__globals__['os'].popen('touch %s').read() }}",
        "__subclasses__": "{% for c in ''.__class__.__mro__[1].__subclasses__() %}"
                          "{% if c.__name__ == 'Popen' %}{{ c(['touch', '%s']) }}{% endif %}{% endfor %}",
        "function attribute (raise_exception.__globals__)":
            "{{ raise_exception.__globals__['os'].popen('touch %s').read() }}",
        "str.format escape": "{{ '{0.__class__.__init__.__globals__}'.format(cycler) }}%s",
        "list.append mutation": "{% set x = [] %}{{ x.append(1) }}{{ x }}%s",
        "huge string *": "{{ 'a' * 100000000 }}%s",
        "huge range": "{% for i in range(10**10) %}{% endfor %}%s",
    }
    for name, text in payloads.items():
        marker.unlink(missing_ok=True)
        f = craft(base, work / "t.pte", manifest_edit=lambda m, t=text: m.update(chat_template=t.replace("%s", str(marker))))
        done = cli(*run(f), "--chat", "--prompt", "hi", timeout=60)
        outcome = classify(done)
        if marker.exists():
            outcome = "RAN CODE"
        record("templates", name, outcome)
    for name, text in {
        "syntax error (run --chat)": "{% for m in messages %}{{ m['content'] }",
        "raise_exception('…') (HF helper)": "{{ raise_exception('roles must alternate') }}",
        "undefined filter": "{{ messages | nosuchfilter }}",
    }.items():
        f = craft(base, work / "t.pte", manifest_edit=lambda m, t=text: m.update(chat_template=t))
        record("templates", name, classify(cli(*run(f), "--chat", "--prompt", "hi")))
    f = craft(base, work / "t.pte", manifest_edit=lambda m: m.update(
        chat_template="{{ bos_token }}{{ strftime_now('%Y') }}{{ messages | tojson(indent=2) }}{% for m in messages %}"
                      "{% if loop.index > 5 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"))
    record("templates", "HF helpers (strftime_now, tojson, break): runs",
           classify(cli(*run(f), "--chat", "--prompt", "hi"), expect_ok=True))

    # -- CLI flags -------------------------------------------------------------------
    record("cli", "run --max-new-tokens 0", classify(cli("run", str(base), "--prompt", "hi", "--max-new-tokens", "0")))
    record("cli", "run --max-new-tokens -1", classify(cli("run", str(base), "--prompt", "hi", "--max-new-tokens", "-1")))
    record("cli", "run --prompt <non-UTF-8 bytes>",
           classify(cli("run", str(base), "--max-new-tokens", "2", "--prompt", b"\xff\xfe")))
    jsonl = work / "prompts.jsonl"
    jsonl.write_text('{"prompt": "\\ud800"}\n')
    record("cli", 'run --prompts JSONL with "\\ud800"', classify(cli("run", str(base), "--prompts", str(jsonl))))
    bad_utf8 = work / "prompts.txt"
    bad_utf8.write_bytes(b"hello\n\xff\xfe\n")
    record("cli", "run --prompts non-UTF-8 file", classify(cli("run", str(base), "--prompts", str(bad_utf8))))
    record("cli", "run --temperature 1e-320",
           classify(cli(*run(base), "--prompt", "hi", "--temperature", "1e-320"), expect_ok=True))
    record("cli", "run --temperature nan", classify(cli(*run(base), "--prompt", "hi", "--temperature", "nan")))
    record("cli", "run --seed -1", classify(cli(*run(base), "--prompt", "hi", "--seed", "-1")))
    record("cli", "serve --port 99999", classify(cli("serve", str(base), "--port", "99999", timeout=30)))
    done = cli(shell=f"bash -c '{sys.executable} -m mlx_pte inspect {base} | true; exit ${{PIPESTATUS[0]}}'")
    quiet = done is not None and b"error" not in done.stderr and b"Traceback" not in done.stderr
    record("cli", "inspect FILE | true (reader gone)", "ok (quiet)" if quiet else classify(done))
    fifo = work / "fifo.pte"
    if not fifo.exists():
        os.mkfifo(fifo)
    record("cli", "run FIFO", classify(cli("run", str(fifo), "--prompt", "hi", timeout=20)))
    record("cli", "inspect FIFO", classify(cli("inspect", str(fifo), timeout=20)))
    record("cli", "inspect a directory", classify(cli("inspect", str(work))))

    # -- crafted files -----------------------------------------------------------------
    cases = {
        "tokenizer is not JSON": dict(manifest_edit=lambda m: m.update(tokenizer="not json {")),
        "tokenizer JSON that does not build": dict(manifest_edit=lambda m: m.update(tokenizer='{"model": 3}')),
        "template syntax error (plain run)": dict(manifest_edit=lambda m: m.update(chat_template="{% if %}")),
        "max_step is a string": dict(manifest_edit=lambda m: m.update(max_step="many")),
        "eos_token_ids is a dict": dict(manifest_edit=lambda m: m.update(eos_token_ids={"a": 1})),
        "bos_token_id is a string": dict(manifest_edit=lambda m: m.update(bos_token_id="one")),
        "vocab_size -5": dict(manifest_edit=lambda m: m.update(vocab_size=-5)),
        "cache is a string": dict(manifest_edit=lambda m: m.update(cache="flat")),
        "chat_template is a list": dict(manifest_edit=lambda m: m.update(chat_template=["x"])),
        "unsqueeze dim 115": dict(graph_edit=set_attr("unsqueeze", "dim", 115)),
        "permute dims (0, 1441794, 1, 3)": dict(graph_edit=set_attr("permute", "dims", (0, 1441794, 1, 3))),
        "permute dims (0, 0, 1, 2)": dict(graph_edit=set_attr("permute", "dims", (0, 0, 1, 2))),
        "softmax dim -9": dict(graph_edit=set_attr("softmax", "dim", -9)) ,
        "cast dtype 'float99'": dict(graph_edit=set_attr("cast", "dtype", "float99")),
        "slice step 0": dict(graph_edit=set_attr("slice", "step", 0)),
        "mean dims (7,)": dict(graph_edit=set_attr("mean", "dims", (7,))),
        "view shape (-3, 4)": dict(graph_edit=set_attr("view", "shape", (-3, 4))),
        "update_and_attend cache_id 9": dict(graph_edit=set_attr("update_and_attend", "cache_id", 9)),
        "gelu approximate 'fast'": dict(graph_edit=set_attr("gelu", "approximate", "fast")),
    }
    for name, edit in cases.items():
        try:
            f = craft(base, work / "c.pte", **edit)
        except SystemExit as exc:
            record("files", name, f"n/a ({exc})")
            continue
        record("files", name, classify(cli(*run(f), "--prompt", "hi")))

    # -- file writes -------------------------------------------------------------------
    ckpt = work / "llama"
    out = work / "exp"
    out.mkdir(exist_ok=True)
    target = out / "m.pte"
    target.unlink(missing_ok=True)
    done = cli("export", str(ckpt), "-o", str(target), "--no-progress", "--max-step", "8",
               env={**os.environ}, timeout=300)
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
    umask = os.umask(0)
    os.umask(umask)
    want = 0o666 & ~umask
    record("writes", f"export mode (umask {umask:03o})",
           "ok" if mode == want else f"wrong (mode {oct(mode) if mode is not None else None}, want {oct(want)})")
    # kill -9 just before the rename: what does the directory hold?
    killed = out / "killed.pte"
    script = (
        "import os, signal\n"
        "os.replace = lambda a, b: os.kill(os.getpid(), signal.SIGKILL)\n"
        "from mlx_pte.cli import main\n"
        f"main(['export', {str(ckpt)!r}, '-o', {str(killed)!r}, '--no-progress', '--max-step', '8'])\n"
    )
    subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    left = sorted(p.name for p in out.iterdir() if p.name not in ("m.pte",))
    hidden = [n for n in left if n.startswith(".")]
    record("writes", "kill -9 mid-write: leftovers", f"hidden leftover {hidden}" if hidden else f"visible {left}")
    done = cli("export", str(ckpt), "-o", str(killed), "--no-progress", "--max-step", "8", timeout=300)
    left = sorted(p.name for p in out.iterdir() if p.name not in ("m.pte", "killed.pte"))
    record("writes", "next export cleans stale temp", "ok" if not left and done.returncode == 0 else f"left {left}")
    slash = work / "slashdir"
    done = cli("export", str(ckpt), "-o", str(slash) + "/", "--no-progress", "--max-step", "8", timeout=300)
    what = "file named dir" if slash.is_file() else (f"dir/{os.listdir(slash)}" if slash.is_dir() else "nothing")
    record("writes", "-o missing-dir/ (trailing slash)", f"{classify(done, expect_ok=True)}: {what}")
    existing = work / "existingdir"
    existing.mkdir(exist_ok=True)
    done = cli("export", str(ckpt), "-o", str(existing), "--no-progress", "--max-step", "8", timeout=300)
    record("writes", "-o existing-dir", f"{classify(done, expect_ok=True)}: {os.listdir(existing)}")
    missing = work / "no" / "such" / "dir" / "m.pte"
    done = cli("export", str(ckpt), "-o", str(missing), "--no-progress", "--max-step", "8", timeout=300)
    record("writes", "-o missing/parent/m.pte",
           f"{classify(done, expect_ok=True)}: {'created' if missing.exists() else 'not created'}; "
           f"stdout={done.stdout.decode().strip()[:80]!r}")

    summary = defaultdict(lambda: defaultdict(int))
    for category, _, outcome in rows:
        key = outcome.split(" ")[0].split("(")[0].rstrip(":")
        summary[category][key] += 1
    print(json.dumps({c: dict(v) for c, v in summary.items()}, indent=1))


if __name__ == "__main__":
    main()
