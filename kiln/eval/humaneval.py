"""`kiln eval humaneval`: HumanEval pass@1 with greedy decoding.

Each problem's prompt (the function's signature and docstring) is completed greedily as plain text,
cut at the first stop sequence (the function is over once a new top-level statement starts), and the
prompt + completion + the problem's tests run in a separate Python process, never in kiln's. That
process gets a wall-clock timeout (its whole process group is killed), CPU-time, address-space,
file-size and core-dump limits, an empty temporary directory as its working directory and home, and
no inherited environment. Network access is not blocked: run untrusted models' code in a container.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.errors import KilnError

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#")
OUTPUT_LIMIT = 1 << 20  # bytes a program may write (RLIMIT_FSIZE): endless printing is a failure, not a full disk

# Runs in the child before any generated code: limits first, then the program, as __main__.
RUNNER = r"""
import resource, sys
memory, cpu, output, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
with open(path, encoding="utf-8") as f:
    source = f.read()
sys.argv = [path]
exec(compile(source, path, "exec"), {"__name__": "__main__", "__file__": path})
"""


@dataclass
class Outcome:
    status: str  # "passed", "failed" or "timed out"
    detail: str  # for a failure, the last line the program wrote (usually the exception)
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_sandboxed(program: str, timeout: float = 5.0, memory_bytes: int = 1 << 30) -> Outcome:
    """Run `program` in a fresh Python process under the limits above; never raises for its failures."""
    cpu = max(1, int(np.ceil(timeout)))
    with tempfile.TemporaryDirectory(prefix="kiln-sandbox-") as tmp:
        source, output = Path(tmp) / "program.py", Path(tmp) / "output"
        source.write_text(program, encoding="utf-8")
        env = {"PATH": os.defpath, "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        command = [sys.executable, "-I", "-c", RUNNER, str(memory_bytes), str(cpu), str(OUTPUT_LIMIT), str(source)]
        t0 = time.perf_counter()
        with open(output, "wb") as out:
            # its own session, so the timeout can kill everything it started, not just the child
            proc = subprocess.Popen(command, cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout)
                timed_out = code in (-signal.SIGXCPU, -signal.SIGKILL)  # the CPU limit's two signals
            except subprocess.TimeoutExpired:
                timed_out, code = True, None
            finally:
                _kill_group(proc.pid)
                proc.wait()
        seconds = time.perf_counter() - t0
        lines = output.read_bytes()[-4096:].decode("utf-8", "replace").strip().splitlines()
    if timed_out:
        return Outcome("timed out", f"killed after {seconds:.1f} s", seconds)
    if code == 0:
        return Outcome("passed", "", seconds)
    last = lines[-1] if lines else f"exit status {code}"
    return Outcome("failed", last, seconds)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def check_program(problem: dict, completion: str) -> str:
    return f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"


def cut_at_stop(text: str) -> str | None:
    """`text` up to the first stop sequence, or None when it has none yet."""
    cuts = [i for i in (text.find(s) for s in STOP_SEQUENCES) if i >= 0]
    return text[: min(cuts)] if cuts else None


def complete(model, prompt: str, max_tokens: int) -> tuple[str, int]:
    """The greedy completion of `prompt`, cut at a stop sequence, and the tokens generated."""
    tok, engine = model.tokenizer, model.engine
    ids = tok.encode(prompt)
    budget = min(max_tokens, model.n_ctx - len(ids))
    if budget < 1:
        raise KilnError(f"the prompt is {len(ids)} tokens; it leaves no room in the context of {model.n_ctx} "
                        "(raise --ctx)")
    logits = engine.forward(ids, 0, 0)
    stream, text = tok.stream(), ""
    for step in range(budget):
        token = int(np.argmax(logits))
        if token in tok.stop_ids:
            return text + stream.flush(), step
        text += stream.feed(token)
        if (cut := cut_at_stop(text)) is not None:
            return cut, step + 1
        if step + 1 < budget:
            logits = engine.forward([token], 0, len(ids) + step)
    text += stream.flush()
    cut = cut_at_stop(text)
    return (text if cut is None else cut), budget


def run(model, problems: list[dict], max_tokens: int, timeout: float, memory_bytes: int, progress=None) -> dict:
    results, passed = [], 0
    for i, problem in enumerate(problems):
        t0 = time.perf_counter()
        completion, n_tokens = complete(model, problem["prompt"], max_tokens)
        gen_s = time.perf_counter() - t0
        outcome = run_sandboxed(check_program(problem, completion), timeout, memory_bytes)
        passed += outcome.passed
        results.append({"task_id": problem["task_id"], "completion": completion, "tokens": n_tokens,
                        "result": outcome.status, "detail": outcome.detail, "generate_s": round(gen_s, 3),
                        "execute_s": round(outcome.seconds, 3)})
        if progress:
            progress(f"[{i + 1}/{len(problems)}] {problem['task_id']:<14} {outcome.status:<9} {n_tokens:4d} tokens "
                     f"{gen_s:6.1f} s  {outcome.detail[:60]}")
    n = len(problems)
    p = passed / n if n else 0.0
    return {"problems": n, "passed": passed, "pass_at_1": p,
            "pass_at_1_unc": (p * (1 - p) / (n - 1)) ** 0.5 if n > 1 else 0.0, "results": results}
