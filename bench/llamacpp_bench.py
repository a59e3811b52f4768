"""llama-bench's pp/tg measurement, through llama.cpp's C API as llama-cpp-python exposes it.

Run it with a Python that has llama-cpp-python (built from source here: `pip install llama-cpp-python`):
    python bench/llamacpp_bench.py MODEL.gguf -p 512 -n 128 -t 1,2 -r 5 [-d 0,1024] [--json]
Like llama-bench: tokens are random ids, each test starts from an empty KV cache (after `-d` tokens of
depth), prompt processing is one batch, generation is one token per decode call, and neither
tokenization nor sampling is timed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import llama_cpp as ll


def decode(ctx, batch, tokens, start, last_logits):
    batch.n_tokens = len(tokens)
    for i, tok in enumerate(tokens):
        batch.token[i] = tok
        batch.pos[i] = start + i
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = last_logits and i == len(tokens) - 1
    if ll.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")


def run(path: str, threads: int, n_prompt: int, n_gen: int, depth: int, reps: int, mmap: bool = True) -> list[dict]:
    params = ll.llama_model_default_params()
    # llama-bench's --mmap 0: the weights read into memory at load, so that no step waits on a page the
    # kernel evicted (a mixture of experts touches a different part of the file at each token)
    params.use_mmap = mmap
    model = ll.llama_model_load_from_file(path.encode(), params)
    vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    cp = ll.llama_context_default_params()
    cp.n_ctx = depth + max(n_prompt, n_gen) + 16
    cp.n_batch = cp.n_ubatch = max(n_prompt, depth, 1)
    cp.n_threads = cp.n_threads_batch = threads
    ctx = ll.llama_init_from_model(model, cp)
    batch = ll.llama_batch_init(cp.n_batch, 0, 1)
    mem = ll.llama_get_memory(ctx)
    rng = random.Random(0)
    results = []
    for test, n in (("pp", n_prompt), ("tg", n_gen)):
        if n == 0:
            continue
        samples = []
        for rep in range(reps + 1):  # the first run warms up and is not counted
            ll.llama_memory_clear(mem, True)
            if depth:
                decode(ctx, batch, [rng.randrange(vocab) for _ in range(depth)], 0, False)
                ll.llama_synchronize(ctx)
            t0 = time.perf_counter_ns()
            if test == "pp":
                decode(ctx, batch, [rng.randrange(vocab) for _ in range(n)], depth, True)
            else:
                for i in range(n):
                    decode(ctx, batch, [rng.randrange(vocab)], depth + i, True)
            ll.llama_synchronize(ctx)
            if rep:
                samples.append(time.perf_counter_ns() - t0)
        ts = [n / (s / 1e9) for s in samples]
        results.append({"test": f"{test}{n}" + (f" @ d{depth}" if depth else ""), "threads": threads,
                        "avg_ns": statistics.mean(samples), "avg_ts": statistics.mean(ts),
                        "stddev_ts": statistics.stdev(ts) if len(ts) > 1 else 0.0, "samples_ts": ts})
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", default="2")
    ap.add_argument("-d", default="0")
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mmap", type=int, default=1, help="0: read the weights into memory at load (llama-bench's)")
    a = ap.parse_args()
    ll.llama_backend_init()
    rows = [r for t in map(int, a.t.split(",")) for d in map(int, a.d.split(","))
            for r in run(a.model, t, a.p, a.n, d, a.r, bool(a.mmap))]
    if a.json:
        print(json.dumps({"engine": "llama.cpp", "version": ll.__version__, "results": rows}, indent=1))
    else:
        for r in rows:
            print(f"{r['test']:>14}  t={r['threads']}  {r['avg_ts']:8.1f} ± {r['stddev_ts']:.1f} t/s")


if __name__ == "__main__":
    main()
