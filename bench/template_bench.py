"""The cost of rendering chat templates in kiln's worker process instead of in the server's own.

    python bench/template_bench.py [--renders 300]

SmolLM2's own template over conversations of 1, 8 and 100 turns; each render in-process and through
`render_chat` interleaved, medians printed (docs/PERF.md, chat templates in a worker process)."""

from __future__ import annotations

import argparse
import statistics
import time

from kiln import chat
from kiln.gguf import GGUFFile
from kiln.store import Store
from kiln.tokenizer import Tokenizer


def conversation(turns: int) -> list[dict]:
    return [{"role": "system", "content": "You are a helpful assistant."}] + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " + "lorem ipsum dolor sit amet " * 8}
        for i in range(turns)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--renders", type=int, default=300)
    args = parser.parse_args()
    template = Tokenizer.from_gguf(GGUFFile(Store().ensure(args.model).path)).chat_template
    t0 = time.perf_counter()
    chat.render_chat(template, conversation(1))
    print(f"first render (starts a worker): {(time.perf_counter() - t0) * 1e3:.0f} ms")
    for turns in (1, 8, 100):
        messages = conversation(turns)
        variables = dict(messages=messages, tools=None, add_generation_prompt=True, bos_token="", eos_token="")
        here, worker = [], []
        for _ in range(args.renders):
            t0 = time.perf_counter()
            chat._compile(template).render(**variables)
            here.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            chat.render_chat(template, messages, max_chars=1 << 20)
            worker.append(time.perf_counter() - t0)
        a, b = statistics.median(here) * 1e3, statistics.median(worker) * 1e3
        print(f"{turns:4d} turns: in-process {a:.3f} ms, worker {b:.3f} ms, overhead {b - a:.3f} ms")


if __name__ == "__main__":
    main()
